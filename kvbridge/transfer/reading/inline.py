"""A read made on the caller's own thread: a same-host copy on the grant board's word.

Most reads between two processes on one host need nobody but the reader: the
server's grant board (``protocol/grant_board.py``) says whether the grant is
live and holds the read's blocks, the handshake (``wire.HostInfo.origins``) or
an earlier go says where the blocks sit, and the kernel copies them
(``copy_source.py``, ``copier.py``). So ``TransferAgent.start_read`` tries this first, on the thread
that called it, before anything goes to the agent's event loop::

    caller: board window -> live, these blocks, this prompt (seq s)?
            -> [blocks | seq | probe] in one process_vm_readv -> seq == s -> outcome

    loop:   (later) ReadDone to the server                       never waited for

No thread hop, no round trip, no server CPU. The grant rules are the board's:
the bytes are kept only if the slot said "live, these blocks, this prompt,
before its deadline, caches where we copy from" and its sequence number is the
same after the copy (the server takes a grant off the board before its blocks
go back). The kernel copies the iovecs of one call in order, so the seq read
in the same call as the blocks was read after them. The board is read before a
byte is copied: a grant for another prompt never lands one.

Where the server's caches are in shared memory it offers (``HostInfo.regions``,
``kv_cache_zeros(shared=True)``), a one-part read ``memmove``s the blocks out of
this process's read-only map of them instead, and reads the seq from the board's
map after them, past a memory fence (``CopySource.mapped_rows``,
``unchanged_after_copy``, ``grant_board.py``): no system call at all.

What a read copies (its ranges, both sides) is kept per (link, plan item, block
ids, tokens): a request read again, or one with the same blocks (a benchmark),
only sets the seq's address. Kept ranges are used only while the place
they were made for holds (the same go for the server's blocks, the same cache
tensors for ours).

Anything else returns None and the read goes the usual way (``reads.py`` on the
loop, which asks the server and reports what is wrong, if anything): a read
that is not direct, a server on another host, a grant not on the board (or
changed meanwhile), a read larger than ``AgentConfig.inline_copy_max_nbytes``
(the caller waits for it) or smaller than ``local_copy_min_nbytes``, or a failed
copy (a dead server is ``ESRCH``; the usual path then fails the read with its
typed error). A copy that is not kept is zeroed in the read's own blocks (the
server's blocks may have gone to another request meanwhile): a failed read
never leaves bytes the grant did not cover.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.topology import RemoteRead
from kvbridge.transfer.errors import PeerClosedError, TransferError
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.base import ItemResult
from kvbridge.transfer.reading.copy_source import CopyRefusedError, CopySource
from kvbridge.transfer.reading.jobs import ReadJob
from kvbridge.transfer.reading.libc import (
    IOV_MAX,
    IovArray,
    MemmoveArgs,
    memmove,
    memmove_rows,
    zero_rows,
)
from kvbridge.transfer.reading.same_host import (
    CopyShape,
    copy_shape,
    local_ranges,
    remote_ranges,
)

if TYPE_CHECKING:
    from kvbridge.transfer.reading.link import PeerLink

__all__ = ["InlineReader"]

logger = logging.getLogger(__name__)

_MAX_KEPT = 256  # prepared copies kept (the oldest goes first)


@dataclass(slots=True)
class _Prepared:
    """One read's copy, ready to run again (its rows are the kernel's ``struct iovec``s).

    Two ``process_vm_readv`` calls per read: the board window, checked before a
    byte of the blocks is copied (a grant for another prompt must not land one);
    then the blocks and, after them in the same call, the slot's seq again and
    the server's probe (is the pid still the server).
    """

    link: PeerLink  # the link and plan item it was made for (the key holds their ids)
    item: RemoteRead
    shape: CopyShape  # of the read (its go's key)
    go: wire.CopyGo  # where the server's blocks were said to be
    layers: slice  # ours
    local_origins: IovArray  # our planes' origins when made (``LocalKV.plane_origins``)
    block_ids: list[int]  # the server's, as its board lists them
    nbytes: int  # block bytes
    local: IovArray  # our block ranges, then the seq's and the probe's landing rows
    remote: IovArray  # the server's block ranges (row for row), then seq and probe rows
    tail: np.ndarray  # the seq (8 bytes) and the probe land here
    whole: bool  # blocks, seq and probe in one call (else: ``Copier.copy_here``, ``check``)
    rows: tuple[int, int, int]  # ``local``'s and ``remote``'s addresses, bytes in all (whole)
    # memmove's arguments per row when the server's caches are mapped
    # (``CopySource.mapped_rows``, ``memmove_rows``): no system call; else None.
    pairs: list[MemmoveArgs] | None


class InlineReader:
    """Reads on the caller's thread (see the module docstring); one per agent.

    Any thread; one read at a time (a lock: the prepared copies' rows are shared).
    """

    def __init__(self) -> None:
        self._prepared: dict[Hashable, _Prepared] = {}
        self._links_seen: set[int] = set()  # ids of the links of ``_prepared``'s copies
        self._lock = threading.Lock()

    def read(self, link: PeerLink, item: RemoteRead, job: ReadJob) -> ItemResult | None:
        """Copy ``job``'s ``item`` from ``link``'s server if its board allows; None: not done.

        Never raises for what the usual path can handle: it returns None.

        Raises:
            ConfigError: the job's blocks do not cover its tokens (the usual path
                would fail it the same way).
        """
        ctx, peer = link.ctx, link.same_host
        if peer is None or ctx.copier is None or not peer.source.board_slots:
            return None
        key = (id(link), id(item), job.remote_block_ids, job.local_block_ids, job.first_token,
               job.num_tokens)
        with self._lock:
            prepared = self._prepared.get(key)
            if prepared is None or not self._valid(link, item, prepared):
                prepared = self._prepare(link, item, job)
                if prepared is None:
                    return None
                if id(link) not in self._links_seen or len(self._prepared) >= _MAX_KEPT:
                    self._drop_stale()  # a new link: maybe one replacing a dead one
                    self._links_seen = {id(p.link) for p in self._prepared.values()}
                    self._links_seen.add(id(link))
                if len(self._prepared) >= _MAX_KEPT:
                    del self._prepared[next(iter(self._prepared))]
                self._prepared[key] = prepared
            try:
                if not _copy(link, peer.source, prepared, job):
                    return None
            except CopyRefusedError:
                link.drop_same_host()  # the kernel said no: this link reads through UCX now
                return None
            except TransferError as exc:
                logger.debug("inline copy from %s not kept: %s", link.peer, exc)
                return None
        return ItemResult(prepared.nbytes, 1, direct=True, local_copy=True, unasked=True)

    def _drop_stale(self) -> None:
        """Forget the copies of links that died or stopped copying: they hold the link,
        and through it its maps of the server's caches (``CopySource``), which stay
        mapped (the memory of a server that restarted, GiBs) while anything holds them."""
        stale = [key for key, prepared in self._prepared.items()
                 if not prepared.link.alive or prepared.link.same_host is None]
        for key in stale:
            del self._prepared[key]

    @staticmethod
    def _valid(link: PeerLink, item: RemoteRead, prepared: _Prepared) -> bool:
        """``prepared`` is for this link and item, and the place it was made for
        still holds on both sides."""
        peer = link.same_host
        return (prepared.link is link and prepared.item is item and peer is not None
                and peer.gos.get(prepared.shape) is prepared.go
                and link.ctx.local.plane_origins(prepared.layers) is prepared.local_origins)

    @staticmethod
    def _prepare(link: PeerLink, item: RemoteRead, job: ReadJob) -> _Prepared | None:
        """The copy of ``job``'s item, or None if it cannot be made inline."""
        ctx, peer = link.ctx, link.same_host
        assert peer is not None and ctx.copier is not None
        setup = link.prepare(item, job)
        span = setup.span
        if span is None:
            return None
        nbytes = setup.direct_nbytes(ctx.local)
        if not ctx.config.local_copy_min_nbytes <= nbytes <= ctx.config.inline_copy_max_nbytes:
            return None
        go = peer.go_for(setup.request)
        if go is None:
            return None
        layers = slice(item.local_layers.start, item.local_layers.stop)
        origins = ctx.local.plane_origins(layers)
        source = peer.source
        tail = np.zeros(8 + len(source.probe), dtype=np.uint8)
        tail_local = np.array([[tail.ctypes.data, 8],
                               [tail.ctypes.data + 8, len(source.probe)]], dtype=np.uint64)
        tail_remote = np.array([[0, 8], [source.probe_address, len(source.probe)]],
                               dtype=np.uint64)
        blocks_local = local_ranges(ctx.local, setup, span)
        blocks_remote = remote_ranges(setup.request, go)
        local = np.concatenate([blocks_local, tail_local])
        remote = np.concatenate([blocks_remote, tail_remote])
        whole = len(local) <= IOV_MAX and ctx.copier.num_parts(nbytes) == 1
        mapped = source.mapped_rows(blocks_remote, go.place) if whole else None
        pairs = None
        if (mapped is not None and mapped.shape == blocks_local.shape
                and np.array_equal(mapped[:, 1], blocks_local[:, 1])):
            pairs = memmove_rows(blocks_local, mapped)
        rows = (local.ctypes.data, remote.ctypes.data, nbytes + len(tail))
        return _Prepared(link, item, copy_shape(setup.request), go, layers, origins,
                         list(setup.request.block_ids), nbytes, local, remote, tail, whole,
                         rows, pairs)


