"""Benchmark children start from the environment as it was before ``import ucxx``.

``import ucxx`` writes UCX_* defaults into ``os.environ``; ``child_env`` must
take them out again for peer children, keep what the user had set, and leave
every other variable alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvbridge.bench.peers.child_env import UCXX_ENV_DEFAULTS, child_env

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ucxx_imported(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This process as ucxx leaves it: module loaded, its defaults in the environment."""
    monkeypatch.setitem(sys.modules, "ucxx", types.ModuleType("ucxx"))
    for name, value in UCXX_ENV_DEFAULTS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("UCX_TLS", "tcp")  # not one of ucxx's: always passed on
    return monkeypatch


def test_with_a_snapshot_ucxx_values_give_way_to_the_earlier_ones(
        ucxx_imported: pytest.MonkeyPatch) -> None:
    env = child_env(before_ucxx={"UCX_RNDV_THRESH": "1234"})
    assert env["UCX_RNDV_THRESH"] == "1234"
    assert not (set(UCXX_ENV_DEFAULTS) - {"UCX_RNDV_THRESH"}) & set(env)
    assert env["UCX_TLS"] == "tcp"


def test_without_a_snapshot_only_ucxx_default_values_are_dropped(
        ucxx_imported: pytest.MonkeyPatch) -> None:
    ucxx_imported.setenv("UCX_MAX_RNDV_RAILS", "2")  # not ucxx's value: someone chose it
    env = child_env(before_ucxx=None)
    assert env["UCX_MAX_RNDV_RAILS"] == "2"
    assert not (set(UCXX_ENV_DEFAULTS) - {"UCX_MAX_RNDV_RAILS"}) & set(env)
    assert env["UCX_TLS"] == "tcp"


def test_without_ucxx_nothing_is_taken_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ucxx", raising=False)
    monkeypatch.setenv("UCX_RNDV_THRESH", "8192")
    assert child_env(before_ucxx={}) == dict(os.environ)


def test_paths_are_prepended_and_the_parent_is_untouched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/old")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    before = dict(os.environ)
    env = child_env({"LD_LIBRARY_PATH": "/new", "PYTHONPATH": "/repo"})
    assert env["LD_LIBRARY_PATH"] == os.pathsep.join(["/new", "/old"])
    assert env["PYTHONPATH"] == "/repo"
    assert dict(os.environ) == before


# What a child started by the harness would see, next to what ucxx did to the parent.
_PROBE = """
import json, os, sys
for module in sys.argv[1].split(","):
    __import__(module)
from kvbridge.bench.peers.child_env import child_env
ucx = lambda env: {k: v for k, v in env.items() if k.startswith("UCX_")}
print(json.dumps({"parent": ucx(os.environ), "child": ucx(child_env())}))
"""


@pytest.mark.integration
@pytest.mark.parametrize("order", ["kvbridge.bench.peers.harness,ucxx", "ucxx"])
@pytest.mark.parametrize("user_thresh", [None, "8192", "65536"])
def test_a_real_ucxx_import_does_not_reach_children(order: str, user_thresh: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    if user_thresh is not None:
        env["UCX_RNDV_THRESH"] = user_thresh
    env["PYTHONPATH"] = str(REPO_ROOT)
    out = subprocess.run([sys.executable, "-c", _PROBE, order], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["parent"]["UCX_RNDV_FRAG_MEM_TYPE"] == "cuda"  # ucxx really set it
    assert "UCX_RNDV_FRAG_MEM_TYPE" not in seen["child"]
    assert "UCX_MEMTYPE_CACHE" not in seen["child"]
    # A user's own setting survives, except the one case that cannot be told apart
    # from ucxx's: ucxx imported first and the user chose ucxx's very value.
    lost = order == "ucxx" and user_thresh == UCXX_ENV_DEFAULTS["UCX_RNDV_THRESH"]
    assert seen["child"].get("UCX_RNDV_THRESH") == (None if lost else user_thresh)
