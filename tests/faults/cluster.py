"""``kvbridge serve`` / ``proxy`` processes on lab hosts, driven from the test process.

Used by tests/faults (through conftest.py) and tests/integration/test_multihost.py.
The servers run inside the hosts of a :class:`~tests.integration.netns.NetnsLab`
(``ip netns exec``, ``UCX_TLS=tcp``); the lab has no route to the test process,
so HTTP calls go out of a :class:`NetnsClient`: worker threads that moved into a
lab host's network namespace (``setns(2)`` affects only the calling thread)::

    test process                           lab
    +--------------------------+           +------------------------------+
    | main thread: pytest      |           | prefill: kvbridge serve (P)  |
    | NetnsClient threads ------- setns --> | decode:  kvbridge serve (D)  |
    |   (HTTP, /metrics)       |           | proxy:   kvbridge proxy      |
    +--------------------------+           +------------------------------+

Every server runs in its own session (process group: the server and its TP
workers), so :meth:`Served.kill` takes down a whole "host service" at once;
the lab kills whatever is left at teardown. Expected answers come from
:class:`Reference`, a colocated TP-1 ``LLMEngine`` in the test process.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from kvbridge.reference.engine.engine import LLMEngine
from kvbridge.reference.engine.engine_config import EngineConfig
from kvbridge.reference.engine.request import SamplingParams
from tests import slow_serving
from tests.integration.netns import Host, ucx_env
from tests.waiting import WaitTimeout, wait_until

_T = TypeVar("_T")
_CLONE_NEWNET = 0x40000000
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
_READY = re.compile(r"kvbridge (serve|proxy) ready on (http://\S+)$")
_METRIC = re.compile(r"^(\w+) (\S+)$", re.M)


# --------------------------------------------------------------------------- client side
def _enter_netns(netns: str) -> None:
    """Move the calling thread into ``netns`` (only this thread; the process stays put)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP completion call: status, parsed body (or None) and wall time."""

    status: int
    body: dict[str, Any] | None
    text: str
    elapsed_s: float

    @property
    def token_ids(self) -> list[int]:
        assert self.status == 200 and self.body is not None, (self.status, self.text[:500])
        ids: list[int] = self.body["choices"][0]["token_ids"]
        return ids

    @property
    def error(self) -> str:
        """The error message of a failed call ('' for a 200)."""
        if self.status == 200:
            return ""
        try:
            return str(json.loads(self.text)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return self.text


class NetnsClient:
    """HTTP from inside one lab host (thread pool whose threads live in its namespace).

    Args:
        netns: the host's namespace name (``Host.netns``).
        num_threads: calls that may run at once.
    """

    def __init__(self, netns: str, num_threads: int = 6) -> None:
        self.netns = netns
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"ns-{netns}",
                                        initializer=_enter_netns, initargs=(netns,))

    def submit(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> Future[_T]:
        """Run ``fn`` in a namespace thread; returns at once."""
        return self._pool.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``fn`` in a namespace thread and wait for it."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Stop the threads (their hold on the namespace ends with them)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ calls
    def complete(self, url: str, prompt: str, max_tokens: int, *, timeout_s: float = 90.0,
                 **extra: Any) -> Answer:
        """POST a greedy completion; never raises for HTTP errors (see ``Answer``)."""
        return self.call(_post, url, _body(prompt, max_tokens, **extra), timeout_s)

    def complete_async(self, url: str, prompt: str, max_tokens: int, *,
                       timeout_s: float = 90.0, **extra: Any) -> Future[Answer]:
        """As :meth:`complete`, in the background."""
        return self.submit(_post, url, _body(prompt, max_tokens, **extra), timeout_s)

    def metrics(self, url: str) -> dict[str, float]:
        """``/metrics`` as ``{name: value}`` (unlabeled samples only).

        Raises:
            httpx.HTTPError: unreachable, or a non-200 answer.
        """
        return self.call(_metrics, url)

    def get(self, url: str, timeout_s: float = 10.0) -> httpx.Response:
        return self.call(_get, url, timeout_s)

    def wait_metrics(self, url: str, ok: Callable[[dict[str, float]], bool], *, timeout_s: float,
                     what: str) -> dict[str, float]:
        """Poll ``/metrics`` until ``ok(values)``.

        Raises:
            WaitTimeout: not within ``timeout_s`` (message: ``what`` and the last values).
        """
        def interesting(values: dict[str, float]) -> dict[str, float]:
            return {k: v for k, v in values.items()
                    if "cache" in k or "requests" in k or "kv_" in k}

        return wait_until(lambda: self.metrics(url), timeout_s, until=ok, interval_s=0.05,
                          message=f"{what} at {url}", describe=interesting,
                          retry_on=(httpx.HTTPError,))

    def wait_all_blocks_free(self, url: str, *, timeout_s: float) -> dict[str, float]:
        """Wait until the engine at ``url`` holds no block (free == total, nothing held)."""
        return self.wait_metrics(url, blocks_all_free, timeout_s=timeout_s,
                                 what="free blocks back to total")

    def stream_then_drop(self, url: str, prompt: str, max_tokens: int, num_events: int,
                         timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Stream a completion, read ``num_events`` data events, then hang up."""
        return self.call(_stream_then_drop, url, _body(prompt, max_tokens, stream=True),
                         num_events, timeout_s)

    def post_then_drop(self, url: str, prompt: str, max_tokens: int,
                       drop: threading.Event, timeout_s: float = 60.0) -> Future[str]:
        """Send a completion, then hang up when ``drop`` is set (before any answer).

        The future holds ``"dropped"``, or ``"answered <status>"`` if the server
        answered first.
        """
        return self.submit(_post_then_drop, url, _body(prompt, max_tokens), drop, timeout_s)


