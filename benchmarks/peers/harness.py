"""Run a peer as two processes on loopback: a *target* that owns the source
pool and an *initiator* that reads from it, both started by the caller.

Used by ``nixl_peer`` and ``mooncake_peer``. Each child runs
``python -m benchmarks.peers.<peer> target|initiator``; the parent relays the
connection metadata in-band through the children's pipes:

    parent ---spec---------------------> target      (fills pool, registers it)
    parent <--ready{metadata}----------- target
    parent ---spec + target metadata---> initiator   (reads, times, verifies)
    parent <--results------------------- initiator
    parent ---EOF on stdin-------------> target      (deregisters, exits)

Protocol lines on stdout start with :data:`MARK`, so whatever a library logs to
stdout is ignored. Every wait has a deadline; children still alive at the end
are killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import IO, Any

from benchmarks.peers.results import summarize
from benchmarks.peers.workload import IdArray, KVShape, KVWorkload, U8Array

MARK = "KVBPEER "
_REPO_ROOT = Path(__file__).resolve().parents[2]
_CLOSE_TIMEOUT_S = 10.0
_STDERR_TAIL_NBYTES = 2000

Payload = dict[str, Any]
Request = Callable[[], None]
"""One timed request: moves the prepared blocks, returns when they have landed."""


class PeerRunError(Exception):
    """A peer child failed, timed out or sent something unexpected."""


def workload_spec(workload: KVWorkload, sizes_nbytes: list[int], num_iters: int,
                  num_warmup: int, timeout_s: float) -> Payload:
    """Everything a child needs to rebuild the same workload and run it."""
    shape = workload.shape
    return {
        "num_pool_blocks": workload.num_pool_blocks,
        "seed": workload.seed,
        "shape": [shape.num_kv_heads, shape.head_dim, shape.dtype_nbytes,
                  shape.block_size, shape.num_layers],
        "sizes": list(sizes_nbytes),
        "iters": num_iters,
        "warmup": num_warmup,
        "timeout_s": timeout_s,
    }


def workload_from_spec(spec: Mapping[str, Any]) -> KVWorkload:
    """Inverse of :func:`workload_spec` for the workload part."""
    return KVWorkload(num_pool_blocks=int(spec["num_pool_blocks"]),
                      shape=KVShape(*(int(x) for x in spec["shape"])), seed=int(spec["seed"]))


class _Child:
    """One child process; stdout lines carrying :data:`MARK` go to a queue."""

    def __init__(self, module: str, role: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        self.role = role
        # A file, not a pipe: nobody drains stderr while the child runs, and a
        # chatty library must not block on a full pipe. Closed in close().
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, role], cwd=_REPO_ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK):])
        self._lines.put(None)

    def send(self, payload: Payload) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(payload) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError as exc:
            raise PeerRunError(f"{self.role} exited early: {self.stderr_tail()}") from exc

    def receive(self, timeout_s: float) -> Payload:
        """Next protocol payload; raises PeerRunError on timeout, exit or error."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerRunError(f"{self.role} sent nothing for {timeout_s:.0f} s") from None
        if line is None:  # stdout closed: the child exited or is about to
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=_CLOSE_TIMEOUT_S)
            raise PeerRunError(
                f"{self.role} exited with code {self._proc.returncode}: {self.stderr_tail()}"
            )
        payload: Payload = json.loads(line)
        if "error" in payload:
            raise PeerRunError(f"{self.role}: {payload['error']}")
        return payload

    def stderr_tail(self) -> str:
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - _STDERR_TAIL_NBYTES))
        tail = self._stderr.read().decode(errors="replace").strip()
        return tail.splitlines()[-1] if tail else "(no stderr)"

    def close(self) -> None:
        """EOF on stdin, then wait; kill when the child does not exit in time."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=_CLOSE_TIMEOUT_S)
        self._stderr.close()


def run_pair(module: str, spec: Payload, timeout_s: float) -> list[Payload]:
    """Start target and initiator of ``module``; return the initiator's results.

    Args:
        module: Importable peer module, e.g. ``benchmarks.peers.nixl_peer``.
        spec: From :func:`workload_spec`; sent to both children.
        timeout_s: Deadline for each step (start-up, the whole run).

    Raises:
        PeerRunError: a child failed, reported an error or missed a deadline.
            Both children are gone when this returns or raises.
    """
    target = _Child(module, "target")
    try:
        target.send({"spec": spec})
        ready = target.receive(timeout_s)["ready"]
        initiator = _Child(module, "initiator")
        try:
            initiator.send({"spec": spec, "target": ready})
            results: list[Payload] = initiator.receive(timeout_s)["results"]
            return results
        finally:
            initiator.close()
    finally:
        target.close()


def emit(payload: Payload) -> None:
    """Child side: write one protocol line to stdout."""
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def child_main(role: str, serve: Callable[[Payload], Generator[Payload, None, None]],
               read: Callable[[Payload, Payload], list[Payload]]) -> int:
    """Child side: run ``serve`` (target) or ``read`` (initiator) and report.

    ``serve(spec)`` is a generator: it sets up and registers the source pool,
    yields the metadata the initiator needs, and cleans up when closed. The
    target keeps it suspended (memory registered) until its stdin closes.
    ``read(spec, target_metadata)`` returns result dicts. Any exception becomes
    an ``error`` payload and exit code 1.
    """
    try:
        request: Payload = json.loads(sys.stdin.readline() or "{}")
        spec = request["spec"]
        if role == "target":
            session = serve(spec)
            emit({"ready": next(session)})
            sys.stdin.read()  # parent closes stdin when the initiator is done
            session.close()
        elif role == "initiator":
            emit({"results": read(spec, request["target"])})
        else:
            raise ValueError(f"role must be target or initiator, got {role!r}")
    except Exception as exc:  # reported to the parent, which owns the decision
        emit({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


def time_requests(peer: str, spec: Payload, dst_pool: U8Array,
                  prepare: Callable[[IdArray, IdArray], Request]) -> list[Payload]:
    """Initiator side: time every size of ``spec`` and verify what landed.

    For each size ``prepare(remote_ids, local_ids)`` builds the request
    (untimed) and warm-up requests run; then the destination pool is zeroed,
    ``iters`` timed requests run, and the pool is verified after the last.

    Returns:
        One ``PeerResult.to_json()`` dict per size.
    """
    workload = workload_from_spec(spec)
    results: list[Payload] = []
    for nbytes in spec["sizes"]:
        num_blocks = workload.num_blocks_for(int(nbytes))
        remote_ids, local_ids = workload.block_ids(num_blocks)
        request = prepare(remote_ids, local_ids)
        for _ in range(int(spec["warmup"])):
            request()
        dst_pool[:] = 0  # what verify sees was written by the timed requests
        durations_s: list[float] = []
        for _ in range(int(spec["iters"])):
            start = time.perf_counter()
            request()
            durations_s.append(time.perf_counter() - start)
        num_wrong = workload.verify(dst_pool, remote_ids, local_ids)
        note = f"{num_wrong} of {num_blocks} blocks wrong" if num_wrong else ""
        result = summarize(peer, int(nbytes), num_blocks, durations_s, num_wrong == 0, note)
        results.append(result.to_json())
    return results
