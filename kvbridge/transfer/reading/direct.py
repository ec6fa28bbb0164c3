"""The direct read: the server's blocks land straight in ours, one message per chunk.

For plan items whose blocks both caches store alike (``setup.span``: layout,
block size, element size, head dim, and the heads one run per block plane;
``blocks/ranges.py``). No staging, pack, unpack or credit: ``begin`` asks, then
posts every chunk's receive while the server prepares (in the same call, so no
chunk can be taken for a stray by the worker's drain before its receive is
posted); ``finish`` waits for all of them, or the server's refusal, under one deadline.

A read given up with receives posted ends the link unless the server refused
it (then nothing was sent and the receives are unposted): bytes may still be
landing in our blocks. A read cancelled by its engine (``Reads.cancel``: a
load late at its deadline) first withdraws the receives no chunk matched yet
(``UcxConnection.withdraw_recv``) and lets the chunks already arriving land
(``chunk_timeout_s`` at most); then nothing of it can write into our blocks any
more (``quiet``), and the link goes on (the server's later chunks find no
receive: UCX keeps them as strays, which the worker drops). The serving half
is ``serving/direct.py``.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvbridge.topology import RemoteRead
from kvbridge.transfer.blocks.ranges import MAX_RANGES_PER_CHUNK, block_ranges, num_planes
from kvbridge.transfer.errors import (
    PeerClosedError,
    PeerTimeoutError,
    ProtocolError,
    RejectedError,
    TransferError,
)
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.base import BegunRead, ItemResult, ReaderContext, ReadSetup
from kvbridge.transfer.ucx.connection import ignore_outcome
from kvbridge.transfer.ucx.iov import post_recv_iov

if TYPE_CHECKING:
    from kvbridge.transfer.reading.link import PeerLink

__all__ = ["DirectRead", "direct_request"]


def direct_request(
    ctx: ReaderContext, request: wire.ReadRequest, item: RemoteRead, local_copy: bool
) -> wire.ReadRequest:
    """``request`` made direct, its chunks within the ranges one message may list."""
    per_block = len(item.local_layers) * num_planes(ctx.local)
    chunk_blocks = max(1, min(request.chunk_blocks, MAX_RANGES_PER_CHUNK // per_block))
    return msgspec.structs.replace(request, chunk_blocks=chunk_blocks, direct=True,
                                   local_copy=local_copy)


class DirectRead(BegunRead):
    """A direct read under way: its receives, the server's possible refusal, its end."""

    def __init__(
        self, link: PeerLink, setup: ReadSetup, refusal: asyncio.Future[wire.Message],
        channels: list[int], result: ItemResult,
    ) -> None:
        super().__init__(link, setup)
        self.key = ("data", setup.request.xfer_id)  # of the refusal in the link's waiters
        self.refusal = refusal
        self.arrivals: list[asyncio.Future[None]] = []  # one per chunk, in order
        self.channels = channels
        self.result = result
        self.settled = False
        self.quiet = True  # False once given up with a receive that may still land

    @classmethod
    def begin(cls, link: PeerLink, setup: ReadSetup) -> DirectRead:
        """Start receiving the item's blocks straight into ours: post receives, ask."""
        ctx, item, span = link.ctx, setup.item, setup.span
        assert span is not None  # the link reads direct only then
        layers = slice(item.local_layers.start, item.local_layers.stop)
        per_block = len(item.local_layers) * num_planes(ctx.local)
        request = direct_request(ctx, setup.request, item, local_copy=False)
        setup.request = request
        chunk_blocks = request.chunk_blocks
        ids = np.asarray(setup.direct_block_ids, dtype=np.int64)
        num_chunks = math.ceil(ids.size / chunk_blocks)
        channels = [wire.channel_of(request.xfer_id, chunk) for chunk in range(num_chunks)]

        def post(chunk: int) -> asyncio.Future[None]:
            chunk_ids = ids[chunk * chunk_blocks : (chunk + 1) * chunk_blocks]
            iov = block_ranges(ctx.local, chunk_ids, layers, span)
            return post_recv_iov(ctx.ucp, link.conn, iov, channels[chunk])

        refusal = link.expect(("data", request.xfer_id))
        result = ItemResult(ids.size * per_block * span.nbytes, 1 + num_chunks, direct=True)
        direct = cls(link, setup, refusal, channels, result)
        try:
            # Ask first, then post the receives while the server checks the grant and
            # posts its sends: the request leaves sooner (docs/benchmarks.md, "Figures
            # behind the code"). A chunk that came first anyway is kept by UCX until
            # its receive is posted (tags match late messages).
            link.post(request)
            direct.arrivals.extend(post(chunk) for chunk in range(num_chunks))
        except BaseException as exc:
            direct._settle(exc)
            raise
        return direct

    async def finish(self) -> ItemResult:
        """Await every chunk, or the server's refusal.

        One wait for the lot (``chunk_timeout_s`` per chunk, as the server's):
        the chunks and the refusal resolve one future through callbacks.
        """
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[None] = loop.create_future()
        left = [len(self.arrivals)]

        def arrived(future: asyncio.Future[None]) -> None:
            if outcome.done():
                return
            error = PeerClosedError("chunk cancelled") if future.cancelled() else future.exception()
            if error is not None:
                outcome.set_exception(error)
            else:
                self.grant_seen()  # the server sends only once it pinned the grant
                left[0] -= 1
                if not left[0]:
                    outcome.set_result(None)

        def refused(future: asyncio.Future[wire.Message]) -> None:
            if outcome.done():
                return
            error = future.exception() if not future.cancelled() else PeerClosedError("cancelled")
            reply = None if error is not None else future.result()
            if isinstance(reply, wire.Reject):
                error = RejectedError(reply.reason, reply.message)
            elif error is None:
                error = ProtocolError(f"unexpected {type(reply).__name__} for a direct read")
            outcome.set_exception(error)

        for future in self.arrivals:
            future.add_done_callback(arrived)
        self.refusal.add_done_callback(refused)
        timeout_s = self.link.ctx.config.chunk_timeout_s * len(self.arrivals)
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await outcome
            except TimeoutError:
                raise PeerTimeoutError(
                    f"direct read from {self.link.peer}: not all in within {timeout_s}s"
                ) from None
        except asyncio.CancelledError as exc:
            await self._withdraw()
            self._settle(exc)
            raise
        except BaseException as exc:
            self._settle(exc)
            raise
        self._settle(None)
        return self.result

    def abandon(self) -> None:
        if self.settled:
            return
        self._withdraw_now()
        self._settle(asyncio.CancelledError("read abandoned before it was awaited"))

    def _withdraw_now(self) -> list[asyncio.Future[None]]:
        """Withdraw the receives no chunk matched yet; return the chunks still landing."""
        conn = self.link.conn
        landing = []
        for channel, arrived in zip(self.channels, self.arrivals, strict=False):
            if not arrived.done() and (conn.closed or not conn.withdraw_recv(channel)):
                landing.append(arrived)
        self.quiet = not landing
        return landing

    async def _withdraw(self) -> None:
        """Cancelled: withdraw the receives no chunk matched yet, and let the chunks
        already landing land (``chunk_timeout_s`` at most), so that nothing of this
        read writes into our blocks once it has ended (``quiet``)."""
        landing = self._withdraw_now()
        if not landing:
            return
        await asyncio.wait(landing, timeout=self.link.ctx.config.chunk_timeout_s)
        self.quiet = all(arrived.done() for arrived in landing)

    def _settle(self, error: BaseException | None) -> None:
        """End the read once: on failure unpost what is left, or give up the link."""
        if self.settled:
            return
        self.settled = True
        link = self.link
        link.forget(self.key, self.refusal)
        if error is None:
            return
        for arrived in self.arrivals:
            arrived.add_done_callback(ignore_outcome)
        if isinstance(error, RejectedError) and link.alive:  # nothing was sent: unpost
            for channel, arrived in zip(self.channels, self.arrivals, strict=False):
                if not arrived.done():
                    link.conn.cancel_recv(channel)
        elif isinstance(error, asyncio.CancelledError) and self.quiet:
            pass  # withdrawn or landed (``_withdraw``): nothing lands any more, the link goes on
        else:  # bytes may still be landing in our blocks: the link is done
            link.fail(error if isinstance(error, TransferError) else
                      PeerClosedError("direct read abandoned with receives posted"))
