"""The configurations of ``kvbridge bench serve``: vLLM servers and the front end clients call.

Called by ``kvbridge/bench/serve_bench.py``. Each configuration is vLLM servers
(``kvbridge/bench/vllm_servers.py``, placed as ``kvbridge bench vllm`` places
them) behind one front end, a child process on a free port:

==================  ==========================================================
configuration       servers (cores with ``--cores split``) -> front end
==================  ==========================================================
colocated           2 replicas, no connector (core 0, core 1) -> vllm-router
                    (round robin): the same cores as a P/D pair
kvbridge-router     P (0) and D (1), KVBridgeConnector as ``kvbridge bench vllm``
                    configures it (zero config, failure policy recompute) ->
                    ``vllm-router --vllm-pd-disaggregation --kv-connector nixl``
kvbridge-proxy      the same P and D -> ``kvbridge proxy`` (first-token flow)
nixl-router         P (0) and D (1), vLLM's NixlConnector, stock settings
                    (``kvbridge bench vllm``'s) -> vllm-router as above
==================  ==========================================================

With ``--netns`` each pair runs on two network namespace hosts instead
(``serve_netns.place``: the first server on host a, the second on host b); the
front end stays in the caller's namespace and reaches them over the veths.

A configuration whose tool is missing is not started: :func:`missing_tool`
names what is missing and the command that installs it, and the report
carries that line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvbridge.bench.vllm_bench import config_servers, core_placement
from kvbridge.bench.vllm_servers import ServerError, VllmServer, child_setup, group_pids
from kvbridge.cli.demo.procs import reserve_ports

CONFIGS = ("colocated", "kvbridge-router", "kvbridge-proxy", "nixl-router")
_CONNECTOR = {"kvbridge-router": "kvbridge", "kvbridge-proxy": "kvbridge",
              "nixl-router": "nixl"}
ROUTER_INSTALL = ("pip install vllm-router; or: pip install --no-deps --target DIR "
                  "vllm-router, then PYTHONPATH=DIR")
NIXL_INSTALL = ("pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1; or: pip install "
                "--no-deps --target DIR nixl==1.5.1 nixl-cu12==1.5.1, then PYTHONPATH=DIR")


def router_command() -> list[str] | None:
    """How to start vllm-router: its Python module if importable (the Rust router
    inside the package), else a ``vllm-router`` on PATH; None if neither."""
    if importlib.util.find_spec("vllm_router") is not None:
        return [sys.executable, "-m", "vllm_router.launch_router"]
    binary = shutil.which("vllm-router")
    return None if binary is None else [binary]


def missing_tool(name: str) -> str | None:
    """What configuration ``name`` lacks, with the command that installs it; None if
    it can run.

    Raises:
        ValueError: ``name`` is not in ``CONFIGS``.
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
    lacks = []
    if (name.endswith("-router") or name == "colocated") and router_command() is None:
        lacks.append(f"vllm-router is not installed ({ROUTER_INSTALL})")
    if name == "nixl-router" and importlib.util.find_spec("nixl") is None:
        lacks.append(f"NixlConnector needs nixl, which is not installed ({NIXL_INSTALL})")
    return "; ".join(lacks) or None


@dataclass
class FrontEnd:
    """A router or proxy process on 127.0.0.1; ``start()`` waits for its ``/health``,
    ``stop()`` is idempotent.

    Args:
        name: For logs and reports.
        argv: Its command line (it must listen on ``port``).
        port: Its HTTP port.
        log_path: Where its stdout and stderr go.
    """

    name: str
    argv: list[str]
    port: int
    log_path: Path
    startup_timeout_s: float = 120.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """Its process's (= its group's), while it runs."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start it and block until ``/health`` answers 200.

        Raises:
            ServerError: it exited or did not answer in ``startup_timeout_s``.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=child_setup(None))  # dies with us
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            time.sleep(0.3)
        tail = self.log_path.read_text(errors="replace")[-3000:]
        self.stop()
        raise ServerError(f"{self.name} did not start; {self.log_path} ends:\n{tail}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM its process group, SIGKILL after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def vllm_router(prefill: list[str], decode: list[str], log_path: Path) -> FrontEnd:
    """vllm-router in NIXL P/D mode (``prefill``/``decode`` URLs), or over plain
    replicas when ``decode`` is empty; round robin either way."""
    command = router_command()
    if command is None:
        raise ServerError(f"vllm-router is not installed ({ROUTER_INSTALL})")
    port, metrics_port = reserve_ports([1, 1])
    argv = [*command, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(metrics_port),  # its default, 29000, may be taken
            "--policy", "round_robin"]
    if decode:
        argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
    else:
        argv += ["--worker-urls", *prefill]
    return FrontEnd("vllm-router", argv, port, log_path)


def kvbridge_proxy(prefill: list[str], decode: list[str], log_path: Path) -> FrontEnd:
    """``kvbridge proxy`` (its default, first-token flow) in front of P and D."""
    [port] = reserve_ports([1])
    argv = [sys.executable, "-m", "kvbridge.cli", "proxy", "--host", "127.0.0.1",
            "--port", str(port), "--prefill", *prefill, "--decode", *decode,
            "--log-level", "warning"]
    return FrontEnd("kvbridge proxy", argv, port, log_path)


def servers(name: str, model: Path, log_dir: Path, split: bool,
            block_size: int) -> list[VllmServer]:
    """Configuration ``name``'s vLLM servers (not started): two replicas, or P and D."""
    if name == "colocated":
        ports = reserve_ports([1, 1])
        return [VllmServer(f"replica{core}", model, port, log_dir / f"colocated-{core}.log",
                           block_size=block_size, **core_placement(split, core))
                for core, port in enumerate(ports)]
    pair = config_servers(_CONNECTOR[name], model, log_dir, {}, split, block_size)
    for server in pair:
        server.log_path = log_dir / f"{name}-{server.name}.log"
    return pair


def front_end(name: str, started: list[VllmServer], log_dir: Path) -> FrontEnd:
    """Configuration ``name``'s front end (not started) over its ``started`` servers
    (after them: their ports are bound, so the front end's free port is not one of them)."""
    log_path = log_dir / f"{name}-front.log"
    if name == "colocated":
        return vllm_router([s.url for s in started], [], log_path)
    prefill, decode = [started[0].url], [started[1].url]
    make = kvbridge_proxy if name == "kvbridge-proxy" else vllm_router
    return make(prefill, decode, log_path)
