"""The staged read: the server packs, we receive into staging buffers and unpack.

For plan items whose blocks the two caches store differently (layout, block
size, a head slice that is strided in the server's blocks, a read starting
inside a block). Nothing is started before ``finish``::

    ReadRequest -> DataHeader (sizes checked) -> take window buffers
    -> post receives for chunks 0..w-1 -> Credit(w)
    -> for each chunk i: wait; start its unpack (``blocks/launching.py``: on
       the copy thread, or launched on this loop and watched through a CUDA
       event) and go on to chunk i+1; as soon as chunk i's unpack ended,
       repost its buffer for chunk i+w and send Credit(i+w+1)

Chunks land in staging buffers, never in our blocks: only an unpack writes
there. A read that ends early (cancelled by its engine, ``Reads.cancel``, or
failed) first lets the unpacks under way end and drops those not begun, so
nothing of it writes into our blocks after that (the link is given up:
receives stay posted in its staging buffers). With ``KVBRIDGE_TRACE_CHUNKS``
set, each chunk's stamps go to the trace (``chunk_trace.py``).

The serving half is ``serving/staged.py``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvbridge.kernels import PackedFormat, unpack
from kvbridge.topology import KVLayout, RemoteRead
from kvbridge.transfer.blocks.launching import (
    Launch,
    LaunchMode,
    ended,
    launch,
    launch_mode,
    retrieved,
)
from kvbridge.transfer.blocks.staging import Buffer, as_tensor
from kvbridge.transfer.chunk_trace import ReadChunk
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
        mode = launch_mode(ctx.config.staged_launch, ctx.local.layers[0].device)
        receiver = _ChunkReceiver(link, ctx, xfer_id, packed_fmt, bufs, num_blocks, chunk_blocks,
                                  mode)
        try:
            await receiver.run(item, self.setup.local_block_ids, self.setup.tokens)
        except BaseException:
            self.quiet = receiver.quiet
            receiver.give_back(broken=True)
            raise
        finally:
            if ctx.trace is not None:
                ctx.trace.write(receiver.records)
        receiver.give_back(broken=False)
        return ItemResult(packed_fmt.nbytes(num_blocks), 3 + 2 * num_chunks)

    def abandon(self) -> None:
        pass  # nothing was sent or posted before ``finish``


class _ChunkReceiver:
    """Posts, awaits and unpacks the chunks of one read through a window of buffers.

    Chunk ``c`` lands in buffer ``c % window``. Its unpack starts once it
    arrived, and the receiver goes on to wait for the next chunk; unpacks end
    in the order they started (one copy thread, or one stream), and each one
    that ends frees its buffer for chunk ``c + window`` at once, posted and
    credited even while another chunk is awaited::

        window 3    b0     b1     b2
        chunk       0      1      2      posted, Credit(3)
                    3      4      5      each posted when 0, 1, 2's unpack ended,
                                         with Credit(4), Credit(5), Credit(6)
    """

    def __init__(
        self, link: PeerLink, ctx: ReaderContext, xfer_id: int, packed_fmt: PackedFormat,
        bufs: list[Buffer], num_blocks: int, chunk_blocks: int, mode: LaunchMode,
    ) -> None:
        self.link, self.ctx, self.xfer_id, self.packed_fmt = link, ctx, xfer_id, packed_fmt
        self.bufs, self.num_blocks, self.chunk_blocks = bufs, num_blocks, chunk_blocks
        self.mode = mode
        self.num_chunks = math.ceil(num_blocks / chunk_blocks)
        self.posted: dict[int, asyncio.Future[None]] = {}  # chunk -> its receive
        self.unpacks: collections.deque[tuple[int, Launch]] = collections.deque()  # oldest first
        self.records: list[ReadChunk] = []  # the trace's, by chunk (empty when it is off)

    @property
    def quiet(self) -> bool:
        """No unpack of this read writes our blocks any more."""
        return all(unpacking.over for _, unpacking in self.unpacks)

    def _blocks_in(self, chunk: int) -> int:
        return min(self.chunk_blocks, self.num_blocks - chunk * self.chunk_blocks)

    def _post(self, chunk: int) -> None:
        buf = self.bufs[chunk % len(self.bufs)]
        nbytes = self.packed_fmt.nbytes(self._blocks_in(chunk))
        self.posted[chunk] = self.link.conn.post_recv(buf[:nbytes],
                                                      wire.channel_of(self.xfer_id, chunk))
        if self.ctx.trace is not None:
            self.records.append(ReadChunk(self.xfer_id, chunk, nbytes, self.mode,
                                          posted=time.monotonic_ns()))

    async def run(
        self, item: RemoteRead, local_block_ids: Sequence[int], tokens: TokenWindow
    ) -> None:
        local = self.ctx.local
        window = len(self.bufs)
        for chunk in range(window):
            self._post(chunk)
        await self.link.send(wire.Credit(self.xfer_id, window))
        layers = local.layers[item.local_layers.start : item.local_layers.stop]
        local_ids = list(local_block_ids[tokens.first_local_block :])
        block_tokens = self.chunk_blocks * self.packed_fmt.block_size
        try:
            for chunk in range(self.num_chunks):
                await self._arrival(chunk)
                blocks = self._blocks_in(chunk)
                src_offset, chunk_tokens, token_offset = tokens.in_chunk(
                    chunk * block_tokens, blocks * self.packed_fmt.block_size
                )
                staged = as_tensor(self.bufs[chunk % window][: self.packed_fmt.nbytes(blocks)])
                self.unpacks.append((chunk, launch(
                    self.mode, self.ctx.executor, staged, _unpack, staged, self.packed_fmt,
                    blocks, layers, local_ids, local.topology.layout, item.local_head_offset,
                    chunk_tokens, token_offset, src_offset,
                )))
            while self.unpacks:
                await self._recycle()
        except BaseException:
            await self._settle()
            raise

    async def _arrival(self, chunk: int) -> None:
        """Wait for ``chunk``'s bytes, freeing each unpack's buffer as soon as it ended."""
        while True:
            while self.unpacks and self.unpacks[0][1].finished.done():
                await self._recycle()  # posts and credits the chunk its buffer takes next
            arrived = self.posted.get(chunk)  # None: its buffer is still being unpacked from
            if not self.unpacks or (arrived is not None and arrived.done()):
                break
            oldest = self.unpacks[0][1].finished
            await asyncio.wait([oldest] if arrived is None else [oldest, arrived],
                               return_when=asyncio.FIRST_COMPLETED)
        cfg = self.ctx.config
        await self.link.conn.wait(self.posted.pop(chunk), timeout_s=cfg.chunk_timeout_s,
                                  what="chunk")
        if self.ctx.trace is not None:
            self.records[chunk].arrived = time.monotonic_ns()

    async def _recycle(self) -> None:
        """Wait for the oldest unpack to end; post its buffer's next chunk and credit it."""
        chunk, unpacking = self.unpacks[0]
        await ended(unpacking)
        self.unpacks.popleft()
        trace = self.ctx.trace
        if trace is not None:
            self.records[chunk].unpacked = time.monotonic_ns()
        following = chunk + len(self.bufs)
        if following < self.num_chunks:
            self._post(following)
            await self.link.send(wire.Credit(self.xfer_id, following + 1))
            if trace is not None:
                self.records[chunk].credited = time.monotonic_ns()

    async def _settle(self) -> None:
        """Let the unpacks under way end and drop those not begun, so that none writes
        our blocks once the read ended. A second cancel stops the wait (``quiet``
        then says whether they ended)."""
        running = []
        for _, unpacking in reversed(self.unpacks):  # newest first: not begun, dropped
            unpacking.finished.add_done_callback(retrieved)
            if not unpacking.withdraw():
                running.append(unpacking.finished)
        if running:
            await asyncio.wait(running)

    def give_back(self, *, broken: bool) -> None:
        for buf in self.bufs:
            if broken:
                self.ctx.pool.discard()  # a receive may still land in it
            else:
                self.ctx.pool.release(buf)
        if broken:
            self.link.fail(PeerClosedError("read abandoned with receives posted"))


def _unpack(
    staged: torch.Tensor, packed_fmt: PackedFormat, num_blocks: int, layers: list[torch.Tensor],
    local_ids: list[int], layout: KVLayout, head_offset: int, num_tokens: int, token_offset: int,
    src_token_offset: int,
) -> None:
    if num_tokens == 0:
        return
    unpack(
        staged, packed_fmt, num_blocks, layers, local_ids, layout,
        head_offset=head_offset, num_tokens=num_tokens, token_offset=token_offset,
        src_token_offset=src_token_offset,
    )
