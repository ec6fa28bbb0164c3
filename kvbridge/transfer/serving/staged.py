"""Serving a staged read: pack each chunk into a staging buffer and send it on credit.

For reads whose blocks the two caches store differently (layout, block size,
a strided head slice), started by ``session.py`` in the read's task::

    DataHeader -> for each chunk i: wait for Credit > i, take a staging
    buffer, pack (``blocks/launching.py``: on the copy thread, or launched on
    this loop and awaited through a CUDA event), send on channel (xfer_id, i)

Credits make the reader post its receive before the server sends, so a staging
buffer is never held waiting on a reader that is itself waiting for buffers.
A pack given up (the read's task cancelled) gives its buffer back at once: a
pack still running on the copy thread, or queued on the device, writes it
before whatever the next taker queues behind it (one copy thread; one stream).
With ``KVBRIDGE_TRACE_CHUNKS`` set, each chunk's stamps go to the trace
(``chunk_trace.py``). The reading half is ``reading/staged.py``.
"""

from __future__ import annotations

import asyncio
import time

import torch

from kvbridge.kernels import pack
from kvbridge.transfer.blocks.launching import launch, launch_mode
from kvbridge.transfer.blocks.staging import Buffer, as_tensor
from kvbridge.transfer.chunk_trace import ServedChunk
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import send_msg
from kvbridge.transfer.serving.checks import block_nbytes, num_chunks
from kvbridge.transfer.serving.context import ServedRead, ServerContext
from kvbridge.transfer.ucx.connection import UcxConnection

__all__ = ["send_chunks"]


async def send_chunks(
    ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, state: ServedRead
) -> None:
    """Send ``req``'s blocks packed, chunk by chunk as the reader's credit allows.

    The grant is pinned by the caller, who unpins it when this returns or raises.

    Raises:
        PeerTimeoutError: no credit, no staging buffer or no send completion in time.
        PeerClosedError, TransferError: a send failed.
    """
    cfg, local = ctx.config, ctx.local
    nbytes_per_block = block_nbytes(local, req)
    num_blocks = len(req.block_ids)
    chunks = num_chunks(req)
    header = wire.DataHeader(req.xfer_id, chunks, num_blocks * nbytes_per_block)
    await send_msg(conn, ctx.codec, header, cfg.reply_timeout_s)
    layers = local.layers[req.layer_start : req.layer_end]
    mode = launch_mode(cfg.staged_launch, local.layers[0].device)
    trace = ctx.trace
    records: list[ServedChunk] = []
    sends: list[asyncio.Task[None]] = []
    try:
        for chunk in range(chunks):
            await state.wait_credit(chunk + 1, cfg.chunk_timeout_s)
            ids = req.block_ids[chunk * req.chunk_blocks : (chunk + 1) * req.chunk_blocks]
            nbytes = len(ids) * nbytes_per_block
            record = None
            if trace is not None:
                record = ServedChunk(req.xfer_id, chunk, nbytes, mode, credit=time.monotonic_ns())
                records.append(record)
            [buf] = await ctx.pool.acquire(nbytes, timeout_s=cfg.chunk_timeout_s)
            if record is not None:
                record.buffer = time.monotonic_ns()
            staging = as_tensor(buf)
            try:
                await launch(mode, ctx.executor, staging, _pack, layers, ids, req, local,
                             staging).finished
            except BaseException:
                ctx.pool.release(buf)
                raise
            if record is not None:
                record.packed = time.monotonic_ns()
            sends.append(asyncio.create_task(
                _send_one(ctx, conn, buf, nbytes, req.xfer_id, chunk, record)))
        await asyncio.gather(*sends)
    finally:
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        if trace is not None:
            trace.write(records)
    ctx.num_bytes_served += num_blocks * nbytes_per_block


def _pack(
    layers: list[torch.Tensor], ids: list[int], req: wire.ReadRequest, local: LocalKV,
    staging: torch.Tensor,
) -> None:
    pack(layers, ids, req.head_start, req.head_end, local.topology.layout, out=staging)


async def _send_one(
    ctx: ServerContext, conn: UcxConnection, buf: Buffer, nbytes: int, xfer_id: int, chunk: int,
    record: ServedChunk | None,
) -> None:
    try:
        channel = wire.channel_of(xfer_id, chunk)
        ctx.num_data_bytes_sent += nbytes
        await conn.send(buf[:nbytes], channel, timeout_s=ctx.config.chunk_timeout_s)
    except BaseException:
        ctx.pool.discard()  # UCX may still read it: never reuse
        raise
    if record is not None:
        record.sent = time.monotonic_ns()
    ctx.pool.release(buf)
