"""Input validation shared by the kernel launchers (:mod:`kvbridge.kernels.launch`).

Every function raises :class:`KernelInputError` naming the offending values and
touches no data, so a failed launch leaves caches and buffers as they were.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch

from kvbridge.kernels.caches import CacheSet, int_dtype
from kvbridge.kernels.errors import KernelInputError
from kvbridge.kernels.packed_format import PackedFormat

Impl = Literal["auto", "triton", "torch"]
BlockIds = Sequence[int] | torch.Tensor


def check_heads(caches: CacheSet, head_start: int, head_end: int) -> None:
    """Raise unless ``[head_start, head_end)`` is a non-empty slice of the caches' heads."""
    if not 0 <= head_start < head_end <= caches.num_heads:
        what = "MLA latent (use 0, 1)" if caches.is_mla else f"{caches.num_heads} heads"
        raise KernelInputError(f"head slice [{head_start}, {head_end}) is not within {what}")


def _planes(is_mla: bool, fused_kv: bool, split_kv: bool) -> str:
    if is_mla:
        return "MLA latents"
    if fused_kv:
        return "fused K/V planes (HND)"
    return "split K or V planes (NHD)" if split_kv else "K/V pairs"


def check_split(fmt: PackedFormat, caches: CacheSet) -> None:
    """Raise unless split K/V planes land in split K/V caches, and only those.

    A split plane is NHD on both sides and never relaid out: a ``[1, ...]`` cache
    given as HND is a fused K/V cache, another kind, and is refused here with
    both kinds named rather than as a field mismatch.
    """
    if not (fmt.split_kv or caches.split_kv):
        return
    theirs = _planes(fmt.is_mla, fmt.fused_kv, fmt.split_kv)
    ours = _planes(caches.is_mla, caches.fused_kv, caches.split_kv)
    if theirs != ours:
        raise KernelInputError(
            f"packed {theirs} land only in caches of that kind, not in {ours} "
            f"{tuple(caches.layers[0].shape)}: a [1, ...] cache is a fused K/V plane when "
            f"HND, a split K or V plane when NHD (split planes are NHD on both sides, never "
            f"relaid out)"
        )


def check_format(fmt: PackedFormat, caches: CacheSet, head_offset: int) -> None:
    """Raise unless ``fmt`` can land in ``caches`` at ``head_offset``."""
    if not isinstance(fmt, PackedFormat):
        raise KernelInputError(f"fmt must be a PackedFormat, got {type(fmt).__name__}")
    check_split(fmt, caches)
    mismatches = [
        (name, theirs, ours)
        for name, theirs, ours in (
            ("is_mla", fmt.is_mla, caches.is_mla),
            ("fused_kv", fmt.fused_kv, caches.fused_kv),
            ("num_layers", fmt.num_layers, caches.num_layers),
            ("head_dim", fmt.head_dim, caches.head_dim),
            ("elem_nbytes", fmt.elem_nbytes, caches.elem_nbytes),
        )
        if theirs != ours
    ]
    if mismatches:
        text = ", ".join(
            f"{name} remote {theirs} local {ours}" for name, theirs, ours in mismatches
        )
        raise KernelInputError(f"packed format does not match the local caches: {text}")
    local_bs, remote_bs = caches.block_size, fmt.block_size
    if local_bs % remote_bs and remote_bs % local_bs:
        raise KernelInputError(
            f"remote block size {remote_bs} and local block size {local_bs}: neither divides "
            "the other"
        )
    if head_offset < 0 or head_offset + fmt.num_heads > caches.num_heads:
        raise KernelInputError(
            f"{fmt.num_heads} remote heads at head_offset {head_offset} do not fit in "
            f"{caches.num_heads} local heads"
        )


def check_fused(
    fmt: PackedFormat, caches: CacheSet, num_tokens: int, token_offset: int, src_token_offset: int
) -> None:
    """Raise unless an unpack into fused K/V caches moves whole blocks as they are.

    A fused block keeps K transposed (``[head_size, block_size]``), so its rows
    are not tokens: only whole blocks of one block size can be moved exactly
    (layouts are both HND, the only one a fused cache has). Block-size
    conversion and partial blocks are refused, never run. A no-op for other caches.
    """
    if not caches.fused_kv:
        return
    block_size = caches.block_size
    if fmt.block_size != block_size:
        raise KernelInputError(
            f"fused K/V caches (K transposed in each block) are not re-blocked: remote block "
            f"size {fmt.block_size}, local {block_size}"
        )
    partial = {name: value for name, value in (
        ("num_tokens", num_tokens), ("token_offset", token_offset),
        ("src_token_offset", src_token_offset)) if value % block_size}
    if partial:
        text = ", ".join(f"{name} {value}" for name, value in partial.items())
        raise KernelInputError(
            f"fused K/V caches (K transposed in each block) move only whole blocks of "
            f"{block_size} tokens: {text}"
        )


