"""One same-host copy shared out over threads: ``Copier`` and ``CopyRun``.

A large copy out of a server on this host (``copy_source.py``) runs on up to
``AgentConfig.copy_threads`` threads at once: the caller's (the agent's loop
thread, or the thread making a read inline) and helper threads from a pool
this ``Copier`` owns. Each takes the next piece of rows of the shared
``CopyRun`` and copies it with one ``process_vm_readv`` (the GIL released).
The reads that use it are ``same_host.py`` and ``inline.py``.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvbridge.transfer.protocol.grant_board import BoardSpot
from kvbridge.transfer.reading.copy_source import CopySource
from kvbridge.transfer.reading.libc import IOV_MAX, ROW_NBYTES, IovArray

__all__ = ["MIN_PART_NBYTES", "Copier", "CopyRun"]

#: Below this many bytes per thread a copy is not split: a thread hop costs more
#: than the time it saves (docs/benchmarks.md, "Figures behind the code").
MIN_PART_NBYTES = 4 << 20
# A piece a thread takes of a shared copy: few calls, a short tail (``CopyRun``).
_MIN_PIECE_NBYTES = 4 << 20
_MAX_PIECE_NBYTES = 8 << 20  # bounds a core's time inside the kernel, not preempted there
_LOOP_SLICE_S = 0.005  # the loop thread copies this long at most before it yields


class CopyRun:
    """A copy under way, shared out in pieces to whichever thread asks next.

    Every thread that works on it (the loop thread, helper threads) takes the
    next piece of rows, copies it and asks again, so a thread that starts late,
    joins late or runs slow takes fewer pieces, and all end together. A piece is
    a share of what is left (between ``_MIN_PIECE_NBYTES`` and
    ``_MAX_PIECE_NBYTES``): few calls, and little left for the last one.
    ``close`` hands out no more pieces; ``wait_idle`` waits for those taken.

    Why not one part per thread: a helper thread wakes up late on a busy
    machine, and the part it was given would then end last. Why not small
    pieces: each is a system call, and the kernel does not preempt a thread
    inside ``process_vm_readv`` on many servers (``PREEMPT_NONE``), so each
    piece is also a bound on how long a core serves nobody else (figures:
    docs/benchmarks.md, "Figures behind the code").
    """

    def __init__(self, source: CopySource, local: IovArray, remote: IovArray,
                 num_threads: int) -> None:
        self.source = source
        # Kept alive (and contiguous) here: the kernel reads these rows by address.
        self._local = np.ascontiguousarray(local, dtype=np.uint64)
        self._remote = np.ascontiguousarray(remote, dtype=np.uint64)
        self._rows = len(local)
        self._ends = np.cumsum(self._local[:, 1], dtype=np.uint64)
        self._total = int(self._ends[-1]) if self._rows else 0
        self._share = 2 * num_threads  # a piece is about 1 / share of what is left
        self._next_row = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # pieces taken and not yet copied
        self._closed = False
        self.error: BaseException | None = None
        self.helpers: list[Future[bool]] = []

    @property
    def exhausted(self) -> bool:
        """No piece is left to take (all taken, or closed)."""
        return self._closed or self._next_row >= self._rows

    def _take(self) -> tuple[int, int, int] | None:
        """The next piece as ``(first row, end row, nbytes)``, or None."""
        with self._lock:
            first = self._next_row
            if self._closed or first >= self._rows:
                return None
            done = int(self._ends[first - 1]) if first else 0
            nbytes = min(_MAX_PIECE_NBYTES,
                         max(_MIN_PIECE_NBYTES, (self._total - done) // self._share))
            end = int(np.searchsorted(self._ends, done + nbytes, side="left")) + 1
            end = min(max(end, first + 1), first + IOV_MAX, self._rows)
            self._next_row = end
            self._busy += 1
            return first, end, int(self._ends[end - 1]) - done

    def work(self, until: float = math.inf) -> bool:
        """Copy pieces until none is left (True) or ``time.perf_counter()`` passes ``until``.

        Never raises: the first error is kept in ``error`` and ends the run.
        """
        local, remote = self._local.ctypes.data, self._remote.ctypes.data
        row = ROW_NBYTES
        while time.perf_counter() < until:
            piece = self._take()
            if piece is None:
                return True
            first, end, nbytes = piece
            try:
                self.source.readv_rows(local + first * row, end - first,
                                       remote + first * row, end - first, nbytes)
            except BaseException as exc:
                with self._lock:
                    self.error = self.error or exc
                    self._closed = True
            finally:
                with self._lock:
                    self._busy -= 1
                    if not self._busy:
                        self._idle.notify_all()
        return self.exhausted

    def close(self) -> None:
        """Hand out no more pieces (those taken are still being copied)."""
        with self._lock:
            self._closed = True

    def wait_idle(self) -> None:
        """Block until no thread copies a piece of this run (one piece's time at most)."""
        with self._lock:
            self._idle.wait_for(lambda: not self._busy)


class Copier:
    """Runs copies, shared out over up to ``threads`` threads (the caller's is one of them)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # ``start`` runs on the loop and inline
        self._closed = False  # after ``close``: no helpers (a late inline copy works alone)

    def num_parts(self, nbytes: int) -> int:
        """How many threads a copy of ``nbytes`` is shared out over (1: the caller's alone)."""
        return max(1, min(self.threads, nbytes // MIN_PART_NBYTES))

    def start(self, source: CopySource, local: IovArray, remote: IovArray) -> CopyRun:
        """Copy ``remote`` rows into ``local`` rows (row ``i`` of both has one length).

        A large copy is shared with helper threads, which start at once. This
        thread then copies pieces for up to ``_LOOP_SLICE_S`` before it returns;
        ``finish`` does the rest. Pass the result to ``finish`` or to ``abandon``.
        Never raises: a copy error is kept for ``finish``.
        """
        rows = len(local)
        nbytes = int(local[:, 1].sum()) if rows else 0
        threads = max(1, min(rows, self.num_parts(nbytes)))
        run = CopyRun(source, local, remote, threads)
        if threads > 1:
            with self._pool_lock:
                if self._pool is None and not self._closed:
                    self._pool = ThreadPoolExecutor(self.threads - 1,
                                                    thread_name_prefix="kvbridge-local-copy")
                if self._pool is not None:
                    run.helpers = [self._pool.submit(run.work) for _ in range(threads - 1)]
            time.sleep(0)  # a helper needs the GIL to start its copy: let it have it now
        run.work(time.perf_counter() + _LOOP_SLICE_S)
        return run

    async def finish(self, run: CopyRun, spot: BoardSpot | None = None) -> bool:
        """Copy what is left of ``run`` here, then check the source (and ``spot``).

        This thread copies in slices of ``_LOOP_SLICE_S``, yielding to the loop
        between them, then waits (blocking: one piece's time at most) for the
        pieces helpers still copy. Returns only when no thread of ours writes
        into the local blocks any more, also on failure or cancellation.

        Returns:
            ``CopySource.check(spot)``: False if the board's slot changed meanwhile.

        Raises:
            The errors of ``CopySource.readv`` and ``CopySource.check``.
        """
        try:
            while not run.work(time.perf_counter() + _LOOP_SLICE_S):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.abandon(run)
            raise
        run.wait_idle()
        if run.error is not None:
            raise run.error
        return run.source.check(spot)

    def copy_here(self, source: CopySource, local: IovArray, remote: IovArray) -> None:
        """Copy on this thread, with helper threads for a large copy; block until done.

        For a thread that may wait (``inline.py``): no slices, no yielding.
        Returns only when no thread of ours writes into ``local`` any more.

        Raises:
            The errors of ``CopySource.readv``.
        """
        run = self.start(source, local, remote)
        run.work()
        run.wait_idle()
        if run.error is not None:
            raise run.error

    @staticmethod
    def abandon(run: CopyRun) -> None:
        """Stop ``run`` and wait (blocking) until no piece of it is being copied."""
        run.close()
        run.wait_idle()

    async def copy(self, source: CopySource, local: IovArray, remote: IovArray) -> None:
        """``finish(start(...))``."""
        await self.finish(self.start(source, local, remote))

    def close(self) -> None:
        """Stop the helper threads (a copy under way finishes first)."""
        with self._pool_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
