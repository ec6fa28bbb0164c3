"""Public entry points of the kernels: validate inputs, then run Triton or torch.

Called by the transfer agent. Every check happens before the first write, so a
:class:`KernelInputError` leaves caches and buffers untouched. On CUDA nothing
here waits for the device: block ids are checked on the host and copied over
once, without waiting (``checks.to_device``), and the layers' offset tables stay
on the device (``triton_kernels._layer_offsets``); the caller waits for the work
(``on_device``, or a CUDA event of its own). CUDA tensors go to
:mod:`kvbridge.kernels.triton_kernels`, CPU tensors to
:mod:`kvbridge.kernels.torch_cpu`; ``impl`` overrides the choice (tests force
``"triton"`` on CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvbridge.kernels import checks, torch_cpu
from kvbridge.kernels.caches import (
    CacheSet,
    LayerCaches,
    narrow_to_common_word,
    split_layers,
    widen,
)
from kvbridge.kernels.checks import BlockIds, Impl
from kvbridge.kernels.errors import KernelInputError
from kvbridge.kernels.packed_format import PackedFormat
from kvbridge.topology import KVLayout

__all__ = ["Impl", "copy_blocks", "on_device", "pack", "unpack", "packed_format"]


def packed_format(
    layer_caches: LayerCaches, layout: KVLayout, head_start: int, head_end: int
) -> PackedFormat:
    """Describe the buffer :func:`pack` builds from these caches and head slice.

    Raises:
        KernelInputError: invalid caches or head slice.
    """
    caches = split_layers(layer_caches, layout, "caches")
    checks.check_heads(caches, head_start, head_end)
    return _format_of(caches, head_end - head_start)


def pack(
    layer_caches: LayerCaches,
    block_ids: BlockIds,
    head_start: int,
    head_end: int,
    layout: KVLayout,
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Gather blocks (all layers, heads ``[head_start, head_end)``) into one buffer.

    The buffer follows the packed layout of :mod:`kvbridge.kernels.packed_format`; no relayout.

    Args:
        layer_caches: the sender's caches (per-layer list or stacked tensor).
        block_ids: blocks to send, any order, repeats allowed.
        head_start: first head of the slice (0 for MLA).
        head_end: one past the last head (1 for MLA).
        layout: layout of the caches.
        out: optional staging buffer to reuse: contiguous, same device, at least
            ``fmt.nbytes(len(block_ids))`` bytes, aligned to the element size.
        impl: ``"auto"`` (Triton for CUDA, torch for CPU), ``"triton"`` or ``"torch"``.

    Returns:
        A 1-D ``uint8`` view of the packed bytes (a prefix of ``out`` when given).

    Raises:
        KernelInputError: bad caches, head slice, ids, ``out`` or ``impl``.
    """
    caches = split_layers(layer_caches, layout, "caches")
    checks.check_heads(caches, head_start, head_end)
    ids = checks.as_block_ids(block_ids, caches.num_blocks, "block_ids")
    fmt = _format_of(caches, head_end - head_start)
    nbytes = fmt.nbytes(ids.numel())
    out_bytes = checks.staging_bytes(out, nbytes, caches.device, "out")
    use_triton = checks.use_triton(impl, caches.device)
    if nbytes == 0:
        return out_bytes
    out_elems = checks.as_elements(out_bytes, caches.elem_nbytes, "out")
    words, (out_words,) = widen(caches, [out_elems])
    if use_triton:
        from kvbridge.kernels import triton_kernels

        device_ids = checks.to_device(ids, caches.device)
        triton_kernels.pack(words, device_ids, head_start, head_end, out_words)
    else:
        torch_cpu.pack(words, ids, head_start, head_end, out_words)
    return out_bytes