def _copy(link: PeerLink, source: CopySource, prepared: _Prepared, job: ReadJob) -> bool:
    """Check the board, copy, check the slot's seq again; True if the bytes are kept.

    Raises:
        TransferError, CopyRefusedError: as ``CopySource.readv``; ``PeerClosedError``
            also when the pid is no longer the server's.
    """
    spot = source.find_grant(job.grant, prepared.block_ids, job.prompt_digest,
                             prepared.go.place)
    if spot is None:
        return False
    local, remote = prepared.local, prepared.remote
    kept = False
    try:
        if prepared.pairs is not None:  # from our map of the server's caches
            for ours, theirs, nbytes in prepared.pairs:
                memmove(ours, theirs, nbytes)
            kept = source.unchanged_after_copy(spot)  # its seq loaded after the bytes
            return kept
        if not prepared.whole:
            assert link.ctx.copier is not None
            link.ctx.copier.copy_here(source, local[:-2], remote[:-2])
            kept = source.check(spot)  # False: the grant changed while we copied
            return kept
        remote[-2, 0] = spot.seq_address
        num_rows = len(local)
        local_rows, remote_rows, want = prepared.rows
        source.readv_rows(local_rows, num_rows, remote_rows, num_rows, want)
        tail = prepared.tail.tobytes()
        if tail[8:] != source.probe:
            raise PeerClosedError(f"pid {source.pid} is no longer the server (probe differs)")
        kept = int.from_bytes(tail[:8], "little") == spot.seq  # else: changed meanwhile
        return kept
    finally:
        if not kept:  # the blocks may have gone to another request meanwhile: not its bytes
            zero_rows(local[:-2])
