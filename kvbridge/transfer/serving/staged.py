"""Serving a staged read: pack each chunk into a staging buffer and send it on credit.

For reads whose blocks the two caches store differently (layout, block size,
a strided head slice), started by ``session.py`` in the read's task::

    DataHeader -> for each chunk i: wait for Credit > i, take a staging
    buffer, pack (executor thread), send on channel (xfer_id, i)

Credits make the reader post its receive before the server sends, so a staging
buffer is never held waiting on a reader that is itself waiting for buffers.
The reading half is ``reading/staged.py``.
"""

from __future__ import annotations

import asyncio

import torch

from kvbridge.kernels import on_device, pack
from kvbridge.transfer.blocks.staging import Buffer, as_tensor
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
    loop = asyncio.get_running_loop()
    sends: list[asyncio.Task[None]] = []
    try:
        for chunk in range(chunks):
            await state.wait_credit(chunk + 1, cfg.chunk_timeout_s)
            ids = req.block_ids[chunk * req.chunk_blocks : (chunk + 1) * req.chunk_blocks]
            nbytes = len(ids) * nbytes_per_block
            [buf] = await ctx.pool.acquire(nbytes, timeout_s=cfg.chunk_timeout_s)
            staging = as_tensor(buf)
            try:
                await loop.run_in_executor(
                    ctx.executor, _pack, layers, ids, req, local, staging
                )
            except BaseException:
                ctx.pool.release(buf)
                raise
            sends.append(asyncio.create_task(_send_one(ctx, conn, buf, nbytes, req.xfer_id, chunk)))
        await asyncio.gather(*sends)
    finally:
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
    ctx.num_bytes_served += num_blocks * nbytes_per_block


def _pack(
    layers: list[torch.Tensor], ids: list[int], req: wire.ReadRequest, local: LocalKV,
    staging: torch.Tensor,
) -> None:
    with on_device(staging):  # packed before UCX reads a device buffer
        pack(layers, ids, req.head_start, req.head_end, local.topology.layout, out=staging)


async def _send_one(
    ctx: ServerContext, conn: UcxConnection, buf: Buffer, nbytes: int, xfer_id: int, chunk: int
) -> None:
    try:
        channel = wire.channel_of(xfer_id, chunk)
        ctx.num_data_bytes_sent += nbytes
        await conn.send(buf[:nbytes], channel, timeout_s=ctx.config.chunk_timeout_s)
    except BaseException:
        ctx.pool.discard()  # UCX may still read it: never reuse
        raise
    ctx.pool.release(buf)
