"""Where a read's KV bytes sit in a rank's own cache, for direct (zero-staging) reads.

When both ends store blocks the same way (layout, block size, element size,
head dim) and the heads a read moves form one contiguous run inside each K or
V plane of a block, the server can send block memory as it is and the reader
can receive it straight into its own blocks (``ucx/iov.py``). Both ends list the
ranges in the same order, so the byte streams line up::

    for each layer of the read: for K then V (MLA, fused K/V: the one plane):
        for each block of the chunk: [ plane of that block, heads of the read ]

    HND block plane  [ h0 | h1 | h2 | h3 ]  heads h1..h2: one run  -> direct
    NHD block plane  [ t0: h0 h1 h2 h3 | t1: h0 h1 h2 h3 | ... ]
                     all heads: one run -> direct; a subset: strided -> staged

A fused K/V cache (vLLM CPU) has one plane per layer, HND: each head's
``K^T | V`` is one run, so any head slice reads direct.

Used by the reading side (``reading/strategy.py`` decides, ``reading/direct.py``
and ``reading/same_host.py`` build the receive or copy ranges) and the serving
side (``serving/checks.py`` re-checks, ``serving/direct.py`` and
``serving/copy_hold.py`` build the send ranges and the go).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.topology import KVLayout
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.ucx.iov import iov_array

__all__ = [
    "MAX_RANGES_PER_CHUNK", "HeadSpan", "block_offsets", "block_ranges", "head_span",
    "num_planes", "plane_ranges", "span_of",
]

#: Ranges one data message may list (before merging adjacent ones).
MAX_RANGES_PER_CHUNK = 1 << 14


@dataclass(frozen=True, slots=True)
class HeadSpan:
    """The bytes of some heads inside one K or V plane of one block."""

    offset: int
    nbytes: int


def head_span(local: LocalKV, head_start: int, head_end: int) -> HeadSpan | None:
    """Heads ``[head_start, head_end)`` of this rank's blocks as one run, or None if strided.

    Args:
        local: the rank's caches.
        head_start, head_end: heads of this rank (MLA: ignored, the latent rows).
            For fused K/V the rows are ``local.head_dim = 2 * head_size`` long.
    """
    topo = local.topology
    return span_of(topo.layout, topo.is_mla, topo.block_size, local.num_heads,
                   local.head_dim * local.elem_nbytes, head_start, head_end)


def span_of(
    layout: KVLayout, is_mla: bool, block_size: int, num_heads: int, row_nbytes: int,
    head_start: int, head_end: int,
) -> HeadSpan | None:
    """``head_span`` of any rank's blocks, from what its handshake says of them.

    Args:
        row_nbytes: bytes of one head's row of one token (``head_dim * elem_nbytes``).
        num_heads: heads the rank holds.
    """
    if is_mla:
        return HeadSpan(0, block_size * row_nbytes)
    num = head_end - head_start
    if layout is KVLayout.HND:
        return HeadSpan(head_start * block_size * row_nbytes, num * block_size * row_nbytes)
    if num == num_heads:
        return HeadSpan(0, block_size * num * row_nbytes)
    return None


def num_planes(local: LocalKV) -> int:
    """Planes per block and layer: K and V, or one (MLA's latent, fused K/V, a split
    cache's K or V)."""
    return local.num_planes


def block_ranges(
    local: LocalKV, block_ids: npt.NDArray[np.int64], layers: slice, span: HeadSpan,
) -> npt.NDArray[np.uint64]:
    """The ``ucp_dt_iov_t`` ranges of ``span`` in ``block_ids`` of ``layers`` (stream order).

    Ranges of adjacent blocks are merged (``iov_array``) when the ids hold a run
    of consecutive blocks; scattered ids, the usual case, skip that pass.

    Args:
        local: the rank's caches (for the strides).
        block_ids: this rank's block ids, in the read's order (checked by the caller).
        layers: which of the rank's layers, in the read's order.
        span: the heads' run inside a block plane (``head_span``).
    """
    origins = local.plane_origins(layers)
    offsets = block_offsets(block_ids, local.plane_block_nbytes, span.offset)
    if offsets.size > 1 and bool((np.diff(block_ids) == 1).any()):
        addresses = origins[:, None] + offsets[None, :]
        return iov_array(addresses.reshape(-1), np.full(addresses.size, span.nbytes, np.uint64))
    return plane_ranges(origins, offsets, span.nbytes)


def block_offsets(
    block_ids: npt.NDArray[np.int64], block_stride: int, span_offset: int
) -> npt.NDArray[np.uint64]:
    """Where ``span_offset`` of each block sits from the start of its plane."""
    offsets = block_ids.astype(np.uint64) * np.uint64(block_stride)
    offsets += np.uint64(span_offset)
    return offsets


def plane_ranges(
    origins: npt.NDArray[np.uint64], offsets: npt.NDArray[np.uint64], nbytes: int
) -> npt.NDArray[np.uint64]:
    """``(origin + offset, nbytes)`` for each origin, then each offset: one range per row.

    The unmerged form of ``block_ranges``: row ``i`` of two such arrays built for
    the same blocks on two ranks always has one length (same-host copies rely on it).
    """
    out = np.empty((origins.size * offsets.size, 2), dtype=np.uint64)
    np.add(origins[:, None], offsets[None, :], out=out[:, 0].reshape(origins.size, offsets.size))
    out[:, 1] = nbytes
    return out
