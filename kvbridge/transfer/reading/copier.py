"""Copying out of another process on this host: ``process_vm_readv`` for a same-host read.

When a reader and the server of a link run on one host (same boot, same pid
namespace), the kernel copies between their address spaces in one pass
(``process_vm_readv``, the "cross-memory attach" that UCX's own ``cma``
transport uses). A read through UCX's shared memory costs two passes (the
server copies into a FIFO, the reader out of it), both on the same cores; this
costs one, and the reader splits it over ``AgentConfig.copy_threads`` threads.

- ``CopySource``: a server process this reader may copy from, checked by its
  probe (``protocol/host.py``) before it is trusted and after every copy; it
  also reads the server's grant board (``protocol/grant_board.py``): from a
  read-only map of it where the server offers one (no system call), else with
  one ``process_vm_readv`` of the grant's window.
- ``Copier`` / ``CopyRun``: one copy shared out in pieces over the loop thread
  and helper threads.

The reads that use them are ``same_host.py`` (on the loop: the board's word,
or asking the server) and ``inline.py`` (on the caller's thread). A dead server
is an ``ESRCH`` error here, never an abort (unlike UCX's own ``cma`` with peer
error handling off).

A little over 400 lines: ``CopySource`` (who the server is, its board, one
``process_vm_readv``) and the shared-out copy both work on the same iovec rows
and errors; split, the copy would reach into the source's.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import math
import mmap
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from kvbridge.transfer.errors import PeerClosedError, ProtocolError, TransferError
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.grant_board import (
    SLOT_NBYTES,
    TAG_NBYTES,
    WINDOW,
    BoardSpot,
    board_supported,
    find_grant,
    home_slot,
    memory_fence,
    slot_seq,
    token_digest,
)
from kvbridge.transfer.protocol.host import host_identity, map_shared

__all__ = [
    "IOV_MAX", "Copier", "CopyRefusedError", "CopyRun", "CopySource", "IovArray", "MemmoveArgs",
    "memmove", "memmove_rows", "zero_rows",
]

logger = logging.getLogger(__name__)

IOV_MAX = 1024  # iovec entries per process_vm_readv call (Linux UIO_MAXIOV)
_ROW_NBYTES = 16  # one struct iovec
#: Below this many bytes per thread a copy is not split (a thread hop costs ~50 us).
MIN_PART_NBYTES = 4 << 20
# A piece a thread takes of a shared copy: few calls (~10 us each), a short tail.
_MIN_PIECE_NBYTES = 4 << 20
_MAX_PIECE_NBYTES = 8 << 20  # ~1 ms inside the kernel, where it is not preempted
_LOOP_SLICE_S = 0.005  # the loop thread copies this long at most before it yields

IovArray = npt.NDArray[np.uint64]  # struct iovec[n]: (address, length) rows
#: A grant's window of the server's board: ``WINDOW`` slots, each as two rows (its
#: seq first, then the rest: the kernel copies rows in order, see ``grant_board.py``).
_WINDOW_ROWS = 2 * WINDOW
_WINDOW_NBYTES = WINDOW * SLOT_NBYTES
_WINDOW_LENGTHS = np.array([8, SLOT_NBYTES - 8] * WINDOW, dtype=np.uint64)
_WINDOW_OFFSETS = np.array([slot * SLOT_NBYTES + part for slot in range(WINDOW)
                            for part in (0, 8)], dtype=np.uint64)


def _map_address(area: mmap.mmap) -> int:
    """Where a read-only map starts in this process."""
    return int(np.frombuffer(area, dtype=np.uint8).ctypes.data)


def zero_rows(rows: IovArray) -> None:
    """Zero our memory that ``rows`` name: a copy that was not kept (the server's blocks
    may have gone to another request while it ran) leaves nothing behind."""
    for address, nbytes in rows.tolist():
        ctypes.memset(address, 0, nbytes)


class CopyRefusedError(TransferError):
    """The kernel would not let this process read the server's memory (EPERM)."""


def _bind_readv() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                      ctypes.c_ulong, ctypes.c_ulong]
    return readv


_readv = _bind_readv() if sys.platform == "linux" else None


