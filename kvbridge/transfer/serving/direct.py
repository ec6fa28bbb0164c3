"""Serving a direct read: each chunk sent as one message straight from the cache blocks.

For reads whose blocks both caches store alike (``blocks/ranges.py``): no
staging, no pack, no credit. The reader posts every chunk's receive right
after asking, long before they land (and UCX keeps one that comes first until
its receive is posted), so every chunk is posted at once, under one deadline of
``chunk_timeout_s`` per chunk (``read_timeout_s`` at most: ``checks.read_budget_s``).
``DirectSends`` posts them and callbacks unpin the grant when the sends end or
their deadline passes: no task. ``session.py`` starts it as it decodes the
request (a grant already issued, the usual case), or in the read's task after
waiting for the grant.

The reading half is ``reading/direct.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.transfer.blocks.ranges import block_ranges, head_span
from kvbridge.transfer.errors import PeerClosedError, PeerTimeoutError, TransferError
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.serving.checks import direct_nbytes, read_budget_s
from kvbridge.transfer.serving.context import ServedRead, ServerContext
from kvbridge.transfer.ucx.connection import UcxConnection, ignore_outcome
from kvbridge.transfer.ucx.iov import post_send_iov

__all__ = ["DirectSends"]

logger = logging.getLogger(__name__)

IovArray = npt.NDArray[np.uint64]  # ucp_dt_iov_t[n] (iov.iov_array)


class DirectSends:
    """One direct read served by callbacks: chunks posted, then one deadline for all.

    Ends exactly once, by the sends completing or failing or by the deadline
    (``checks.read_budget_s``, which aborts the connection); then the grant
    is unpinned and the read forgotten. The caller pinned the grant.
    """

    def __init__(
        self, ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, grant: str,
        reads: dict[int, ServedRead],
    ) -> None:
        self._ctx, self._conn, self._req, self._grant, self._reads = ctx, conn, req, grant, reads
        self._ended = False
        self._timer: asyncio.TimerHandle | None = None
        sends: list[asyncio.Future[None]] = []
        try:
            for channel, iov in _direct_chunks(ctx.local, req):
                sends.append(_post_chunk(ctx, conn, iov, channel))
        except Exception as exc:  # UCX refused (typed), or a bug: this read fails, alone
            if not isinstance(exc, TransferError):
                logger.exception("direct read %d for %s crashed", req.xfer_id, conn.peer)
            for sent in sends:
                sent.add_done_callback(ignore_outcome)
            self._end(exc)
            return
        all_sent: asyncio.Future[Any] = asyncio.gather(*sends) if len(sends) > 1 else sends[0]
        all_sent.add_done_callback(self._sent)
        self._timer = asyncio.get_running_loop().call_later(
            read_budget_s(ctx.config, req), self._late
        )

    def _sent(self, all_sent: asyncio.Future[Any]) -> None:
        if all_sent.cancelled():
            self._end(PeerClosedError("iov send cancelled"))
        else:
            self._end(all_sent.exception())

    def _late(self) -> None:
        self._end(PeerTimeoutError(f"iov send to {self._conn.peer}: no completion in time"))

    def _end(self, error: BaseException | None) -> None:
        if self._ended:
            return
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
        ctx, req = self._ctx, self._req
        if error is None:
            ctx.num_bytes_served += direct_nbytes(ctx.local, req)
            ctx.num_reads_served += 1
        else:
            logger.info("read %d for %s failed: %s", req.xfer_id, self._conn.peer, error)
            self._conn.abort()  # the reader may hold posted receives for chunks we never send
        ctx.grants.end_read(self._grant)
        self._reads.pop(req.xfer_id, None)


def _direct_chunks(local: LocalKV, req: wire.ReadRequest) -> list[tuple[int, IovArray]]:
    """``(channel, iov)`` of each chunk of a direct read, in order."""
    span = head_span(local, req.head_start, req.head_end)
    assert span is not None  # check_request
    layers = slice(req.layer_start, req.layer_end)
    ids = np.asarray(req.block_ids, dtype=np.int64)
    chunks = []
    for chunk in range(math.ceil(ids.size / req.chunk_blocks)):
        chunk_ids = ids[chunk * req.chunk_blocks : (chunk + 1) * req.chunk_blocks]
        iov = block_ranges(local, chunk_ids, layers, span)
        chunks.append((wire.channel_of(req.xfer_id, chunk), iov))
    return chunks


def _post_chunk(
    ctx: ServerContext, conn: UcxConnection, iov: IovArray, channel: int
) -> asyncio.Future[None]:
    ctx.num_data_bytes_sent += int(iov[:, 1].sum())
    return post_send_iov(ctx.ucp, conn, iov, channel)
