"""SGLang servers for the tests: the P/D set they share, started together in the SGLang venv.

``scripts/setup_sglang.sh`` makes the venv (``.venv-sglang``: SGLang 0.5.23 on CPU,
kvbridge installed into it, so SGLang finds the plugin by its entry point). Each
server is a process group of its own (its scheduler and detokenizer children go
with it), logging to a file whose tail a failing test prints.

The shared set (``SglangSet``), started at once (~60 s on two cores):

    single   the reference: no disaggregation
    p1       prefill, TP 1          p2   prefill, TP 2 (heads split over two ranks)
    d        decode, TP 1 (reads from p1 or p2, per request)
    router   sglang-router (Rust) in P/D mode over p1 and d

Requests reach P and D as SGLang's routers send them: the same body to both, with
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` added (``PdClient``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[3]
VENV = Path(os.environ.get("KVBRIDGE_SGLANG_VENV", REPO_ROOT / ".venv-sglang"))
PYTHON = VENV / "bin" / "python"
START_TIMEOUT_S = 240.0

COMMON_ARGS = [
    "--host", "127.0.0.1", "--device", "cpu", "--attention-backend", "torch_native",
    "--disable-cuda-graph", "--disable-overlap-schedule", "--max-total-tokens", "8192",
    "--sleep-on-idle", "--log-level", "warning",
]


def base_env(**extra: str) -> dict[str, str]:
    """The environment of an SGLang server: its CPU engine, nothing of kvbridge's venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")}
    env.update(SGLANG_USE_CPU_ENGINE="1", **extra)
    return env


@dataclass
class Server:
    """One server process group and its log."""

    name: str
    port: int
    argv: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    bootstrap_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=REPO_ROOT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = [line[:400] for line in lines if "server_args=" not in line]
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(keep[-num_lines:])

    def wait_ready(self, path: str = "/health", timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc and self.proc.returncode}"
                                   f"\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {timeout_s} s\n{self.tail()}")


def sglang_server(name: str, model: Path, log_dir: Path, *args: str,
                  env: dict[str, str] | None = None) -> Server:
    port = free_port()
    argv = [str(PYTHON), "-m", "sglang.launch_server", "--model-path", str(model),
            "--port", str(port), *COMMON_ARGS, *args]
    server = Server(name, port, argv, log_dir / f"{name}.log", env or base_env())
    if "--disaggregation-mode" in args and "prefill" in args:
        server.bootstrap_port = free_port()
        server.argv += ["--disaggregation-bootstrap-port", str(server.bootstrap_port)]
    return server


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, Any]:
    """POST ``body``; the status and the decoded answer (text when it is not JSON)."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class PdClient:
    """Sends a request to a P and a D as SGLang's routers do (same body, one room)."""

    prefill: Server
    decode: Server
    rooms: list[int] = field(default_factory=list)

    def generate(self, body: dict[str, Any], path: str = "/generate",
                 timeout_s: float = 120.0, send_to_prefill: bool = True) -> tuple[int, Any]:
        room = random.getrandbits(63)
        self.rooms.append(room)
        routed = {**body, "bootstrap_host": "127.0.0.1",
                  "bootstrap_port": self.prefill.bootstrap_port, "bootstrap_room": room}
        results: dict[str, tuple[int, Any]] = {}

        def send(server: Server) -> None:
            results[server.name] = post_json(server.url + path, routed, timeout_s)

        threads = [threading.Thread(target=send, args=(self.decode,))]
        if send_to_prefill:
            threads.append(threading.Thread(target=send, args=(self.prefill,)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + 10)
        return results.get(self.decode.name, (0, "no answer"))


class SglangSet:
    """The shared servers (see the module docstring); ``stop`` ends them all."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        pd = ["--disaggregation-transfer-backend", "kvbridge"]
        self.single = sglang_server("single", model, log_dir)
        self.p1 = sglang_server("p1", model, log_dir, "--disaggregation-mode", "prefill", *pd)
        self.p2 = sglang_server("p2", model, log_dir, "--disaggregation-mode", "prefill", *pd,
                                "--tp-size", "2",
                                env=base_env(SGLANG_CPU_OMP_THREADS_BIND="0|1"))
        self.d = sglang_server("d", model, log_dir, "--disaggregation-mode", "decode", *pd,
                               "--disaggregation-decode-retraction-backup", "cpu_tensor")
        self.servers = [self.single, self.p1, self.p2, self.d]
        router_port = free_port()
        self.router = Server(
            "router", router_port,
            [str(PYTHON), "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", self.p1.url, str(self.p1.bootstrap_port), "--decode", self.d.url,
             "--host", "127.0.0.1", "--port", str(router_port)],
            log_dir / "router.log", base_env())

    def start(self) -> None:
        for server in self.servers:
            server.start()
        try:
            with ThreadPoolExecutor(len(self.servers)) as pool:
                list(pool.map(lambda s: s.wait_ready(), self.servers))
            self.router.start()
            self.router.wait_ready("/health")
            wait_for_workers(self.router, 2)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for server in [self.router, *self.servers]:
            server.stop()

    def tails(self) -> str:
        return "\n".join(s.tail() for s in [*self.servers, self.router])


def wait_for_workers(router: Server, num_workers: int, timeout_s: float = 60.0) -> None:
    """The router answers /health before it has registered its workers: wait for them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(router.url + "/workers", timeout=5) as response:
                listed = json.loads(response.read())
            workers = listed.get("workers", listed) if isinstance(listed, dict) else listed
            if isinstance(workers, list) and len(workers) >= num_workers and all(
                    w.get("is_healthy", True) for w in workers if isinstance(w, dict)):
                return
        except (OSError, ValueError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router has not registered {num_workers} workers\n{router.tail()}")
