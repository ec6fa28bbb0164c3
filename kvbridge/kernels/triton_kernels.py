"""Triton kernels for pack, unpack and copy_blocks (CUDA tensors; CPU under TRITON_INTERPRET=1).

Called by :mod:`kvbridge.kernels.launch` after validation, with 5-D word views
(:class:`kvbridge.kernels.caches.CacheSet`). One program moves one tile of head
rows of one (block, layer, kv)::

    grid = (num_blocks, num_layers * num_kv, cdiv(rows_per_block, BLOCK_ROWS))
    tile = [BLOCK_ROWS head rows] x [BLOCK_WORDS words]   (tails masked)

All layers go in one launch: layer ``l`` lives at word offset ``layer_offsets[l]``
from layer 0's pointer (per-layer tensors are separate allocations in one address
space; the table is made once per cache set and stays on the device). Layers
whose strides differ are launched one by one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvbridge.kernels.caches import CacheSet
from kvbridge.kernels.packed_format import PackedFormat
from kvbridge.topology import KVLayout

__all__ = ["copy_blocks", "pack", "unpack"]

# Words moved by one program at most: large enough to amortise index math,
# small enough to stay in registers.
_TILE_WORDS = 4096
#: Warps per program (``benchmarks/gpu_check.py --steps kernel-tune`` measures others).
_NUM_WARPS = 4


@triton.jit  # type: ignore[untyped-decorator]
def _pack_kernel(  # type: ignore[no-untyped-def]
    cache_ptr, layer_offsets_ptr, block_ids_ptr, out_ptr,
    num_blocks, stride_kv, stride_block, stride_token, stride_head,
    head_start, block_size, num_heads,
    NUM_KV: tl.constexpr, HEADS_MAJOR: tl.constexpr, ROW_WORDS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    layer_kv = tl.program_id(1)
    layer = layer_kv // NUM_KV
    kv = layer_kv % NUM_KV
    rows = tl.program_id(2) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    words = tl.arange(0, BLOCK_WORDS)
    num_rows = block_size * num_heads
    if HEADS_MAJOR:
        head = rows // block_size
        token = rows % block_size
    else:
        token = rows // num_heads
        head = rows % num_heads
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    base = tl.load(layer_offsets_ptr + layer) + kv * stride_kv + block * stride_block
    src = base + token.to(tl.int64) * stride_token + (head_start + head).to(tl.int64) * stride_head
    dst = ((layer_kv.to(tl.int64) * num_blocks + i) * num_rows + rows) * ROW_WORDS
    mask = (rows < num_rows)[:, None] & (words < ROW_WORDS)[None, :]
    values = tl.load(cache_ptr + src[:, None] + words[None, :], mask=mask)
    tl.store(out_ptr + dst[:, None] + words[None, :], values, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _unpack_kernel(  # type: ignore[no-untyped-def]
    buf_ptr, cache_ptr, layer_offsets_ptr, local_ids_ptr,
    num_remote_blocks, num_tokens, token_offset, src_token_offset, first_block,
    remote_block_size, local_block_size,
    num_heads, stride_kv, stride_block, stride_token, stride_head, head_offset,
    NUM_KV: tl.constexpr, PACKED_HEADS_MAJOR: tl.constexpr, ROW_WORDS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) + first_block
    layer_kv = tl.program_id(1)
    layer = layer_kv // NUM_KV
    kv = layer_kv % NUM_KV
    rows = tl.program_id(2) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    words = tl.arange(0, BLOCK_WORDS)
    num_rows = remote_block_size * num_heads
    if PACKED_HEADS_MAJOR:
        head = rows // remote_block_size
        token = rows % remote_block_size
    else:
        token = rows // num_heads
        head = rows % num_heads
    # buffer token k (from src_token_offset on) sits at position
    # token_offset + (k - src_token_offset) of the local blocks
    k = i * remote_block_size + token - src_token_offset
    valid = (rows < num_rows) & (k >= 0) & (k < num_tokens)
    position = token_offset + k
    block = tl.load(local_ids_ptr + position // local_block_size, mask=valid, other=0)
    dst = (
        tl.load(layer_offsets_ptr + layer)
        + kv * stride_kv
        + block.to(tl.int64) * stride_block
        + (position % local_block_size).to(tl.int64) * stride_token
        + (head_offset + head).to(tl.int64) * stride_head
    )
    src = ((layer_kv.to(tl.int64) * num_remote_blocks + i) * num_rows + rows) * ROW_WORDS
    mask = valid[:, None] & (words < ROW_WORDS)[None, :]
    values = tl.load(buf_ptr + src[:, None] + words[None, :], mask=mask)
    tl.store(cache_ptr + dst[:, None] + words[None, :], values, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _copy_kernel(  # type: ignore[no-untyped-def]
    src_ptr, dst_ptr, src_layer_offsets_ptr, dst_layer_offsets_ptr, src_ids_ptr, dst_ids_ptr,
    src_stride_kv, src_stride_block, src_stride_a, src_stride_b,
    dst_stride_kv, dst_stride_block, dst_stride_a, dst_stride_b, size_a, size_b,
    NUM_KV: tl.constexpr, ROW_WORDS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    layer_kv = tl.program_id(1)
    layer = layer_kv // NUM_KV
    kv = layer_kv % NUM_KV
    rows = tl.program_id(2) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    words = tl.arange(0, BLOCK_WORDS)
    a = (rows // size_b).to(tl.int64)
    b = (rows % size_b).to(tl.int64)
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    src = (
        tl.load(src_layer_offsets_ptr + layer) + kv * src_stride_kv
        + src_block * src_stride_block + a * src_stride_a + b * src_stride_b
    )  # fmt: skip
    dst = (
        tl.load(dst_layer_offsets_ptr + layer) + kv * dst_stride_kv
        + dst_block * dst_stride_block + a * dst_stride_a + b * dst_stride_b
    )  # fmt: skip
    mask = (rows < size_a * size_b)[:, None] & (words < ROW_WORDS)[None, :]
    values = tl.load(src_ptr + src[:, None] + words[None, :], mask=mask)
    tl.store(dst_ptr + dst[:, None] + words[None, :], values, mask=mask)


def pack(
    caches: CacheSet,
    block_ids: torch.Tensor,
    head_start: int,
    head_end: int,
    out: torch.Tensor,
) -> None:
    """Gather ``block_ids`` x heads ``[head_start, head_end)`` into ``out`` (words)."""
    num_heads = head_end - head_start
    rows_per_block = caches.block_size * num_heads
    per_layer = out.view(caches.num_layers, -1)
    tiles = _tiles(rows_per_block, caches.row_words)
    for first, layers in _layer_groups(caches.layers):
        layer = layers[0]
        grid = (block_ids.numel(), len(layers) * caches.num_kv, tiles[0])
        _pack_kernel[grid](
            layer, _layer_offsets(layers), block_ids, per_layer[first],
            block_ids.numel(), layer.stride(0), layer.stride(1),
            layer.stride(caches.token_dim), layer.stride(caches.head_dim_index),
            head_start, caches.block_size, num_heads,
            NUM_KV=caches.num_kv, HEADS_MAJOR=caches.layout == KVLayout.HND,
            ROW_WORDS=caches.row_words, BLOCK_ROWS=tiles[1], BLOCK_WORDS=tiles[2],
            num_warps=_NUM_WARPS,
        )  # fmt: skip


def unpack(
    buf: torch.Tensor,
    fmt: PackedFormat,
    num_remote_blocks: int,
    caches: CacheSet,
    local_block_ids: torch.Tensor,
    head_offset: int,
    num_tokens: int,
    token_offset: int,
    src_token_offset: int = 0,
) -> None:
    """Scatter ``buf`` (words, packed layout) into the local blocks; see ``launch.unpack``."""
    rows_per_block = fmt.block_size * fmt.num_heads
    per_layer = buf.view(caches.num_layers, -1)
    tiles = _tiles(rows_per_block, caches.row_words)
    # only remote blocks holding at least one written token get programs
    first_block = src_token_offset // fmt.block_size
    num_used = -(-(src_token_offset + num_tokens) // fmt.block_size) - first_block
    for first, layers in _layer_groups(caches.layers):
        layer = layers[0]
        grid = (num_used, len(layers) * caches.num_kv, tiles[0])
        _unpack_kernel[grid](
            per_layer[first], layer, _layer_offsets(layers), local_block_ids,
            num_remote_blocks, num_tokens, token_offset, src_token_offset, first_block,
            fmt.block_size, caches.block_size,
            fmt.num_heads, layer.stride(0), layer.stride(1),
            layer.stride(caches.token_dim), layer.stride(caches.head_dim_index), head_offset,
            NUM_KV=caches.num_kv,
            PACKED_HEADS_MAJOR=fmt.layout == KVLayout.HND and not fmt.is_mla,
            ROW_WORDS=caches.row_words, BLOCK_ROWS=tiles[1], BLOCK_WORDS=tiles[2],
            num_warps=_NUM_WARPS,
        )  # fmt: skip


def copy_blocks(src: CacheSet, dst: CacheSet, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy whole blocks ``src_ids`` -> ``dst_ids`` for every layer."""
    _, _, size_a, size_b, row_words = src.layers[0].shape
    tiles = _tiles(size_a * size_b, row_words)
    src_groups = _layer_groups(src.layers)
    dst_groups = _layer_groups(dst.layers)
    if len(src_groups) > 1 or len(dst_groups) > 1:
        # strides differ between layers: one launch per layer keeps the kernel simple
        src_groups = [(index, [t]) for index, t in enumerate(src.layers)]
        dst_groups = [(index, [t]) for index, t in enumerate(dst.layers)]
    for (_, src_layers), (_, dst_layers) in zip(src_groups, dst_groups, strict=True):
        s, d = src_layers[0], dst_layers[0]
        grid = (src_ids.numel(), len(src_layers) * src.num_kv, tiles[0])
        _copy_kernel[grid](
            s, d, _layer_offsets(src_layers, src_ids.device),
            _layer_offsets(dst_layers, src_ids.device), src_ids, dst_ids,
            s.stride(0), s.stride(1), s.stride(2), s.stride(3),
            d.stride(0), d.stride(1), d.stride(2), d.stride(3), size_a, size_b,
            NUM_KV=src.num_kv, ROW_WORDS=row_words, BLOCK_ROWS=tiles[1], BLOCK_WORDS=tiles[2],
            num_warps=_NUM_WARPS,
        )  # fmt: skip


