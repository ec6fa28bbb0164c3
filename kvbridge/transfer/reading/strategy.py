"""How one plan item is read: what to ask for (``prepare``) and which strategy reads it.

Three strategies, one module each, all ``base.BegunRead``; ``choose`` picks one
from the prepared read and the link:

- ``staged.py``  the server packs, we receive into staging buffers and unpack
  (blocks stored differently: layout, block size, a strided head slice);
- ``direct.py``  receives straight into our blocks (``setup.span`` is set:
  both caches store the item's blocks alike);
- ``same_host.py``  we copy the server's blocks out of its memory ourselves
  (direct, the server on this host, a large read).

Staging buffers live where the caches do: a reader with CUDA caches always
stages (``_direct_span``), since UCX moves one contiguous GPU buffer far faster
than scatter-gather lists of GPU memory (docs/benchmarks.md, "GPU").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvbridge.errors import ConfigError
from kvbridge.kernels import PackedFormat
from kvbridge.topology import KVLayout, RemoteRead
from kvbridge.transfer.blocks.ranges import HeadSpan, head_span
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.base import BegunRead, ReaderContext, ReadSetup
from kvbridge.transfer.reading.direct import DirectRead
from kvbridge.transfer.reading.same_host import SameHostCopy, SameHostPeer
from kvbridge.transfer.reading.staged import StagedRead
from kvbridge.transfer.reading.tokens import TokenWindow

__all__ = ["choose", "prepare"]


def choose(setup: ReadSetup, ctx: ReaderContext, same_host: SameHostPeer | None
           ) -> type[BegunRead]:
    """Staged unless both caches store the blocks alike; then direct, or a
    same-host copy when the server is on this host (``same_host``: the link's,
    None when it is not) and the read is at least ``local_copy_min_nbytes``."""
    if setup.span is None:
        return StagedRead
    if (same_host is not None
            and setup.direct_nbytes(ctx.local) >= ctx.config.local_copy_min_nbytes):
        return SameHostCopy
    return DirectRead


def prepare(
    meta: wire.AgentMetadata,
    ctx: ReaderContext,
    xfer_ids: Iterator[int],
    item: RemoteRead,
    grant: str,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    num_tokens: int,
    first_token: int,
    prompt_digest: bytes,
) -> ReadSetup:
    """The read of ``item`` from a server described by ``meta``: request, format, tokens.

    ``xfer_ids``: the link's id counter (one id is drawn once the read is valid).

    Raises:
        ConfigError: the remote block ids do not cover the tokens, or a fused
            K/V cache is read from inside a block.
    """
    packed_fmt = PackedFormat(
        layout=KVLayout.parse(meta.layout), block_size=meta.block_size,
        num_heads=len(item.remote_heads), head_dim=meta.head_dim,
        elem_nbytes=meta.elem_nbytes, num_layers=len(item.remote_layers), is_mla=meta.is_mla,
        fused_kv=meta.fused_kv, split_kv=meta.split_kv,
    )
    fused = ctx.local.topology.fused_kv
    if fused and first_token % meta.block_size:
        raise ConfigError(
            f"a fused K/V cache (K transposed in each block) is read in whole blocks: "
            f"first token {first_token} is inside a block of {meta.block_size} tokens"
        )
    tokens = TokenWindow(first_token, num_tokens, meta.block_size, ctx.local.topology,
                         whole_blocks=fused)
    block_ids = list(remote_block_ids[tokens.first_remote_block : tokens.end_remote_block])
    num_blocks = len(block_ids)
    if num_blocks != tokens.end_remote_block - tokens.first_remote_block:
        raise ConfigError(
            f"{len(remote_block_ids)} remote block ids of {meta.block_size} tokens do not "
            f"cover tokens [{first_token}, {first_token + num_tokens})"
        )
    chunk_blocks = max(1, ctx.config.chunk_nbytes // packed_fmt.block_nbytes)
    xfer_id = next(xfer_ids) % wire.MAX_XFER_ID + 1
    request = wire.ReadRequest(
        xfer_id, grant, block_ids, item.remote_heads.start, item.remote_heads.stop,
        item.remote_layers.start, item.remote_layers.stop, chunk_blocks,
        prompt_digest=prompt_digest,
    )
    span = _direct_span(meta, ctx, item, tokens)
    return ReadSetup(item, request, packed_fmt, tokens, local_block_ids, span)


def _direct_span(
    meta: wire.AgentMetadata, ctx: ReaderContext, item: RemoteRead, tokens: TokenWindow
) -> HeadSpan | None:
    """Our heads' run in a block plane if this item can be read direct, else None."""
    local = ctx.local
    topo = local.topology
    alike = (
        meta.is_mla == topo.is_mla and meta.fused_kv == topo.fused_kv
        and meta.split_kv == topo.split_kv
        and KVLayout.parse(meta.layout) is topo.layout
        and meta.block_size == topo.block_size and meta.elem_nbytes == local.elem_nbytes
        and meta.head_dim == local.head_dim and tokens.skip == 0
        and tokens.local_offset == 0
    )
    if not alike or not ctx.config.direct_reads or local.layers[0].is_cuda:
        return None  # GPU memory: one packed buffer per chunk, not 32 KiB pieces (staging.py)
    heads = item.remote_heads
    remote_run = meta.is_mla or topo.layout is KVLayout.HND or len(heads) == meta.num_heads
    local_span = head_span(local, item.local_head_offset, item.local_head_offset + len(heads))
    return local_span if remote_run else None