def _bind_memmove() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """libc's memmove, called with the GIL held and ready-made arguments (``inline.py``).

    A copy out of a map is many rows (32 KiB each for a typical block plane), one
    call each. Holding the GIL: letting it go per row, another thread of ours (the
    agent's loop on its report timer) takes it mid-copy and keeps it for its turn
    (p99 of a 1-2 MiB read 0.2-0.4 ms that way, 0.11-0.23 holding it). Ready-made
    ``c_void_p`` / ``c_size_t`` arguments (``memmove_rows``), no conversion: 0.33 us
    a call instead of 0.76.
    """
    function = ctypes.PyDLL(None).memmove
    function.restype = None
    return function


memmove = _bind_memmove()
MemmoveArgs = tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def memmove_rows(local: IovArray, theirs: IovArray) -> list[MemmoveArgs]:
    """``memmove(ours, theirs, nbytes)``'s arguments per row (rows of equal lengths),
    made once: converting Python ints per call costs twice the call."""
    c_void_p, c_size_t = ctypes.c_void_p, ctypes.c_size_t
    return [(c_void_p(ours), c_void_p(address), c_size_t(nbytes)) for ours, address, nbytes
            in zip(local[:, 0].tolist(), theirs[:, 0].tolist(), theirs[:, 1].tolist(),
                   strict=True)]


def _unmapped() -> None:
    """Never called: without a memory fence nothing of the server's is mapped."""
    raise AssertionError("no memory fence on this CPU: nothing may be mapped")