def _tiles(rows_per_block: int, row_words: int) -> tuple[int, int, int]:
    """(tiles per block, BLOCK_ROWS, BLOCK_WORDS) for one block of head rows."""
    block_words = triton.next_power_of_2(row_words)
    block_rows = min(triton.next_power_of_2(rows_per_block), max(1, _TILE_WORDS // block_words))
    return triton.cdiv(rows_per_block, block_rows), block_rows, block_words


def _layer_groups(layers: Sequence[torch.Tensor]) -> list[tuple[int, list[torch.Tensor]]]:
    """Split layers into runs that share strides and sit at word-aligned distances.

    Returns ``(index of the first layer, layers)`` pairs; usually a single group.
    """
    groups: list[tuple[int, list[torch.Tensor]]] = []
    for index, layer in enumerate(layers):
        if groups:
            head = groups[-1][1][0]
            distance = layer.data_ptr() - head.data_ptr()
            if layer.stride() == head.stride() and distance % layer.element_size() == 0:
                groups[-1][1].append(layer)
                continue
        groups.append((index, [layer]))
    return groups


def _layer_offsets(
    layers: Sequence[torch.Tensor], device: torch.device | None = None
) -> torch.Tensor:
    """Word offset of each layer's first element from layer 0's.

    On ``device`` (default: the layers'): the device the kernel runs on, which for
    a copy to or from a pinned host mirror is not the mirror's. Kept there for the
    next launch on the same caches (``_offset_table``): no copy, no wait per call.
    """
    ptrs = tuple(t.data_ptr() for t in layers)
    return _offset_table(ptrs, layers[0].element_size(), device or layers[0].device)


@functools.lru_cache(maxsize=256)
def _offset_table(ptrs: tuple[int, ...], word_nbytes: int, device: torch.device) -> torch.Tensor:
    """``(ptr - ptrs[0]) // word_nbytes`` for each layer pointer, as an int64 tensor on ``device``.

    A pure function of its arguments, memoised: keyed by the layers' data
    pointers, an entry never goes stale (caches that move, or new ones, have
    other pointers and so another entry). Made once per cache set and device;
    that first copy to a CUDA device waits for it, later launches read the
    table where it is. The kernels only read it.
    """
    base = ptrs[0]
    offsets = [(ptr - base) // word_nbytes for ptr in ptrs]
    return torch.tensor(offsets, dtype=torch.int64, device=device)
