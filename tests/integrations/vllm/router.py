"""vllm-router (the router vLLM P/D deployments run) as a child process of the tests.

``vllm_router`` starts the real program (its Python package runs the Rust
router) in NIXL P/D mode on a free port; ``require_router`` skips, or fails
under ``KVBRIDGE_REQUIRE_VLLM=1``, when it is not installed; ``workers`` reads
what the router thinks of its backends (``GET /workers``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integrations.vllm.servers import VllmServer
from tests.ports import free_port

#: Health checks every second, one failure takes a backend out of rotation and one
#: success brings it back (vllm-router's defaults: every 60 s, 3 failures, 2 successes).
#: A killed server fails its check at once (connection refused); a live one on a loaded
#: machine gets 15 s to answer.
FAST_HEALTH_CHECKS = ("--health-check-interval-secs", "1", "--health-check-timeout-secs", "15",
                      "--health-failure-threshold", "1", "--health-success-threshold", "1")


def require_router() -> None:
    """Skip (or, with KVBRIDGE_REQUIRE_VLLM=1, fail) if vllm-router is not installed
    (``make setup-vllm`` installs it)."""
    if importlib.util.find_spec("vllm_router") is not None:
        return
    reason = f"vllm-router is not installed in {sys.executable} (make setup-vllm installs it)"
    if os.environ.get("KVBRIDGE_REQUIRE_VLLM") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def vllm_router(prefill: list[VllmServer], decode: list[VllmServer], log_path: Path,
                *extra_args: str) -> Iterator[str]:
    """vllm-router in NIXL P/D mode in front of ``prefill`` and ``decode`` (round robin
    for both, ``extra_args`` appended); yields its URL once its ``/health`` answers."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()),  # its default, 29000, may be taken
            "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "round_robin"]
    for server in prefill:
        argv += ["--prefill", server.base_url]
    for server in decode:
        argv += ["--decode", server.base_url]
    argv += extra_args
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120  # it first waits for every backend's /health
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def workers(router_url: str) -> dict[str, dict[str, Any]]:
    """The router's backends by URL (``GET /workers``: ``is_healthy``, ``worker_type``...)."""
    response = httpx.get(f"{router_url}/workers", timeout=10)
    response.raise_for_status()
    return {worker["url"]: worker for worker in response.json()["workers"]}


def wait_health(router_url: str, backend_url: str, healthy: bool, timeout_s: float = 60.0
                ) -> None:
    """Wait until the router's health checks say ``backend_url`` is (not) ``healthy``.

    Raises:
        TimeoutError: not so after ``timeout_s``, with what the router said last.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        worker = workers(router_url).get(backend_url, {})
        if worker.get("is_healthy") is healthy:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm-router never saw {backend_url} as "
                               f"{'healthy' if healthy else 'unhealthy'} in {timeout_s} s: "
                               f"{worker}")
        time.sleep(0.2)