class CopySource:
    """A server process this reader may copy from. Create with :meth:`open`."""

    def __init__(self, info: wire.HostInfo) -> None:
        self.pid = info.pid
        self.probe, self.probe_address = info.probe, info.probe_address  # who the server is
        self._got = np.zeros(len(info.probe) + 8, dtype=np.uint8)  # the probe, a board seq
        self._got_iov = np.array([[self._got.ctypes.data, len(info.probe)],
                                  [self._got.ctypes.data + len(info.probe), 8]], dtype=np.uint64)
        self._remote_iov = np.array([[info.probe_address, len(info.probe)], [0, 8]],
                                    dtype=np.uint64)
        self._iov_pointers = (self._got_iov.ctypes.data, self._remote_iov.ctypes.data)
        # The grant board (``protocol/grant_board.py``), if the server offers one.
        self.board_address, self.board_slots = info.board_address, info.board_slots
        self._window = np.zeros(_WINDOW_NBYTES, dtype=np.uint8)
        self._window_local = self._window_local_rows(self._window)
        # Each slot's seq is its own iovec, copied before the rest of the slot.
        self._window_remote = np.zeros((_WINDOW_ROWS, 2), dtype=np.uint64)
        self._window_remote[:, 1] = _WINDOW_LENGTHS
        # The scratch arrays above are shared: the loop thread and a thread making
        # a read on its own (``inline.py``) may use this source at once.
        self._lock = threading.Lock()
        self._board_fd = info.board_fd
        self._board: mmap.mmap | None = None  # the board itself, mapped (``_map_board``)
        self._fence = memory_fence() or _unmapped  # what orders loads from the maps
        # The server's caches where it offers them (``HostInfo.regions``), mapped: for
        # the caches at ``_regions_place`` only (``mapped_rows``).
        self._regions_place = info.place
        self._maps: list[mmap.mmap] = []
        self._starts = self._ends = self._bases = np.zeros(0, dtype=np.uint64)

    @classmethod
    def open(cls, info: wire.HostInfo | None, peer: str) -> CopySource | None:
        """Check that ``info`` names a process we can read; None (logged) when not."""
        if info is None or _readv is None:
            return None
        try:
            if (info.boot_id, info.pid_namespace) != host_identity():
                return None  # another host (or pid namespace): the pid means nothing here
        except OSError:
            return None
        source = cls(info)
        try:
            source.check()
            source._map_board()
            source._map_regions(info.regions)
        except TransferError as exc:
            logger.info("no same-host copies from %s (pid %d): %s", peer, info.pid, exc)
            return None
        return source

    def _map_regions(self, regions: bytes) -> None:
        """Map every memfd the server's caches are in (``HostInfo.regions``), each checked
        by its inode; all or none (the copies then go through ``process_vm_readv``)."""
        if not regions or len(regions) % 32 or not self._regions_place or not board_supported():
            return
        quads = np.frombuffer(regions, dtype=np.uint64).reshape(-1, 4)
        if (quads[:, :2] >= np.uint64(1 << 63)).any():  # so address + nbytes cannot wrap
            return
        maps = [map_shared(self.pid, fd, nbytes, inode) for _, nbytes, fd, inode in quads.tolist()]
        if any(m is None for m in maps):
            logger.info("pid %d's caches not mapped: copies go through process_vm_readv",
                        self.pid)
            return
        self._maps = [m for m in maps if m is not None]
        order = np.argsort(quads[:, 0])
        self._starts, self._ends = quads[order, 0], quads[order, 0] + quads[order, 1]
        self._bases = np.array([_map_address(self._maps[i]) for i in order.tolist()],
                               dtype=np.uint64)

    def mapped_rows(self, remote: IovArray, place: int) -> IovArray | None:
        """``remote`` rows as addresses in our maps of the server's caches, or None when
        the caches are not mapped, ``place`` is not where they were mapped from (a go
        made after they moved), or a row is outside them."""
        if not self._maps or place != self._regions_place or not len(remote):
            return None
        address, nbytes = remote[:, 0], remote[:, 1]
        at = np.searchsorted(self._starts, address, side="right").astype(np.int64) - 1
        if (at < 0).any():
            return None
        end = self._ends[at]
        # Compared without adding: a row near 2**64 (the server's word) must not wrap
        # around into the map and send a memmove outside it.
        if ((address > end) | (nbytes > end - np.minimum(address, end))).any():
            return None
        rows = remote.copy()
        rows[:, 0] = remote[:, 0] - self._starts[at] + self._bases[at]
        return rows

    def unchanged_after_copy(self, spot: BoardSpot) -> bool:
        """After a copy from our maps of the server's caches (``mapped_rows``): ``spot``'s
        slot still has the seq it had, loaded after the copy's loads (a fence, see
        ``grant_board.py``); from the mapped board, else through the kernel (``check``).

        Raises:
            PeerClosedError, CopyRefusedError: as ``check``.
        """
        if self._board is None:
            fence = memory_fence()
            assert fence is not None  # nothing is mapped without one (``_map_regions``)
            fence()  # our memmove's loads before the kernel's load of the seq
            return self.check(spot)
        return slot_seq(self._board, spot.seq_address - self.board_address,
                        self._fence) == spot.seq

    @property
    def board_mapped(self) -> bool:
        """The server's board is read from a map of it (else a window is copied per look)."""
        return self._board is not None

    def _map_board(self) -> None:
        """Map the server's board if it offers it and the map holds the board's tag
        (read at the advertised address); else its windows are copied per read.

        Raises:
            TransferError: as ``readv`` (the pid was checked just before).
        """
        if self._board_fd < 0 or not self.board_slots or not board_supported():
            return
        nbytes = (self.board_slots + WINDOW - 1) * SLOT_NBYTES
        board = map_shared(self.pid, self._board_fd, nbytes + TAG_NBYTES, populate=True)
        if board is None:
            return
        tag = np.zeros(TAG_NBYTES, dtype=np.uint8)
        self.readv(np.array([[tag.ctypes.data, TAG_NBYTES]], dtype=np.uint64),
                   np.array([[self.board_address + nbytes, TAG_NBYTES]], dtype=np.uint64))
        if tag.tobytes() == board[nbytes:]:
            self._board = board
        else:
            logger.info("pid %d's fd %d is not its grant board", self.pid, self._board_fd)
            board.close()

    def check(self, spot: BoardSpot | None = None) -> bool:
        """Copy the probe and compare: the pid still names the server that offered it.

        ``spot``: also read that board slot's seq (same call); returns False if
        it changed (the grant left the board, or was being changed), else True.

        Raises:
            PeerClosedError: the process is gone or is another one now.
            CopyRefusedError: the kernel refuses the copy.
        """
        assert _readv is not None
        num = len(self.probe)
        with self._lock:
            got_iov, remote_iov = self._iov_pointers
            rows, want = 1, num
            if spot is not None:
                self._remote_iov[1, 0] = spot.seq_address
                rows, want = 2, num + 8
            got = _readv(self.pid, got_iov, rows, remote_iov, rows, 0)
            code = ctypes.get_errno() if got < 0 else 0
            copied = self._got.tobytes()
        probe, seq = copied[:num], int.from_bytes(copied[num:], "little")
        if got != want:
            if code == errno.EPERM:
                raise CopyRefusedError(f"copy from pid {self.pid}: {os.strerror(code)}")
            raise PeerClosedError(f"pid {self.pid} is no longer the server "
                                  f"({os.strerror(code) if code else 'short probe'})")
        if probe != self.probe:
            raise PeerClosedError(f"pid {self.pid} is no longer the server (probe differs)")
        return spot is None or seq == spot.seq

    def find_grant(self, token: str, block_ids: Sequence[int], prompt_digest: bytes,
                   place: int) -> BoardSpot | None:
        """Where the server's board says ``token`` may read ``block_ids`` now, or None.

        ``place``: of the go whose origins the copy will use (``grant_board.py``).

        None also when the server has no board or the read of it fails (the
        caller then asks the server, which says what is wrong, if anything).
        """
        if not self.board_slots:
            return None
        digest = token_digest(token)
        if self._board is not None:
            first = home_slot(digest, self.board_slots) * SLOT_NBYTES
            return find_grant(self._board, first, self.board_address, digest, block_ids,
                              prompt_digest, time.monotonic(), place, self._fence)
        start = self._window_address(digest)
        assert _readv is not None
        with self._lock:
            np.add(_WINDOW_OFFSETS, np.uint64(start), out=self._window_remote[:, 0])
            got = _readv(self.pid, self._window_local.ctypes.data, _WINDOW_ROWS,
                         self._window_remote.ctypes.data, _WINDOW_ROWS, 0)
            window = self._window.tobytes()
        if got != len(window):
            return None
        return find_grant(window, 0, start, digest, block_ids, prompt_digest, time.monotonic(),
                          place)

    def _window_address(self, digest: bytes) -> int:
        """Where the board window of a grant whose token has ``digest`` starts (the server's)."""
        return self.board_address + home_slot(digest, self.board_slots) * SLOT_NBYTES

    @staticmethod
    def _window_local_rows(window: npt.NDArray[np.uint8]) -> IovArray:
        """Rows that take a board window into ``window`` (``_WINDOW_NBYTES``), in window order."""
        rows = np.empty((_WINDOW_ROWS, 2), dtype=np.uint64)
        rows[:, 0] = _WINDOW_OFFSETS + np.uint64(window.ctypes.data)
        rows[:, 1] = _WINDOW_LENGTHS
        return rows

    def readv(self, local: IovArray, remote: IovArray) -> None:
        """Copy ``remote`` ranges of the server into ``local`` ones (row for row).

        Runs in whatever thread calls it; the GIL is released during each call.

        Raises:
            PeerClosedError: the process is gone (ESRCH).
            CopyRefusedError: not permitted (EPERM).
            ProtocolError: a remote range is not mapped in the server (EFAULT), or
                the copy came up short.
        """
        for start in range(0, max(len(local), len(remote)), IOV_MAX):
            lo, re = local[start : start + IOV_MAX], remote[start : start + IOV_MAX]
            self.readv_rows(lo.ctypes.data, len(lo), re.ctypes.data, len(re), int(lo[:, 1].sum()))

    def readv_rows(self, local_rows: int, num_local: int, remote_rows: int, num_remote: int,
                   want: int) -> None:
        """One ``process_vm_readv`` of at most ``IOV_MAX`` rows each side, by address.

        Raises:
            As ``readv``.
        """
        assert _readv is not None
        got = _readv(self.pid, local_rows, num_local, remote_rows, num_remote, 0)
        if got == want:
            return
        if got >= 0:
            raise ProtocolError(f"copy from pid {self.pid} moved {got} of {want} bytes")
        code = ctypes.get_errno()
        text = f"copy from pid {self.pid}: {os.strerror(code)}"
        if code == errno.ESRCH:
            raise PeerClosedError(text)
        if code == errno.EPERM:
            raise CopyRefusedError(text)
        if code == errno.EFAULT:
            raise ProtocolError(text + " (the server named memory it does not have)")
        raise TransferError(text)


class CopyRun:
    """A copy under way, shared out in pieces to whichever thread asks next.

    Every thread that works on it (the loop thread, helper threads) takes the
    next piece of rows, copies it and asks again, so a thread that starts late,
    joins late or runs slow takes fewer pieces, and all end together. A piece is
    a share of what is left (between ``_MIN_PIECE_NBYTES`` and
    ``_MAX_PIECE_NBYTES``): few calls, and little left for the last one.
    ``close`` hands out no more pieces; ``wait_idle`` waits for those taken.

    Why not one part per thread: a helper thread wakes up late (0.1-0.3 ms on
    a busy VM), and the part it was given would then end last. Why not small
    pieces: a call costs ~10 us, and the kernel does not preempt a thread inside
    ``process_vm_readv`` on many servers (``PREEMPT_NONE``), so each piece is
    also a bound on how long a core serves nobody else.
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
        row = _ROW_NBYTES
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
