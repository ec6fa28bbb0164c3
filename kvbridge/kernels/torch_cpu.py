"""Torch implementations of pack, unpack and copy_blocks, used for CPU tensors.

Called by :mod:`kvbridge.kernels.launch` after validation. Each op moves every
byte once: it computes, once per call, the word offset of every contiguous run
("row") it must move, then issues one gather or one scatter per layer. Rows are
as long as both sides allow: a whole block payload when layouts agree, a head
row of ``head_dim`` elements when one side is HND and the other NHD::

    packed [kv][i][ r0 | r1 | r2 | ... ]       r = head rows in packed order
    cache  offset(kv, i, r) = kv*s_kv + block(i, r)*s_block + slot*s_tok + head*s_head
    run    m consecutive packed rows whose cache offsets are also consecutive

The cache side is addressed through ``as_strided(layer, (M, run), (1, 1))``: row
``o`` of that view starts at word offset ``o``, so a row index is an offset.
Gathers use ``torch.index_select`` (one memcpy per row). Scatters into CPU
memory use numpy fancy assignment with each row as one fixed-size void item,
which is also one memcpy per row, where ``Tensor.index_copy_`` loops over
elements; other devices use ``index_copy_``.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvbridge.kernels.caches import CacheSet
from kvbridge.kernels.packed_format import PackedFormat
from kvbridge.topology import KVLayout

__all__ = ["copy_blocks", "pack", "unpack"]

# Up to this many per-(layer, run) copy_ calls, copy_blocks copies runs of
# consecutive ids directly (one pass); beyond, it gathers then scatters.
_MAX_RUN_COPIES = 256
# Below this many bytes, unpack scatters its layers on the calling thread only.
_PARALLEL_MIN_NBYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class _Rows:
    """Cache-side word offsets of the rows one op moves, ``run_words`` words each."""

    starts: torch.Tensor
    run_words: int
    num_view_rows: int

    @classmethod
    def at(cls, starts: torch.Tensor, run_words: int) -> _Rows:
        num_view_rows = int(starts.max()) + 1 if starts.numel() else 0
        return cls(starts, run_words, num_view_rows)

    def view(self, layer: torch.Tensor) -> torch.Tensor:
        """``layer``'s storage as overlapping rows: row ``o`` starts at word offset ``o``."""
        return torch.as_strided(
            layer, (self.num_view_rows, self.run_words), (1, 1), layer.storage_offset()
        )

    def gather(self, layer: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] = row starts[i]`` of ``layer``; ``out`` is ``[num_rows, run_words]``."""
        starts = self.starts.reshape(-1).to(layer.device)
        torch.index_select(self.view(layer), 0, starts, out=out)

    def scatter(self, layer: torch.Tensor, values: torch.Tensor) -> None:
        """Row ``starts[j]`` of ``layer`` = ``values[j]``, where ``values`` is
        ``[*starts.shape, run_words]`` with contiguous rows (any outer strides)."""
        target = self.view(layer)
        if layer.device.type != "cpu":
            target.index_copy_(
                0, self.starts.reshape(-1).to(layer.device), values.reshape(-1, self.run_words)
            )
            return
        item = np.dtype((np.void, self.run_words * layer.element_size()))
        target.numpy().view(item)[:, 0][self.starts.numpy()] = values.numpy().view(item)[..., 0]


def pack(
    caches: CacheSet,
    block_ids: torch.Tensor,
    head_start: int,
    head_end: int,
    out: torch.Tensor,
) -> None:
    """Gather ``block_ids`` x heads ``[head_start, head_end)`` into ``out`` (words)."""
    per_layer = out.view(caches.num_layers, -1)
    plans: dict[tuple[int, ...], _Rows] = {}
    for layer, dst in zip(caches.layers, per_layer, strict=True):
        src = layer.narrow(caches.head_dim_index, head_start, head_end - head_start)
        plan = plans.get(src.stride())
        if plan is None:
            offsets = _block_offsets(src, block_ids.cpu())
            plan = plans[src.stride()] = _coalesced(
                offsets, _run_rows(offsets, caches.row_words), caches.row_words
            )
        plan.gather(src, dst.view(-1, plan.run_words))


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
    """Scatter ``buf`` (words, packed layout) into the local blocks; see ``launch.unpack``.

    Buffer tokens ``[src_token_offset, src_token_offset + num_tokens)`` are
    written. Remote blocks wholly inside that range go in one scatter per layer;
    a partial first block (``src_token_offset`` inside it) and a partial last
    block go in small masked ones::

        buffer  |  b0  |  b1  |  b2  |  b3  |       (remote blocks)
                    [=========================)     written tokens
                 first  ^ full: b1, b2 ^  last (partial)
    """
    block_size = fmt.block_size
    start, end = src_token_offset, src_token_offset + num_tokens
    first, last = start // block_size, (end - 1) // block_size
    full_lo, full_hi = -(-start // block_size), end // block_size  # wholly written blocks
    partial = sorted({first, last} - set(range(full_lo, full_hi)))
    row_words = caches.row_words
    buf_rows = buf.view(caches.num_layers, caches.num_kv, num_remote_blocks, -1, row_words)
    token, _ = _packed_rows(_heads_major(fmt), block_size, fmt.num_heads)
    masks = {
        b: (b * block_size + token >= start) & (b * block_size + token < end) for b in partial
    }
    plans: dict[tuple[int, ...], tuple[_Rows | None, list[tuple[int, _Rows]]]] = {}
    jobs: list[tuple[_Rows, torch.Tensor, torch.Tensor]] = []
    for layer, src in zip(caches.layers, buf_rows, strict=True):
        if layer.stride() not in plans:
            offsets = _landing_offsets(
                layer, caches, fmt, local_block_ids.cpu(), head_offset, first, last + 1,
                token_offset - start,
            )
            full = None
            if full_hi > full_lo:
                full_offsets = offsets[:, full_lo - first : full_hi - first]
                full = _coalesced(full_offsets, _run_rows(full_offsets, row_words), row_words)
            parts = [(b, _Rows.at(offsets[:, b - first, masks[b]], row_words)) for b in partial]
            plans[layer.stride()] = (full, parts)
        full, parts = plans[layer.stride()]
        if full is not None:
            values = src[:, full_lo:full_hi].reshape(*full.starts.shape, full.run_words)
            jobs.append((full, layer, values))
        for b, rows in parts:
            # at most two blocks per layer: the small gather by mask is not a second pass
            jobs.append((rows, layer, src[:, b, masks[b]]))
    _run_scatters(jobs, buf.numel() * buf.element_size())


def _run_scatters(jobs: list[tuple[_Rows, torch.Tensor, torch.Tensor]], nbytes: int) -> None:
    """Run the per-layer scatters, on torch's thread count when the copy is large.

    numpy releases the GIL while it copies, so layers scatter in parallel; a pool
    per call is cheap next to the copies of ``_PARALLEL_MIN_NBYTES`` and more it
    is used for.
    """
    num_threads = min(torch.get_num_threads(), len(jobs))
    on_cpu = all(layer.device.type == "cpu" for _, layer, _ in jobs)
    if num_threads <= 1 or not on_cpu or nbytes < _PARALLEL_MIN_NBYTES:
        for rows, layer, values in jobs:
            rows.scatter(layer, values)
        return
    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(lambda job: job[0].scatter(job[1], job[2]), jobs))


def copy_blocks(src: CacheSet, dst: CacheSet, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy whole blocks ``src_ids`` -> ``dst_ids`` for every layer (any devices)."""
    if src.device == dst.device:
        runs = _runs(src_ids.tolist(), dst_ids.tolist())
        if len(runs) * src.num_layers <= _MAX_RUN_COPIES:
            for s_layer, d_layer in zip(src.layers, dst.layers, strict=True):
                for s_first, d_first, count in runs:
                    d_slice = d_layer[:, d_first : d_first + count]
                    d_slice.copy_(s_layer[:, s_first : s_first + count])
            return
    # Scattered blocks, or two devices: gather rows on the source side, move the
    # staged rows once, scatter on the destination side.
    plans: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[_Rows, _Rows]] = {}
    for s_layer, d_layer in zip(src.layers, dst.layers, strict=True):
        key = (s_layer.stride(), d_layer.stride())
        if key not in plans:
            plans[key] = _copy_plan(s_layer, d_layer, src_ids.cpu(), dst_ids.cpu())
        src_rows, dst_rows = plans[key]
        staged = torch.empty(
            (src_rows.starts.numel(), src_rows.run_words), dtype=s_layer.dtype, device=src.device
        )
        src_rows.gather(s_layer, staged)
        dst_rows.scatter(d_layer, staged.to(dst.device).view(*dst_rows.starts.shape, -1))


