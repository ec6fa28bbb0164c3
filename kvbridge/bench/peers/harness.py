"""Run a peer as two processes: a *target* that owns the source pool and an
*initiator* that reads from it, both started by the caller, on loopback or on
two network-namespace hosts (``placement.py``).

Used by ``nixl_peer`` and ``mooncake_peer`` through :class:`PairPeer`. Each
child runs ``python -m kvbridge.bench.peers.<peer> target|initiator``; the parent relays the
connection metadata in-band through the children's pipes:

    parent ---spec---------------------> target      (fills pool, registers it)
    parent <--ready{metadata}----------- target
    parent ---spec + target metadata---> initiator   (reads, times, verifies)
    parent <--results------------------- initiator
    parent ---EOF on stdin-------------> target      (deregisters, exits)

Protocol lines on stdout start with :data:`MARK`, so whatever a library logs to
stdout is ignored. Every wait has a deadline; children still alive at the end
are killed.

Children start from the environment as it was before ``import ucxx``
(``child_env.py`` says why), plus the placement's (``UCX_TLS=tcp`` between
namespace hosts). Each child finds its own address in ``spec["host"]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from kvbridge.bench.peers.child_env import child_env, package_path
from kvbridge.bench.peers.cli import standalone_main
from kvbridge.bench.peers.placement import LOOPBACK, Placement, Side
from kvbridge.bench.peers.results import PeerOutcome, PeerResult, Unavailable, summarize
from kvbridge.bench.peers.workload import IdArray, KVShape, KVWorkload, U8Array

MARK = "KVBPEER "
_CLOSE_TIMEOUT_S = 10.0
_STDERR_TAIL_NBYTES = 2000

Payload = dict[str, Any]
Request = Callable[[], None]
"""One timed request: moves the prepared blocks, returns when they have landed."""
Serve = Callable[[Payload], Generator[Payload, None, None]]
"""Target side: ``serve(spec)`` registers the pool, yields metadata, cleans up on close."""
Read = Callable[[Payload, Payload], list[Payload]]
"""Initiator side: ``read(spec, target_metadata)`` returns result dicts."""


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
    """One child process on ``side``; stdout lines carrying :data:`MARK` go to a queue."""

    def __init__(self, module: str, role: str, side: Side, extra_env: Mapping[str, str]) -> None:
        env = {**child_env(package_path()), **extra_env}
        self.role = role
        # A file, not a pipe: nobody drains stderr while the child runs, and a
        # chatty library must not block on a full pipe. Closed in close().
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            side.command([sys.executable, "-m", module, role]), env=env,
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


def run_pair(module: str, spec: Payload, timeout_s: float,
             placement: Placement = LOOPBACK) -> list[Payload]:
    """Start target and initiator of ``module``; return the initiator's results.

    Args:
        module: Importable peer module, e.g. ``kvbridge.bench.peers.nixl_peer``.
        spec: From :func:`workload_spec`; sent to both children, each with its
            own address added as ``host``.
        timeout_s: Deadline for each step (start-up, the whole run).
        placement: Where target (serving side) and initiator (reading side) run.

    Raises:
        PeerRunError: a child failed, reported an error or missed a deadline.
            Both children are gone when this returns or raises.
    """
    target = _Child(module, "target", placement.serve, placement.env)
    try:
        target.send({"spec": {**spec, "host": placement.serve.ip}})
        ready = target.receive(timeout_s)["ready"]
        initiator = _Child(module, "initiator", placement.read, placement.env)
        try:
            initiator.send({"spec": {**spec, "host": placement.read.ip}, "target": ready})
            results: list[Payload] = initiator.receive(timeout_s)["results"]
            return results
        finally:
            initiator.close()
    finally:
        target.close()


@dataclass(frozen=True, slots=True)
class PairPeer:
    """A peer run as target + initiator processes (``nixl_peer``, ``mooncake_peer``).

    Attributes:
        name: Peer name in results.
        module: Importable module whose ``target|initiator`` CLI runs the children.
        package: Import name that must be installed for the peer to run.
        missing: Reason reported when ``package`` is not installed.
        min_gbps: Slowest rate assumed when the default deadline is computed.
    """

    name: str
    module: str
    package: str
    missing: str
    min_gbps: float

    def run(self, sizes: list[int], iters: int, workload: KVWorkload | None = None,
            warmup: int = 2, timeout_s: float | None = None,
            placement: Placement = LOOPBACK) -> PeerOutcome:
        """Read ``sizes`` bytes of scattered blocks between two processes.

        Args:
            sizes: Request sizes in bytes, multiples of the workload's block size.
            iters: Timed requests per size (after ``warmup`` untimed ones).
            workload: Pool geometry and content; default fits ``sizes``.
            warmup: Untimed requests per size (the first also connects).
            timeout_s: Deadline per step; default scales with the bytes moved.
            placement: Where target and initiator run (default: both on loopback).

        Returns:
            One verified-or-not ``PeerResult`` per size, or ``Unavailable`` when
            the package is missing or the run failed (the reason says which).

        Raises:
            WorkloadError: a size does not fit the workload.
            ValueError: ``iters`` < 1 or ``warmup`` < 0.
        """
        if iters < 1 or warmup < 0:
            raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters} "
                             f"warmup={warmup}")
        workload = workload or KVWorkload.for_sizes(sizes)
        for nbytes in sizes:
            workload.num_blocks_for(nbytes)
        if importlib.util.find_spec(self.package) is None:
            return Unavailable(self.name, self.missing)
        if timeout_s is None:
            timeout_s = 60.0 + sum(sizes) * (iters + warmup) / (self.min_gbps * 1e9)
        spec = workload_spec(workload, sizes, iters, warmup, timeout_s)
        try:
            rows = run_pair(self.module, spec, timeout_s, placement)
        except PeerRunError as exc:
            return Unavailable(self.name, str(exc))
        return [PeerResult(**row) for row in rows]

    def main(self, argv: list[str] | None, description: str, serve: Serve, read: Read) -> int:
        """The peer module's CLI: a child role (``target|initiator``) or a
        stand-alone run (:func:`standalone_main`); returns the exit code."""
        args = sys.argv[1:] if argv is None else argv
        if args and args[0] in ("target", "initiator"):
            return child_main(args[0], serve, read)
        return standalone_main(args, description,
                               lambda sizes, iters, _: self.run(sizes, iters))


def emit(payload: Payload) -> None:
    """Child side: write one protocol line to stdout."""
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def child_main(role: str, serve: Serve, read: Read) -> int:
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