def unpack(
    buf: torch.Tensor,
    fmt: PackedFormat,
    num_remote_blocks: int,
    layer_caches: LayerCaches,
    local_block_ids: BlockIds,
    local_layout: KVLayout,
    head_offset: int = 0,
    num_tokens: int | None = None,
    token_offset: int = 0,
    *,
    src_token_offset: int = 0,
    impl: Impl = "auto",
) -> None:
    """Scatter a packed buffer into local blocks, fixing layout and block size.

    Remote blocks hold a run of consecutive tokens; token ``k`` of the run lands at
    position ``p = token_offset + k - src_token_offset`` of the local blocks, for
    ``k`` in ``[src_token_offset, src_token_offset + num_tokens)``::

        remote  |r0 r0 r0 r0|r1 r1 r1 r1|r2 r2 r2 r2|...      (block_size 4)
        k        0 1 2 ...        (src_token_offset 2: r0's first 2 tokens skipped)
        p            0 ...                           (token_offset 0)
        local   |L[0] ......... 8 slots|L[1] ......... |       (block_size 8)
                 block local_block_ids[p // 8], slot p % 8

    heads ``[head_offset, head_offset + fmt.num_heads)`` of the local block.

    Fused K/V caches (single-plane views, :mod:`kvbridge.kernels.caches`) take
    only buffers packed from fused caches of their block size, and only whole
    blocks (``num_tokens``, ``token_offset`` and ``src_token_offset`` multiples
    of it): their rows are not tokens, so anything else would land wrong. Split
    K/V caches (one K or V plane per entry, NHD) take only buffers packed from
    split caches, and convert block sizes and offsets as NHD K/V caches do.

    Args:
        buf: the packed bytes (``uint8`` or the cache dtype), contiguous, same device.
        fmt: how the sender laid out ``buf``.
        num_remote_blocks: blocks in ``buf``.
        layer_caches: the receiver's caches (per-layer list or stacked tensor).
        local_block_ids: destination blocks indexed by ``p // local_block_size``.
        local_layout: layout of ``layer_caches``.
        head_offset: first local head written.
        num_tokens: tokens to write (the rest of the last block is skipped);
            default all ``num_remote_blocks * fmt.block_size - src_token_offset``.
        token_offset: position of the first written token within the local blocks.
        src_token_offset: tokens at the start of the buffer to skip (e.g. a read
            that starts inside the sender's first block).
        impl: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        KernelInputError: a ``fmt`` that does not fit the caches (split K/V planes
            into any other kind, or back), bad ranges, ids or buffer, or a
            conversion or partial block asked of fused K/V caches.
    """
    caches = split_layers(layer_caches, local_layout, "caches")
    checks.check_format(fmt, caches, head_offset)
    if num_remote_blocks < 0:
        raise KernelInputError(f"num_remote_blocks must be >= 0, got {num_remote_blocks}")
    if not 0 <= src_token_offset <= num_remote_blocks * fmt.block_size:
        raise KernelInputError(
            f"src_token_offset {src_token_offset} outside [0, "
            f"{num_remote_blocks * fmt.block_size}] for {num_remote_blocks} remote blocks of "
            f"{fmt.block_size} tokens"
        )
    max_tokens = num_remote_blocks * fmt.block_size - src_token_offset
    if num_tokens is None:
        num_tokens = max_tokens
    if not 0 <= num_tokens <= max_tokens:
        raise KernelInputError(
            f"num_tokens {num_tokens} outside [0, {max_tokens}] for {num_remote_blocks} "
            f"remote blocks of {fmt.block_size} tokens from src_token_offset "
            f"{src_token_offset}"
        )
    if token_offset < 0:
        raise KernelInputError(f"token_offset must be >= 0, got {token_offset}")
    checks.check_fused(fmt, caches, num_tokens, token_offset, src_token_offset)
    ids = checks.as_block_ids(local_block_ids, caches.num_blocks, "local_block_ids")
    first_block = token_offset // caches.block_size
    end_block = -(-(token_offset + num_tokens) // caches.block_size)
    if num_tokens and ids.numel() < end_block:
        raise KernelInputError(
            f"{num_tokens} tokens at token_offset {token_offset} need {end_block} local block "
            f"ids of {caches.block_size} tokens, got {ids.numel()}"
        )
    if num_tokens:
        checks.check_unique(ids[first_block:end_block], "local_block_ids")
    buf_bytes = checks.received_bytes(buf, caches, fmt.nbytes(num_remote_blocks))
    use_triton = checks.use_triton(impl, caches.device)
    if num_tokens == 0:
        return
    buf_elems = checks.as_elements(buf_bytes, caches.elem_nbytes, "buf")
    words, (buf_words,) = widen(caches, [buf_elems])
    if use_triton:
        from kvbridge.kernels import triton_kernels

        device_ids = checks.to_device(ids, caches.device)
        triton_kernels.unpack(
            buf_words, fmt, num_remote_blocks, words, device_ids, head_offset, num_tokens,
            token_offset, src_token_offset,
        )
    else:
        torch_cpu.unpack(
            buf_words, fmt, num_remote_blocks, words, ids, head_offset, num_tokens,
            token_offset, src_token_offset,
        )


def copy_blocks(
    src_layer_caches: LayerCaches,
    dst_layer_caches: LayerCaches,
    block_ids: BlockIds,
    dst_block_ids: BlockIds | None = None,
    *,
    impl: Impl = "auto",
) -> None:
    """Copy whole blocks, all layers, between two caches of the same shape.

    Typically device -> pinned host mirror or back, for host-staged transfers.

    Args:
        src_layer_caches: source caches (per-layer list or stacked tensor).
        dst_layer_caches: destination caches, same shapes and dtype (any device).
        block_ids: source block ids.
        dst_block_ids: destination block ids (default: ``block_ids``); no repeats.
        impl: ``"auto"`` (Triton when both sides are CUDA), ``"triton"`` or ``"torch"``.

    Raises:
        KernelInputError: shape/dtype mismatch, bad ids, repeated destinations.
    """
    src = split_layers(src_layer_caches, None, "src caches")
    dst = split_layers(dst_layer_caches, None, "dst caches")
    if src.layers[0].shape != dst.layers[0].shape or src.num_layers != dst.num_layers:
        raise KernelInputError(
            f"src caches {src.num_layers} x {tuple(src.layers[0].shape)} and dst caches "
            f"{dst.num_layers} x {tuple(dst.layers[0].shape)} differ"
        )
    if src.dtype != dst.dtype:
        raise KernelInputError(f"src dtype {src.dtype} and dst dtype {dst.dtype} differ")
    src_ids = checks.as_block_ids(block_ids, src.num_blocks, "block_ids")
    dst_ids = checks.as_block_ids(
        block_ids if dst_block_ids is None else dst_block_ids, dst.num_blocks, "dst_block_ids"
    )
    if src_ids.numel() != dst_ids.numel():
        raise KernelInputError(
            f"{src_ids.numel()} source block ids but {dst_ids.numel()} destination block ids"
        )
    checks.check_unique(dst_ids, "dst_block_ids")
    same_device = src.device == dst.device
    device = dst.device if src.device.type == "cpu" else src.device
    use_triton = checks.use_triton(impl, device, allow=same_device or checks.uva_ok(src, dst))
    if src_ids.numel() == 0:
        return
    src, _ = widen(src, [])
    dst, _ = widen(dst, [])
    if src.word_nbytes != dst.word_nbytes:
        src, dst = narrow_to_common_word(src, dst)
    if use_triton:
        from kvbridge.kernels import triton_kernels

        triton_kernels.copy_blocks(
            src, dst, checks.to_device(src_ids, device), checks.to_device(dst_ids, device)
        )
    else:
        torch_cpu.copy_blocks(src, dst, src_ids, dst_ids)


@contextlib.contextmanager
def on_device(tensor: torch.Tensor) -> Iterator[None]:
    """Launch on ``tensor``'s CUDA device inside, and wait for that work on leaving.

    The kernels return once their work is queued; memory another party reads next
    (UCX sending a staging buffer, a reader of a host mirror) or reuses (a staging
    buffer given back to its pool) must wait for it. Any thread may use it (the
    device is set for the block). A no-op for CPU tensors, whose copies are done
    when they return.
    """
    if not tensor.is_cuda:
        yield
        return
    with torch.cuda.device(tensor.device):
        yield
        torch.cuda.current_stream().synchronize()


def _format_of(caches: CacheSet, num_heads: int) -> PackedFormat:
    return PackedFormat(
        layout=caches.layout,
        block_size=caches.block_size,
        num_heads=num_heads,
        head_dim=caches.head_dim,
        elem_nbytes=caches.elem_nbytes,
        num_layers=caches.num_layers,
        is_mla=caches.is_mla,
        fused_kv=caches.fused_kv,
        split_kv=caches.split_kv,
    )