def _copy_plan(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> tuple[_Rows, _Rows]:
    """Rows as long as both the source and the destination blocks allow."""
    row_words = src.shape[-1]
    src_offsets = _block_offsets(src, src_ids)
    dst_offsets = _block_offsets(dst, dst_ids)
    num_rows = math.gcd(_run_rows(src_offsets, row_words), _run_rows(dst_offsets, row_words))
    src_rows = _coalesced(src_offsets, num_rows, row_words)
    dst_rows = _coalesced(dst_offsets, num_rows, row_words)
    return _Rows.at(src_rows.starts.to(src.device), src_rows.run_words), dst_rows


def _landing_offsets(
    layer: torch.Tensor,
    caches: CacheSet,
    fmt: PackedFormat,
    local_block_ids: torch.Tensor,
    head_offset: int,
    first_block: int,
    end_block: int,
    shift: int,
) -> torch.Tensor:
    """``[num_kv, end_block - first_block, rows]`` word offsets where each packed head row lands.

    Buffer token ``k`` of remote block ``b`` (``k = b * block_size + row's token``)
    lands at local position ``shift + k``. Rows outside the written tokens get a
    clamped (valid but unused) offset.
    """
    token, head = _packed_rows(_heads_major(fmt), fmt.block_size, fmt.num_heads)
    blocks = torch.arange(first_block, end_block).view(-1, 1)
    position = shift + blocks * fmt.block_size + token
    local_index = (position // caches.block_size).clamp_(0, local_block_ids.numel() - 1)
    s_kv, s_block = layer.stride(0), layer.stride(1)
    within = (
        local_block_ids[local_index] * s_block
        + position % caches.block_size * layer.stride(caches.token_dim)
        + (head_offset + head) * layer.stride(caches.head_dim_index)
    )
    return (torch.arange(caches.num_kv) * s_kv).view(-1, 1, 1) + within.unsqueeze(0)


def _block_offsets(layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[num_kv, num_ids, a * b]`` word offsets of every head row of the given blocks."""
    num_kv, _, size_a, size_b, _ = layer.shape
    s_kv, s_block, s_a, s_b, _ = layer.stride()
    return (
        (torch.arange(num_kv) * s_kv).view(-1, 1, 1)
        + (block_ids * s_block).view(1, -1, 1)
        + _grid_offsets(size_a, size_b, s_a, s_b).view(1, 1, -1)
    )


def _run_rows(offsets: torch.Tensor, row_words: int) -> int:
    """Largest ``m`` such that every group of ``m`` rows (last dim) is contiguous.

    ``m`` must divide the row count, and every break in contiguity must fall on a
    multiple of ``m``; the largest such ``m`` is a gcd.
    """
    num_rows = offsets.shape[-1]
    flat = offsets.reshape(-1, num_rows)
    steady = (flat[:, 1:] - flat[:, :-1] == row_words).all(0)
    breaks = (torch.nonzero(~steady).view(-1) + 1).tolist()
    return math.gcd(num_rows, *breaks)


def _coalesced(offsets: torch.Tensor, num_rows: int, row_words: int) -> _Rows:
    """Rows of ``num_rows`` head rows each (``num_rows`` from :func:`_run_rows`)."""
    per_block = offsets.shape[-1]
    starts = offsets.reshape(*offsets.shape[:-1], per_block // num_rows, num_rows)[..., 0]
    return _Rows.at(starts.contiguous(), num_rows * row_words)


def _runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal ``(src_first, dst_first, count)`` runs where both ids step by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _heads_major(fmt: PackedFormat) -> bool:
    return fmt.layout == KVLayout.HND and not fmt.is_mla


@lru_cache(maxsize=64)
def _grid_offsets(size_a: int, size_b: int, stride_a: int, stride_b: int) -> torch.Tensor:
    """Offsets of an ``[a][b]`` grid of rows, flattened a-major."""
    grid = torch.arange(size_a).view(-1, 1) * stride_a + torch.arange(size_b) * stride_b
    return grid.reshape(-1)


@lru_cache(maxsize=64)
def _packed_rows(
    heads_major: bool, block_size: int, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, head) of each head row of one packed payload, in packed order."""
    rows = torch.arange(block_size * num_heads)
    if heads_major:
        return rows % block_size, rows // block_size
    return rows // num_heads, rows % num_heads