def blocks_all_free(values: dict[str, float]) -> bool:
    """Whether a ``/metrics`` snapshot shows every block free and none held or in use."""
    return (values.get("kvbridge_cache_free_blocks") == values.get("kvbridge_cache_total_blocks")
            and values.get("kvbridge_cache_blocks_held_for_transfer") == 0
            and values.get("kvbridge_requests_running") == 0
            and values.get("kvbridge_requests_waiting") == 0)


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much metric ``kvbridge_<name>`` grew between two ``/metrics`` snapshots."""
    return after[f"kvbridge_{name}"] - before[f"kvbridge_{name}"]


def _body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def _post(url: str, body: dict[str, Any], timeout_s: float) -> Answer:
    start = time.monotonic()
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        response = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.monotonic() - start
    parsed = None
    with contextlib.suppress(ValueError):
        parsed = response.json()
    return Answer(response.status_code, parsed if isinstance(parsed, dict) else None,
                  response.text, elapsed)


def _get(url: str, timeout_s: float) -> httpx.Response:
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        return client.get(url)


def _metrics(url: str) -> dict[str, float]:
    response = _get(f"{url}/metrics", 5.0)
    response.raise_for_status()
    return {m[1]: float(m[2]) for m in _METRIC.finditer(response.text)}


def _stream_then_drop(url: str, body: dict[str, Any], num_events: int,
                      timeout_s: float) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with httpx.Client(timeout=timeout_s, trust_env=False) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) >= num_events:
                    break
    return events  # leaving the blocks closed the connection mid-stream


def _post_then_drop(url: str, body: dict[str, Any], drop: threading.Event,
                    timeout_s: float) -> str:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        sock = conn.sock
        assert sock is not None
        deadline = time.monotonic() + timeout_s
        while not drop.wait(0.02):
            sock.settimeout(0)  # peek: did the server answer before we hung up?
            try:
                if sock.recv(1, 2):  # MSG_PEEK
                    return f"answered {conn.getresponse().status}"
            except BlockingIOError:
                pass
            finally:
                sock.settimeout(timeout_s)
            if time.monotonic() > deadline:
                return "timed out waiting for the drop signal"
        return "dropped"
    finally:
        conn.close()


# --------------------------------------------------------------------------- servers
@dataclass
class Served:
    """A ``kvbridge serve|proxy`` process in a lab host (its own process group)."""

    name: str
    host: Host
    argv: list[str]
    proc: subprocess.Popen[str]
    log_path: Path
    url: str = ""
    _lines: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> Served:
        """Wait for the ready line; sets ``url``.

        Raises:
            AssertionError: no ready line in time (the log tail is in the message).
        """
        assert self.proc.stdout is not None
        stream, found = self.proc.stdout, threading.Event()

        def pump() -> None:
            for line in stream:
                match = _READY.search(line.strip())
                if match and not found.is_set():
                    self.url = match.group(2)
                    found.set()

        threading.Thread(target=pump, daemon=True, name=f"pump-{self.name}").start()
        with contextlib.suppress(WaitTimeout):  # the message below has the log
            wait_until(lambda: found.is_set() or not self.alive, timeout_s, interval_s=0.1,
                       message=f"{self.name}'s ready line")
        if not found.is_set():
            self.kill()
            raise AssertionError(f"{self.name} not ready (exit {self.proc.returncode}):\n"
                                 f"{self.log_tail()}")
        return self

    def child_pids(self) -> list[int]:
        """Direct children of the server process (its TP workers, resource tracker)."""
        pids: list[int] = []
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in children.read_text().split()]
        return pids

    def pid_listening_on(self, port: int) -> int:
        """The process of this host that listens on TCP ``port`` (a worker's agent).

        Raises:
            AssertionError: nobody listens there.
        """
        out = self.host.run(["ss", "-Hltnp", f"sport = :{port}"]).stdout
        match = re.search(r"pid=(\d+)", out)
        assert match, f"nothing listens on {self.host.ip}:{port} in {self.host.name}: {out!r}"
        return int(match.group(1))

    def kill(self) -> None:
        """SIGKILL the server and its workers (the process group); wait until all are gone.

        Raises:
            WaitTimeout: a process of the group outlived SIGKILL for ``STOP_TIMEOUT_S``.
        """
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_TIMEOUT_S)
        # Workers die asynchronously: their ports (same address on restart) are only
        # free once the whole group is gone.
        def group_gone() -> bool:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_until(group_gone, STOP_TIMEOUT_S,
                   message=f"{self.name}: group {self.proc.pid} to be gone after SIGKILL")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL for the group after :data:`STOP_TIMEOUT_S`; the exit code."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_TIMEOUT_S)
        self.kill()  # stray workers, if any
        return self.proc.returncode


#: The cluster secret every lab server shares (as a multi-host deployment configures one).
LAB_SECRET = "lab-secret-" + "0123456789abcdef" * 2


def start(name: str, host: Host, argv: Sequence[str], log_dir: Path, *,
          chunk_delay_s: float = 0.0) -> Served:
    """Start ``python -m kvbridge.cli <argv>`` in ``host`` (UCX over TCP); no wait.

    ``chunk_delay_s``: its transfer servers wait this long before each data chunk
    (``tests/slow_serving.py``, which then starts the CLI).
    """
    log_path = log_dir / f"{name}.log"
    # lab hosts advertise non-loopback addresses: they need a cluster secret
    env = {**ucx_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "KVBRIDGE_SECRET": LAB_SECRET}
    command = ["-m", "kvbridge.cli"]
    if chunk_delay_s:
        command = list(slow_serving.COMMAND)
        env.update(slow_serving.chunk_delay_env(chunk_delay_s))
    with open(log_path, "a") as log:
        log.write(f"---- {' '.join(argv)}\n")
        log.flush()
        proc = host.popen([sys.executable, *command, *argv], env=env,
                          stdout=subprocess.PIPE, stderr=log)
    return Served(name, host, list(argv), proc, log_path)


def kill_all(servers: Sequence[Served]) -> None:
    """SIGKILL every server's group at once, then wait for each (orphaned workers are
    reaped by init, which may take a while: better in parallel)."""
    for served in servers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(served.proc.pid, signal.SIGKILL)
    for served in servers:
        served.kill()


# --------------------------------------------------------------------------- reference
class Reference:
    """Colocated answers: an in-process TP-1 ``LLMEngine`` (greedy), cached per prompt.

    Args:
        max_model_len: as the served engines'.
    """

    def __init__(self, max_model_len: int) -> None:
        self._engine = LLMEngine(EngineConfig(model="tiny", in_process=True, num_blocks=256,
                                              max_model_len=max_model_len))
        self._cache: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.Lock()

    def tokens(self, prompt: str, max_tokens: int) -> list[int]:
        """The greedy completion of ``prompt`` (``ignore_eos``)."""
        key = (prompt, max_tokens)
        with self._lock:
            if key not in self._cache:
                [out] = self._engine.generate(
                    [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                self._cache[key] = list(out.new_token_ids)
            return self._cache[key]

    def close(self) -> None:
        self._engine.shutdown()


@contextlib.contextmanager
def reference_engine(max_model_len: int) -> Iterator[Reference]:
    ref = Reference(max_model_len)
    try:
        yield ref
    finally:
        ref.close()


def prompt_of(num_chars: int, tag: str) -> str:
    """A prompt of ``num_chars`` bytes (one token per byte, plus BOS), distinct per ``tag``.

    Distinct prompts keep prefix-cache hits on D from hiding a transfer.
    """
    text = f"[{tag}] Disaggregated serving moves the prompt's KV cache from prefill to decode. "
    return (text * (num_chars // len(text) + 1))[:num_chars]
