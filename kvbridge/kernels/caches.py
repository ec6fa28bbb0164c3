"""Normalised views of a set of layer caches, shared by both kernel implementations.

``launch`` turns whatever the caller passed (a list of per-layer tensors or one
stacked tensor, NHD, HND or MLA, any element dtype) into a :class:`CacheSet`: one
5-D raw-word view per layer, ``[num_kv, num_blocks, A, B, row_words]``, where
``(A, B)`` is ``(block_size, num_heads)`` for NHD and ``(num_heads, block_size)``
for HND, and a "word" is the widest integer (up to 8 bytes) that divides a head
row. Copying words is bit-exact for every dtype and moves fewer, larger elements.
MLA caches become ``[1, num_blocks, block_size, 1, row_words]`` with layout NHD.

Fused K/V caches (vLLM CPU: ``[num_blocks, num_heads, block_size, 2 * head_size]``
per layer, K transposed inside each block) are passed as single-plane views
``cache[None]`` = ``[1, num_blocks, num_heads, block_size, row]``: a 5-D cache
whose K/V dimension is 1. They are HND, and their "head row" is the whole
``2 * head_size`` row, so they move exactly only as whole blocks (see
``checks.check_fused``)::

    one block, one head:  | K^T: head_size x block_size | V: block_size x head_size |
    as rows:              | row 0 | row 1 | ...  | row block_size-1 |   (2*head_size each)

Split K/V caches (SGLang: K and V of a layer in two tensors, each
``[num_blocks, block_size, num_heads, head_dim]``) are passed as one entry per
plane, each its single-plane view ``plane[None]`` = ``[1, num_blocks, block_size,
num_heads, row]``, NHD. The same 5-D shape as a fused view: the layout tells them
apart (a single plane is fused when HND, split when NHD). A split plane is plain
token-major NHD, so it packs, re-blocks and takes head slices as a K/V pair does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbridge.kernels.errors import KernelInputError
from kvbridge.topology import KVLayout

__all__ = [
    "CacheSet",
    "LayerCaches",
    "int_dtype",
    "narrow_to_common_word",
    "split_layers",
    "widen",
]

LayerCaches = Sequence[torch.Tensor] | torch.Tensor

_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_dtype(nbytes: int) -> torch.dtype:
    """Integer dtype of ``nbytes`` bytes (1, 2, 4 or 8)."""
    try:
        return _INT_DTYPES[nbytes]
    except KeyError:
        raise KernelInputError(f"element size {nbytes} bytes is not 1, 2, 4 or 8") from None


@dataclass(frozen=True, slots=True)
class CacheSet:
    """Per-layer 5-D word views of one cache, plus what they mean.

    Attributes:
        layers: ``[num_kv, num_blocks, A, B, row_words]`` integer views, one per layer.
        layout: order of ``A, B`` (NHD: tokens then heads; HND: heads then tokens).
        is_mla: the caller's tensors were MLA latents.
        dtype: the caller's element dtype.
    """

    layers: tuple[torch.Tensor, ...]
    layout: KVLayout
    is_mla: bool
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def fused_kv(self) -> bool:
        """One plane of fused K/V rows per layer (a ``[1, N, H, B, row]`` view, HND)."""
        return not self.is_mla and self.num_kv == 1 and self.layout is KVLayout.HND

    @property
    def split_kv(self) -> bool:
        """One plane, K or V alone, per layer entry (a ``[1, N, B, H, D]`` view, NHD)."""
        return not self.is_mla and self.num_kv == 1 and self.layout is KVLayout.NHD

    @property
    def num_kv(self) -> int:
        return self.layers[0].shape[0]

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[1]

    @property
    def token_dim(self) -> int:
        """Dimension of the 5-D view that indexes tokens within a block."""
        return 2 if self.layout == KVLayout.NHD else 3

    @property
    def head_dim_index(self) -> int:
        """Dimension of the 5-D view that indexes heads."""
        return 3 if self.layout == KVLayout.NHD else 2

    @property
    def block_size(self) -> int:
        return self.layers[0].shape[self.token_dim]

    @property
    def num_heads(self) -> int:
        return self.layers[0].shape[self.head_dim_index]

    @property
    def elem_nbytes(self) -> int:
        return self.dtype.itemsize

    @property
    def word_nbytes(self) -> int:
        return self.layers[0].element_size()

    @property
    def row_words(self) -> int:
        return self.layers[0].shape[4]

    @property
    def head_dim(self) -> int:
        """Elements per head row in the caller's dtype (``latent_dim`` for MLA)."""
        return self.row_words * self.word_nbytes // self.elem_nbytes

    @property
    def device(self) -> torch.device:
        return self.layers[0].device


