"""SGLang servers in SGLang's own venv: start, wait, stop, and send P/D requests.

Shared by ``kvbridge bench sglang`` and ``tests/integrations/sglang``. SGLang runs in
a venv of its own (``scripts/setup_sglang.sh`` -> ``.venv-sglang``; its pins differ
from vLLM's), with kvbridge installed in it so that SGLang finds kvbridge's backend
by its entry point. Each server is a process group of its own (its scheduler and
detokenizer children go with it), logging to a file.

P/D requests go as SGLang's routers send them (``PdClient``): the same body to P
and D, with ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` added.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CPU_ARGS", "PdClient", "Server", "base_env", "default_python", "post_json",
           "sglang_server", "wait_for_workers"]

START_TIMEOUT_S = 240.0

#: SGLang's CPU engine on a small machine: torch-native attention, no CUDA graphs, a
#: small KV pool (the default takes 72% of RAM), schedulers that sleep when idle.
CPU_ARGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
    "--disable-overlap-schedule", "--max-total-tokens", "8192", "--sleep-on-idle",
]


def default_python(repo_root: Path | None = None) -> Path:
    """The SGLang venv's python: ``$KVBRIDGE_SGLANG_VENV``, else ``.venv-sglang`` here."""
    venv = os.environ.get("KVBRIDGE_SGLANG_VENV")
    root = repo_root or Path.cwd()
    return (Path(venv) if venv else root / ".venv-sglang") / "bin" / "python"


def base_env(**extra: str) -> dict[str, str]:
    """An SGLang server's environment: its CPU engine, nothing of kvbridge's venv."""
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

    def start(self, cwd: Path | None = None) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=cwd, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole group (a crash, as a test wants it)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM the group; SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, num_lines: int = 40) -> str:
        """The log's last lines (SGLang's one-line dump of its arguments left out)."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = [line[:400] for line in lines
                if "server_args=" not in line and "Ignore import error" not in line]
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(keep[-num_lines:])

    def wait_ready(self, path: str = "/health", timeout_s: float = START_TIMEOUT_S) -> None:
        """Until ``path`` answers 200.

        Raises:
            RuntimeError: the server exited or did not answer in time (with its log).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise RuntimeError(f"{self.name} exited with {code}\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {timeout_s} s\n{self.tail()}")


def sglang_server(python: Path, name: str, model: Path, log_dir: Path, port: int,
                  *args: str, bootstrap_port: int = 0,
                  env: dict[str, str] | None = None) -> Server:
    """A server (not started) on ``port``; a prefill server also takes ``bootstrap_port``."""
    argv = [str(python), "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(port), *CPU_ARGS, "--log-level", "warning",
            *args]
    if bootstrap_port:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return Server(name, port, argv, log_dir / f"{name}.log", env or base_env(),
                  bootstrap_port=bootstrap_port)


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
        """D's status and answer (P's is awaited too, as the routers do)."""
        room = random.getrandbits(63)
        self.rooms.append(room)
        routed = {**body, "bootstrap_host": "127.0.0.1",
                  "bootstrap_port": self.prefill.bootstrap_port, "bootstrap_room": room}
        results: dict[str, tuple[int, Any]] = {}

        def send(server: Server) -> None:
            results[server.name] = post_json(server.url + path, routed, timeout_s)

        targets = [self.decode, self.prefill] if send_to_prefill else [self.decode]
        threads = [threading.Thread(target=send, args=(server,)) for server in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + 10)
        return results.get(self.decode.name, (0, "no answer"))


def wait_for_workers(router: Server, num_workers: int, timeout_s: float = 60.0) -> None:
    """The router answers /health before it has registered its workers: wait for them.

    Raises:
        RuntimeError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(router.url + "/workers", timeout=5) as response:
                listed = json.loads(response.read())
            workers = listed.get("workers", listed) if isinstance(listed, dict) else listed
            if isinstance(workers, list) and len(workers) >= num_workers and all(
                    w.get("is_healthy", True) for w in workers if isinstance(w, dict)):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router has not registered {num_workers} workers\n{router.tail()}")