def as_block_ids(ids: BlockIds, num_blocks: int, what: str) -> torch.Tensor:
    """Return ``ids`` as a 1-D int64 tensor on the host, range-checked there.

    The check reads no device memory, so a launch given host ids (a list, or a
    CPU tensor: what the transfer agent passes) waits for nothing; ids given as
    a CUDA tensor are read back first, which waits for the work queued before.
    The launch copies them to its device once, with :func:`to_device`.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise KernelInputError(
                f"{what} must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}"
            )
        tensor = ids.to(device="cpu", dtype=torch.int64)
    else:
        try:
            tensor = torch.tensor(list(ids), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise KernelInputError(f"{what} must be a sequence of ints: {exc}") from None
        if tensor.dim() != 1:
            raise KernelInputError(f"{what} must be a flat sequence of ints, got {ids!r}")
    if tensor.numel():
        low, high = (int(v) for v in torch.aminmax(tensor))  # host memory: no device sync
        if low < 0 or high >= num_blocks:
            raise KernelInputError(
                f"{what} span [{low}, {high}], outside the cache's {num_blocks} blocks"
            )
    return tensor


def to_device(host_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Checked host ids on ``device``: the launch's one host-to-device copy.

    To a CUDA device the copy goes from pinned memory and is queued on the
    current stream without waiting (a copy from pageable memory waits for the
    stream); the kernels queued after it on that stream read the ids once they
    landed. Anything else: the ids as they are (or a plain copy).
    """
    if device.type != "cuda":
        return host_ids.to(device)
    return host_ids.pin_memory().to(device, non_blocking=True)


def check_unique(ids: torch.Tensor, what: str) -> None:
    """Raise if a destination id repeats (parallel writes would race); host ids."""
    if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
        raise KernelInputError(f"{what} repeat a destination block: {ids.tolist()}")


def staging_bytes(
    out: torch.Tensor | None, nbytes: int, device: torch.device, what: str
) -> torch.Tensor:
    """A 1-D uint8 view of ``nbytes`` bytes: a prefix of ``out``, or a new buffer."""
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return byte_prefix(out, nbytes, device, what)


def byte_prefix(t: torch.Tensor, nbytes: int, device: torch.device, what: str) -> torch.Tensor:
    """The first ``nbytes`` of a contiguous tensor on ``device``, as 1-D uint8."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{what} must be a tensor, got {type(t).__name__}")
    if t.device != device:
        raise KernelInputError(f"{what} is on {t.device}, the caches on {device}")
    if not t.is_contiguous():
        raise KernelInputError(f"{what} must be contiguous, got strides {t.stride()}")
    have = t.numel() * t.element_size()
    if have < nbytes:
        raise KernelInputError(f"{what} holds {have} bytes, {nbytes} needed")
    return t.reshape(-1).view(torch.uint8)[:nbytes]


def received_bytes(buf: torch.Tensor, caches: CacheSet, nbytes: int) -> torch.Tensor:
    """``buf`` (uint8 or the cache dtype) as its first ``nbytes`` bytes."""
    if isinstance(buf, torch.Tensor) and buf.dtype not in (torch.uint8, caches.dtype):
        raise KernelInputError(f"buf dtype {buf.dtype} is neither uint8 nor {caches.dtype}")
    return byte_prefix(buf, nbytes, caches.device, "buf")


def as_elements(flat_bytes: torch.Tensor, elem_nbytes: int, what: str) -> torch.Tensor:
    """1-D bytes as integers of ``elem_nbytes`` (raises when misaligned)."""
    try:
        return flat_bytes.view(int_dtype(elem_nbytes))
    except RuntimeError:
        raise KernelInputError(
            f"{what} starts at byte offset {flat_bytes.storage_offset()}, not aligned to "
            f"{elem_nbytes}-byte elements"
        ) from None


def uva_ok(src: CacheSet, dst: CacheSet) -> bool:
    """Triton may copy across host and device when the host side is pinned (UVA)."""
    host = src if src.device.type == "cpu" else dst
    other = dst if host is src else src
    return other.device.type == "cuda" and host.layers[0].is_pinned()


def use_triton(impl: Impl, device: torch.device, allow: bool = True) -> bool:
    """Whether to run Triton; ``allow`` is False when the tensors rule it out."""
    if impl == "torch":
        return False
    if impl == "auto":
        return device.type == "cuda" and allow
    if impl != "triton":
        raise KernelInputError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if not allow:
        raise KernelInputError("impl='triton' needs both caches on one CUDA device or pinned host")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise KernelInputError(
            f"impl='triton' on {device} tensors needs TRITON_INTERPRET=1 (no GPU to run on)"
        )
    return True
