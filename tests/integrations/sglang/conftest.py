"""Fixtures for tests against real SGLang P/D servers (CPU engine) on a tiny random Llama.

The servers run in SGLang's own venv (``scripts/setup_sglang.sh`` -> ``.venv-sglang``),
never in pytest's. Without that venv the tests skip with how to make it, unless
``KVBRIDGE_REQUIRE_SGLANG=1`` (set by ``make pytest``), where they fail.

``sglang_set``: one shared set of servers for the package (``servers.SglangSet``),
started once, stopped at the end; a failed test's report ends with their logs' tails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.sglang.servers import PYTHON, REPO_ROOT, SglangSet

REQUIRE_ENV = "KVBRIDGE_REQUIRE_SGLANG"
_current: list[SglangSet] = []


def _venv_problem() -> str | None:
    if not PYTHON.exists():
        return f"no SGLang venv at {PYTHON.parent.parent}: run scripts/setup_sglang.sh"
    probe = subprocess.run(
        [str(PYTHON), "-c", "import sglang, kvbridge.integrations.sglang.plugin"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    if probe.returncode:
        return f"the SGLang venv cannot import sglang and kvbridge: {probe.stderr[-800:]}"
    return None


@pytest.fixture(scope="session")
def sglang_venv() -> Path:
    """The SGLang venv's python (skip or fail when it is missing or broken)."""
    problem = _venv_problem()
    if problem is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return PYTHON


@pytest.fixture(scope="session")
def sglang_model(sglang_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, 2 KV heads of 32, byte-level BPE tokenizer), float32:
    greedy tokens then do not depend on how requests were batched (bf16's do)."""
    out = tmp_path_factory.mktemp("sglang-model") / "llama"
    subprocess.run([sys.executable, "-m", "kvbridge.integrations.vllm.tiny_model", str(out),
                    "--dtype", "float32"],
                   check=True, capture_output=True, cwd=REPO_ROOT, timeout=300)
    return out


@pytest.fixture(scope="session")
def sglang_set(sglang_model: Path) -> Iterator[SglangSet]:
    """The shared servers: single, p1 (TP 1), p2 (TP 2), d (TP 1), router (p1, d)."""
    log_dir = Path(tempfile.mkdtemp(prefix="kvbridge-sglang-logs-"))
    servers = SglangSet(sglang_model, log_dir)
    servers.start()
    _current.append(servers)
    try:
        yield servers
    finally:
        _current.remove(servers)
        servers.stop()
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _current:
        report.sections.append(("SGLang server logs", _current[-1].tails()))
