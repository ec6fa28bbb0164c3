"""The P/D set the SGLang tests share, started together in the SGLang venv.

Servers, requests and the router's readiness come from ``kvbridge/bench/sglang_servers.py``
(``kvbridge bench sglang`` starts its servers the same way). The set (~90 s to start on
two idle cores, ~9 GiB proportional memory):

    single   the reference: no disaggregation
    p1       prefill, TP 1          p2   prefill, TP 2 (heads split over two ranks)
    d        decode, TP 1 (reads from p1 or p2, per request)
    d2       decode, TP 2 (each rank reads its head from p1)
    router   sglang-router (Rust) in P/D mode over p1 and d

Requests reach P and D as SGLang's routers send them (``PdClient``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvbridge.bench.sglang_servers import (
    PdClient,
    Server,
    base_env,
    default_python,
    post_json,
    sglang_server,
    wait_for_workers,
)
from tests.ports import free_port

__all__ = ["PYTHON", "REPO_ROOT", "PdClient", "Server", "SglangSet", "post_json"]

REPO_ROOT = Path(__file__).resolve().parents[3]
PYTHON = default_python(REPO_ROOT)


class SglangSet:
    """The shared servers (see the module docstring); ``stop`` ends them all."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        pd = ["--disaggregation-transfer-backend", "kvbridge"]
        prefill, decode = ["--disaggregation-mode", "prefill", *pd], [
            "--disaggregation-mode", "decode", *pd,
            "--disaggregation-decode-retraction-backup", "cpu_tensor"]

        def server(name: str, *args: str, bootstrap_port: int = 0,
                   env: dict[str, str] | None = None) -> Server:
            return sglang_server(PYTHON, name, model, log_dir, free_port(), *args,
                                 bootstrap_port=bootstrap_port, env=env)

        self.single = server("single")
        self.p1 = server("p1", *prefill, bootstrap_port=free_port())
        self.p2 = server("p2", *prefill, "--tp-size", "2", bootstrap_port=free_port(),
                         env=base_env(SGLANG_CPU_OMP_THREADS_BIND="0|1"))
        self.d = server("d", *decode)
        self.d2 = server("d2", *decode, "--tp-size", "2",
                         env=base_env(SGLANG_CPU_OMP_THREADS_BIND="0|1"))
        self.servers = [self.single, self.p1, self.p2, self.d, self.d2]
        router_port = free_port()
        self.router = Server(
            "router", router_port,
            [str(PYTHON), "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", self.p1.url, str(self.p1.bootstrap_port), "--decode", self.d.url,
             "--host", "127.0.0.1", "--port", str(router_port),
             # its metrics listener defaults to a fixed port that vllm-router (in the
             # tests beside these) may hold: CI failed once on "Address already in use"
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            log_dir / "router.log", base_env())

    def start(self) -> None:
        for server in self.servers:
            server.start(REPO_ROOT)
        try:
            with ThreadPoolExecutor(len(self.servers)) as pool:
                list(pool.map(lambda s: s.wait_ready(), self.servers))
            self.router.start(REPO_ROOT)
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
