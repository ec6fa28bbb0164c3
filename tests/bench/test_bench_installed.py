"""``kvbridge bench`` from a pip-installed kvbridge, away from any source checkout.

The package is built into a wheel (from a copy of ``pyproject.toml``,
``README.md`` and ``kvbridge/``: the build writes ``build/`` and
``*.egg-info`` beside its sources) and installed with ``pip install --no-deps
--target``; the command then runs from that folder's ``bin/kvbridge`` with a
working directory outside the repository and only the install on
``PYTHONPATH``. Every subcommand's ``--help`` answers, and a one-size
transfer benchmark runs its two agent processes (``python -m
kvbridge.bench.transfer_agents``) and verifies their bytes.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("transfer", "kernels", "paged", "e2e", "vllm", "serve", "sglang", "all")


def _pip(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                   cwd=cwd, check=True, timeout=300, capture_output=True)


def _isolation() -> list[str]:
    """``--no-build-isolation`` where this environment's setuptools can build kvbridge
    (pyproject.toml: setuptools>=77), so that nothing is downloaded; else pip fetches it."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if major >= 77 else []


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding kvbridge installed from its wheel (``kvbridge/``, ``bin/kvbridge``)."""
    tmp = tmp_path_factory.mktemp("installed")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "kvbridge", src / "kvbridge",
                    ignore=shutil.ignore_patterns("__pycache__"))
    _pip("wheel", "--no-deps", *_isolation(), "-w", str(tmp / "dist"), str(src), cwd=tmp)
    [wheel] = (tmp / "dist").glob("kvbridge-*.whl")
    _pip("install", "--no-deps", "--no-compile", "--target", str(tmp / "site"), str(wheel),
         cwd=tmp)
    return tmp / "site"


def _kvbridge(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([str(site / "bin" / "kvbridge"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_install_has_no_checkout_to_lean_on(installed: Path, tmp_path: Path) -> None:
    probe = _kvbridge(installed, tmp_path, "--help")
    assert probe.returncode == 0, probe.stderr
    env = {**os.environ, "PYTHONPATH": str(installed)}
    where = subprocess.run(
        [sys.executable, "-c", "import sys, kvbridge.bench.cli as m; "
         "print(m.__file__); print(*sys.path, sep='\\n')"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=True)
    module_file, *path = where.stdout.splitlines()
    assert Path(module_file).is_relative_to(installed)
    assert str(REPO) not in path and not (installed / "benchmarks").exists()
    # the peers' pins ship too (pip install --no-deps -r .../requirements.txt)
    assert (installed / "kvbridge" / "bench" / "peers" / "requirements.txt").is_file()


@pytest.mark.parametrize("subcommand", ["", *SUBCOMMANDS])
def test_every_bench_subcommand_answers_help(installed: Path, tmp_path: Path,
                                             subcommand: str) -> None:
    result = _kvbridge(installed, tmp_path, "bench", *filter(None, [subcommand]), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: kvbridge bench {subcommand}".rstrip())


@pytest.mark.integration  # two agent processes on loopback
def test_bench_transfer_runs_from_the_install(installed: Path, tmp_path: Path) -> None:
    result = _kvbridge(installed, tmp_path, "bench", "transfer", "--quick", "--pieces", "1",
                       "--peers", "", "--no-plot", "--out", "out")
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((tmp_path / "out" / "transfer.json").read_text())
    (row,) = record["result"]["systems"]["kvbridge"]
    assert row["verified"] and row["num_iters"] == 50


def test_bench_transfer_netns_says_it_needs_a_checkout(installed: Path, tmp_path: Path) -> None:
    # The namespace hosts are the test suite's lab (tests/integration/netns.py).
    result = _kvbridge(installed, tmp_path, "bench", "transfer", "--netns", "--out", "out")
    assert result.returncode == 2
    assert "tests/integration/netns.py" in result.stderr
    assert "run it from a checkout" in result.stderr and not (tmp_path / "out").exists()
