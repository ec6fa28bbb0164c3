"""The server process a same-host reader copies from: ``CopySource``.

When a reader and the server of a link run on one host (same boot, same pid
namespace), the reader copies the server's blocks out of its memory itself
(``process_vm_readv``). ``CopySource`` is that server as the reader sees it:

- who it is: a probe (``protocol/host.py``) copied and compared before the
  source is trusted and after every copy, so a pid that now names another
  process is caught (a dead server is an ``ESRCH`` error, never an abort);
- its grant board (``protocol/grant_board.py``): read from a read-only map
  of it where the server offers one (no system call), else with one
  ``process_vm_readv`` of the grant's window;
- its caches, mapped where it offers them (``cache_maps.py``);
- ``readv``: one copy of rows of its memory into ours, errors typed.

Used by ``same_host.py`` (on the loop), ``inline.py`` (on the caller's
thread) and ``copier.py`` (a copy shared out over threads).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence

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
    grant_digest,
    home_slot,
    memory_fence,
    slot_seq,
)
from kvbridge.transfer.protocol.host import host_identity, map_shared
from kvbridge.transfer.reading.cache_maps import CacheMaps
from kvbridge.transfer.reading.libc import IOV_MAX, IovArray, process_vm_readv

__all__ = ["CopyRefusedError", "CopySource"]

logger = logging.getLogger(__name__)

#: A grant's window of the server's board: ``WINDOW`` slots, each as two rows (its
#: seq first, then the rest: the kernel copies rows in order, see ``grant_board.py``).
_WINDOW_ROWS = 2 * WINDOW
_WINDOW_NBYTES = WINDOW * SLOT_NBYTES
_WINDOW_LENGTHS = np.array([8, SLOT_NBYTES - 8] * WINDOW, dtype=np.uint64)
_WINDOW_OFFSETS = np.array([slot * SLOT_NBYTES + part for slot in range(WINDOW)
                            for part in (0, 8)], dtype=np.uint64)


class CopyRefusedError(TransferError):
    """The kernel would not let this process read the server's memory (EPERM)."""


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
        # the caches at ``info.place`` only (``mapped_rows``).
        self._caches: CacheMaps | None = None

    @classmethod
    def open(cls, info: wire.HostInfo | None, peer: str) -> CopySource | None:
        """Check that ``info`` names a process we can read; None (logged) when not."""
        if info is None or process_vm_readv is None:
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
            if board_supported():  # a fence orders loads from the maps (``grant_board.py``)
                source._caches = CacheMaps.open(info.pid, info.regions, info.place)
        except TransferError as exc:
            logger.info("no same-host copies from %s (pid %d): %s", peer, info.pid, exc)
            return None
        return source

    def mapped_rows(self, remote: IovArray, place: int) -> IovArray | None:
        """``remote`` rows as addresses in our maps of the server's caches, or None when
        the caches are not mapped, ``place`` is not where they were mapped from (a go
        made after they moved), or a row is outside them (``CacheMaps.mapped_rows``)."""
        return self._caches.mapped_rows(remote, place) if self._caches is not None else None

    def unchanged_after_copy(self, spot: BoardSpot) -> bool:
        """After a copy from our maps of the server's caches (``mapped_rows``): ``spot``'s
        slot still has the seq it had, loaded after the copy's loads (a fence, see
        ``grant_board.py``); from the mapped board, else through the kernel (``check``).

        Raises:
            PeerClosedError, CopyRefusedError: as ``check``.
        """
        if self._board is None:
            fence = memory_fence()
            assert fence is not None  # nothing is mapped without one (``open``)
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
        assert process_vm_readv is not None
        num = len(self.probe)
        with self._lock:
            got_iov, remote_iov = self._iov_pointers
            rows, want = 1, num
            if spot is not None:
                self._remote_iov[1, 0] = spot.seq_address
                rows, want = 2, num + 8
            got = process_vm_readv(self.pid, got_iov, rows, remote_iov, rows, 0)
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

    def find_grant(self, grant: str, block_ids: Sequence[int], prompt_digest: bytes,
                   place: int) -> BoardSpot | None:
        """Where the server's board says ``grant`` may read ``block_ids`` now, or None.

        ``place``: of the go whose origins the copy will use (``grant_board.py``).

        None also when the server has no board or the read of it fails (the
        caller then asks the server, which says what is wrong, if anything).
        """
        if not self.board_slots:
            return None
        digest = grant_digest(grant)
        if self._board is not None:
            first = home_slot(digest, self.board_slots) * SLOT_NBYTES
            return find_grant(self._board, first, self.board_address, digest, block_ids,
                              prompt_digest, time.monotonic(), place, self._fence)
        start = self._window_address(digest)
        assert process_vm_readv is not None
        with self._lock:
            np.add(_WINDOW_OFFSETS, np.uint64(start), out=self._window_remote[:, 0])
            got = process_vm_readv(self.pid, self._window_local.ctypes.data, _WINDOW_ROWS,
                         self._window_remote.ctypes.data, _WINDOW_ROWS, 0)
            window = self._window.tobytes()
        if got != len(window):
            return None
        return find_grant(window, 0, start, digest, block_ids, prompt_digest, time.monotonic(),
                          place)

    def _window_address(self, digest: bytes) -> int:
        """Where the board window of a grant whose string has ``digest`` starts (the server's)."""
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
        assert process_vm_readv is not None
        got = process_vm_readv(self.pid, local_rows, num_local, remote_rows, num_remote, 0)
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
