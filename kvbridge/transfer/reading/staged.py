"""The staged read: the server packs, we receive into staging buffers and unpack.

For plan items whose blocks the two caches store differently (layout, block
size, a head slice that is strided in the server's blocks, a read starting
inside a block). Nothing is started before ``finish``::

    ReadRequest -> DataHeader (sizes checked) -> take window buffers
    -> post receives for chunks 0..w-1 -> Credit(w)
    -> for each chunk i: wait; unpack (executor thread, overlaps the next
       chunk on the wire); repost the buffer for chunk i+w; Credit(i+w+1)

Chunks land in staging buffers, never in our blocks: only an unpack writes
there. A read cancelled by its engine (``Reads.cancel``) lets the unpack under
way end before it ends itself, so nothing of it writes into our blocks after
that (the link is given up: receives stay posted in its staging buffers).

The serving half is ``serving/staged.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvbridge.kernels import PackedFormat, on_device, unpack
from kvbridge.topology import KVLayout, RemoteRead
from kvbridge.transfer.blocks.staging import Buffer, as_tensor
from kvbridge.transfer.errors import PeerClosedError, ProtocolError
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.base import BegunRead, ItemResult, ReaderContext, ReadSetup
from kvbridge.transfer.reading.tokens import TokenWindow

if TYPE_CHECKING:
    from kvbridge.transfer.reading.link import PeerLink

__all__ = ["StagedRead"]


class StagedRead(BegunRead):
    """A staged read: asked for and received in ``finish``; nothing to abandon before."""

    @classmethod
    def begin(cls, link: PeerLink, setup: ReadSetup) -> StagedRead:
        return cls(link, setup)

    async def finish(self) -> ItemResult:
        link, ctx = self.link, self.link.ctx
        item, request, packed_fmt = self.setup.item, self.setup.request, self.setup.packed_fmt
        xfer_id, chunk_blocks = request.xfer_id, request.chunk_blocks
        num_blocks = len(request.block_ids)
        num_chunks = math.ceil(num_blocks / chunk_blocks)
        header = await link.request(("data", xfer_id), request)
        if not isinstance(header, wire.DataHeader):  # nothing is posted yet: this read only
            if isinstance(header, wire.CopyGo):  # the server pinned the grant: let it go
                link.post_quietly(wire.CopyDone(xfer_id, False))
            raise ProtocolError(f"{type(header).__name__} from {link.peer} answers "
                                f"staged read {xfer_id}")
        self.grant_seen()
        if (header.num_chunks, header.total_nbytes) != (num_chunks, packed_fmt.nbytes(num_blocks)):
            error = ProtocolError(
                f"server plans {header.num_chunks} chunks / {header.total_nbytes} bytes, "
                f"expected {num_chunks} / {packed_fmt.nbytes(num_blocks)}"
            )
            link.fail(error)
            raise error
        window = min(ctx.config.window_chunks, num_chunks, ctx.pool.num_buffers)
        chunk_nbytes = chunk_blocks * packed_fmt.block_nbytes
        bufs = await ctx.pool.acquire(chunk_nbytes, window, timeout_s=ctx.config.chunk_timeout_s)
        receiver = _ChunkReceiver(link, ctx, xfer_id, packed_fmt, bufs, num_blocks, chunk_blocks)
        try:
            await receiver.run(item, self.setup.local_block_ids, self.setup.tokens)
        except BaseException:
            self.quiet = receiver.unpacking is None or receiver.unpacking.done()
            receiver.give_back(broken=True)
            raise
        receiver.give_back(broken=False)
        return ItemResult(packed_fmt.nbytes(num_blocks), 3 + 2 * num_chunks)

    def abandon(self) -> None:
        pass  # nothing was sent or posted before ``finish``


class _ChunkReceiver:
    """Posts, awaits and unpacks the chunks of one read through a window of buffers."""

    def __init__(
        self, link: PeerLink, ctx: ReaderContext, xfer_id: int, packed_fmt: PackedFormat,
        bufs: list[Buffer], num_blocks: int, chunk_blocks: int,
    ) -> None:
        self.link, self.ctx, self.xfer_id, self.packed_fmt = link, ctx, xfer_id, packed_fmt
        self.bufs, self.num_blocks, self.chunk_blocks = bufs, num_blocks, chunk_blocks
        self.num_chunks = math.ceil(num_blocks / chunk_blocks)
        self.unpacking: concurrent.futures.Future[None] | None = None  # the last unpack

    def _blocks_in(self, chunk: int) -> int:
        return min(self.chunk_blocks, self.num_blocks - chunk * self.chunk_blocks)

    def _post(self, chunk: int) -> asyncio.Future[None]:
        buf = self.bufs[chunk % len(self.bufs)]
        nbytes = self.packed_fmt.nbytes(self._blocks_in(chunk))
        return self.link.conn.post_recv(buf[:nbytes], wire.channel_of(self.xfer_id, chunk))

    async def run(
        self, item: RemoteRead, local_block_ids: Sequence[int], tokens: TokenWindow
    ) -> None:
        cfg, local = self.ctx.config, self.ctx.local
        window = len(self.bufs)
        posted = {chunk: self._post(chunk) for chunk in range(window)}
        await self.link.send(wire.Credit(self.xfer_id, window))
        layers = local.layers[item.local_layers.start : item.local_layers.stop]
        local_ids = list(local_block_ids[tokens.first_local_block :])
        block_tokens = self.chunk_blocks * self.packed_fmt.block_size
        for chunk in range(self.num_chunks):
            arrived = posted.pop(chunk)
            await self.link.conn.wait(arrived, timeout_s=cfg.chunk_timeout_s, what="chunk")
            buf = self.bufs[chunk % window]
            blocks = self._blocks_in(chunk)
            src_offset, chunk_tokens, token_offset = tokens.in_chunk(
                chunk * block_tokens, blocks * self.packed_fmt.block_size
            )
            staged = as_tensor(buf[: self.packed_fmt.nbytes(blocks)])
            self.unpacking = self.ctx.executor.submit(
                _unpack, staged, self.packed_fmt, blocks, layers, local_ids,
                local.topology.layout, item.local_head_offset, chunk_tokens, token_offset,
                src_offset,
            )
            await self._unpacked(self.unpacking)
            following = chunk + window
            if following < self.num_chunks:
                posted[following] = self._post(following)
                await self.link.send(wire.Credit(self.xfer_id, following + 1))

    @staticmethod
    async def _unpacked(unpacking: concurrent.futures.Future[None]) -> None:
        """Wait for an unpack; cancelled, still until it no longer writes our blocks
        (one that has not started never will)."""
        unpacked = asyncio.wrap_future(unpacking)
        try:
            await asyncio.shield(unpacked)
        except asyncio.CancelledError:
            unpacked.add_done_callback(_retrieved)
            if not unpacking.cancel():  # running: one chunk's unpack, let it end
                await asyncio.wait([unpacked])
            raise

    def give_back(self, *, broken: bool) -> None:
        for buf in self.bufs:
            if broken:
                self.ctx.pool.discard()  # a receive may still land in it
            else:
                self.ctx.pool.release(buf)
        if broken:
            self.link.fail(PeerClosedError("read abandoned with receives posted"))


def _retrieved(future: asyncio.Future[None]) -> None:
    """An unpack nobody awaits any more: its error is not news."""
    if not future.cancelled():
        future.exception()


def _unpack(
    staged: torch.Tensor, packed_fmt: PackedFormat, num_blocks: int, layers: list[torch.Tensor],
    local_ids: list[int], layout: KVLayout, head_offset: int, num_tokens: int, token_offset: int,
    src_token_offset: int,
) -> None:
    if num_tokens == 0:
        return
    with on_device(staged):  # unpacked before the buffer takes the next chunk
        unpack(
            staged, packed_fmt, num_blocks, layers, local_ids, layout,
            head_offset=head_offset, num_tokens=num_tokens, token_offset=token_offset,
            src_token_offset=src_token_offset,
        )
