"""Our read-only maps of a same-host server's caches, and its addresses in them.

A server whose caches live in memfds (``transfer/host_memory.py``,
``kv_cache_zeros(shared=True)``) names them in its handshake
(``HostInfo.regions``: address, size, fd, inode each). ``CopySource``
(``copy_source.py``) maps them all through ``/proc/<pid>/fd`` (each checked by
its inode, ``protocol/host.py`` ``map_shared``), or none; ``inline.py`` then
``memmove``s a read out of the maps (``mapped_rows``) instead of asking the
kernel to copy it.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

from kvbridge.transfer.protocol.host import map_shared
from kvbridge.transfer.reading.libc import IovArray, map_address

__all__ = ["CacheMaps"]

logger = logging.getLogger(__name__)

_QUAD_NBYTES = 32  # one region: address, nbytes, fd, inode (uint64 each)


class CacheMaps:
    """Maps of every cache region a server named, sorted by its addresses.

    Create with :meth:`open`. Valid only for the caches at ``place`` (the place
    the handshake described; caches that moved since are not these).
    """

    def __init__(self, place: int, maps: list[mmap.mmap], starts: IovArray, ends: IovArray,
                 bases: IovArray) -> None:
        self.place = place
        self._maps = maps  # kept open: ``_bases`` point into them
        self._starts, self._ends, self._bases = starts, ends, bases

    @classmethod
    def open(cls, pid: int, regions: bytes, place: int) -> CacheMaps | None:
        """Map every memfd of ``regions`` (``HostInfo.regions``) of server ``pid``; None
        when there are none, they are malformed, or any one cannot be mapped (the
        copies then go through ``process_vm_readv``)."""
        if not regions or len(regions) % _QUAD_NBYTES or not place:
            return None
        quads = np.frombuffer(regions, dtype=np.uint64).reshape(-1, 4)
        if (quads[:, :2] >= np.uint64(1 << 63)).any():  # so address + nbytes cannot wrap
            return None
        maps = [map_shared(pid, fd, nbytes, inode) for _, nbytes, fd, inode in quads.tolist()]
        if any(m is None for m in maps):
            logger.info("pid %d's caches not mapped: copies go through process_vm_readv", pid)
            return None
        opened = [m for m in maps if m is not None]
        order = np.argsort(quads[:, 0])
        starts, ends = quads[order, 0], quads[order, 0] + quads[order, 1]
        bases = np.array([map_address(opened[i]) for i in order.tolist()], dtype=np.uint64)
        return cls(place, opened, starts, ends, bases)

    def mapped_rows(self, remote: IovArray, place: int) -> IovArray | None:
        """``remote`` rows (the server's addresses) as addresses in our maps, or None when
        ``place`` is not where the caches were mapped from (a go made after they
        moved), or a row is outside them."""
        if place != self.place or not len(remote):
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