def split_layers(
    layer_caches: LayerCaches, layout: KVLayout | str | None, what: str
) -> CacheSet:
    """Validate ``layer_caches`` and view each layer as 5-D raw elements.

    Args:
        layer_caches: per-layer tensors, or one tensor with a leading layer dimension.
            A 5-D tensor whose K/V dimension is 1 is a single-plane view: of a
            fused K/V cache when ``layout`` is HND, of a split K/V cache's K or
            V plane when it is NHD (see the module docstring).
        layout: layout of the non-MLA tensors; None when it does not matter
            (whole-block copies).
        what: name used in error messages (``"caches"``, ``"src caches"``...).

    Raises:
        KernelInputError: empty list, mixed shapes/dtypes/devices, wrong rank,
            ``K/V`` dimension not 1 or 2, or a head row that is not contiguous.
    """
    try:
        layout = None if layout is None else KVLayout.parse(layout)
    except ValueError as exc:
        raise KernelInputError(str(exc)) from None
    if isinstance(layer_caches, torch.Tensor):
        if layer_caches.dim() in (4, 6):
            tensors: tuple[torch.Tensor, ...] = tuple(layer_caches.unbind(0))
        else:
            tensors = (layer_caches,)
    else:
        tensors = tuple(layer_caches)
    if not tensors:
        raise KernelInputError(f"{what}: no layer tensors given")
    first = tensors[0]
    for index, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{what}[{index}] is {type(t).__name__}, not a tensor")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise KernelInputError(
                f"{what}[{index}] is {tuple(t.shape)} {t.dtype} on {t.device}, but layer 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
    if first.dim() not in (3, 5):
        raise KernelInputError(
            f"{what}: layer tensors must be 5-D (NHD/HND, or [1, ...] for a split K or V "
            f"plane or a fused K/V cache: pass cache[None]) or 3-D (MLA), got shape "
            f"{tuple(first.shape)}"
        )
    if first.dim() == 5 and first.shape[0] not in (1, 2):
        raise KernelInputError(
            f"{what}: dim 0 of a K/V cache must be 2, got {first.shape[0]} (1: the "
            f"single-plane view of a fused K/V cache or of a split K or V plane)"
        )
    single_plane = first.dim() == 5 and first.shape[0] == 1
    if first.dtype.is_complex or first.element_size() not in _INT_DTYPES:
        raise KernelInputError(f"{what}: unsupported dtype {first.dtype}")
    is_mla = first.dim() == 3
    views = []
    for index, t in enumerate(tensors):
        if t.numel() > 0 and t.stride(-1) != 1:
            raise KernelInputError(
                f"{what}[{index}]: the last dimension must be contiguous (stride 1), "
                f"got strides {t.stride()}"
            )
        raw = t.view(int_dtype(t.element_size()))
        views.append(raw[None, :, :, None, :] if is_mla else raw)
    if is_mla:
        layout = KVLayout.NHD
    elif layout is None:  # whole-block copies: either order will do
        layout = KVLayout.HND if single_plane else KVLayout.NHD
    return CacheSet(layers=tuple(views), layout=layout, is_mla=is_mla, dtype=first.dtype)


def widen(caches: CacheSet, flat: Sequence[torch.Tensor]) -> tuple[CacheSet, list[torch.Tensor]]:
    """Re-view ``caches`` and the 1-D ``flat`` buffers as the widest common word.

    A word size works when it divides the head row and every view can take it
    (strides and storage offsets divisible). Falls back to the element size.

    Returns:
        The widened cache set and the flat buffers viewed as the same words.
    """
    row_nbytes = caches.row_words * caches.word_nbytes
    for word_nbytes in (8, 4, 2):
        if word_nbytes <= caches.word_nbytes or row_nbytes % word_nbytes:
            continue
        dtype = _INT_DTYPES[word_nbytes]
        try:
            layers = tuple(t.view(dtype) for t in caches.layers)
            bufs = [b.view(dtype) for b in flat]
        except RuntimeError:
            continue
        return CacheSet(layers, caches.layout, caches.is_mla, caches.dtype), bufs
    return caches, list(flat)


def narrow_to_common_word(a: CacheSet, b: CacheSet) -> tuple[CacheSet, CacheSet]:
    """Re-view two widened cache sets as the narrower of their two word sizes."""
    dtype = int_dtype(min(a.word_nbytes, b.word_nbytes))

    def narrow(c: CacheSet) -> CacheSet:
        return CacheSet(tuple(t.view(dtype) for t in c.layers), c.layout, c.is_mla, c.dtype)

    return narrow(a), narrow(b)
