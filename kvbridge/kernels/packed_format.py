"""How a packed KV buffer is laid out: ``PackedFormat``.

The sender's :func:`kvbridge.kernels.pack` writes, and the receiver's
:func:`kvbridge.kernels.unpack` reads, one contiguous buffer per transfer::

    buffer = [layer 0 .. num_layers-1]
               [kv 0 .. num_kv-1]            (K, V; only one for MLA)
                 [i 0 .. num_blocks-1]       (i-th block id given to pack)
                   [block payload]           (sender's layout, head slice only)

    payload, NHD:  [block_size][num_heads][head_dim]
    payload, HND:  [num_heads][block_size][head_dim]
    payload, MLA:  [block_size][latent_dim]  (num_heads == 1, head_dim == latent_dim)
    fused K/V:     [num_heads][block_size][2 * head_size]  (num_kv == 1, HND, head_dim ==
                   2 * head_size: each head's K^T | V run of a vLLM CPU block, as it is)
    split K/V:     [block_size][num_heads][head_dim]  (num_kv == 1, NHD: each layer entry
                   is one K or V plane of an SGLang cache; converts like NHD)

Pack therefore does no relayout (it is a pure gather); the receiver fixes layout,
block size and head offset in its single unpack pass. The reader builds the
sender's :class:`PackedFormat` from the handshake metadata
(``transfer/reading/strategy.py`` ``prepare``) to size its buffers and unpack.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.kernels.errors import KernelInputError
from kvbridge.topology import KVLayout, planes_per_block

__all__ = ["PackedFormat"]

_ELEM_NBYTES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class PackedFormat:
    """Shape of a packed buffer as the sender laid it out.

    Attributes:
        layout: the SENDER's cache layout (rows of each payload follow it).
        block_size: the sender's tokens per block.
        num_heads: heads in the packed slice (1 for MLA).
        head_dim: elements per head row (``latent_dim`` for MLA).
        elem_nbytes: bytes per element (2 for bf16/fp16, 1 for fp8/uint8, 4 for fp32).
        num_layers: layers in the buffer.
        is_mla: one latent per token instead of K and V.
        fused_kv: one plane of fused K/V rows per layer (vLLM CPU caches; HND,
            ``head_dim`` is the ``2 * head_size`` row). Such buffers land only in
            caches with the same block size, whole blocks at a time.
        split_kv: one plane, K or V alone, per layer entry (SGLang caches; NHD).
            Such buffers land only in split K/V caches (NHD too), with block
            size conversion, partial blocks and head offsets as for NHD K/V.
    """

    layout: KVLayout
    block_size: int
    num_heads: int
    head_dim: int
    elem_nbytes: int
    num_layers: int
    is_mla: bool = False
    fused_kv: bool = False
    split_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_heads", "head_dim", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise KernelInputError(f"PackedFormat.{name} must be a positive int, got {value!r}")
        if self.elem_nbytes not in _ELEM_NBYTES:
            raise KernelInputError(
                f"PackedFormat.elem_nbytes must be one of {_ELEM_NBYTES}, got {self.elem_nbytes!r}"
            )
        if self.is_mla and self.num_heads != 1:
            raise KernelInputError(f"an MLA packed format has num_heads 1, got {self.num_heads}")
        object.__setattr__(self, "layout", KVLayout.parse(self.layout))
        if self.fused_kv and (self.is_mla or self.layout is not KVLayout.HND):
            raise KernelInputError(
                f"a fused K/V packed format is HND and not MLA, got {self.layout}, "
                f"is_mla {self.is_mla}"
            )
        if self.split_kv and (self.is_mla or self.fused_kv or self.layout is not KVLayout.NHD):
            raise KernelInputError(
                f"a split K/V packed format is NHD, not MLA and not fused, got {self.layout}, "
                f"is_mla {self.is_mla}, fused_kv {self.fused_kv}"
            )

    @property
    def num_kv(self) -> int:
        """Tensors per layer in the buffer: 2 (K and V), or 1 for MLA, fused and split K/V."""
        return planes_per_block(self.is_mla, self.fused_kv, self.split_kv)

    @property
    def payload_numel(self) -> int:
        """Elements of one (layer, kv, block) payload."""
        return self.block_size * self.num_heads * self.head_dim

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one (layer, kv, block) payload."""
        return self.payload_numel * self.elem_nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes one block adds to the buffer, over all layers and K/V."""
        return self.num_layers * self.num_kv * self.payload_nbytes

    def nbytes(self, num_blocks: int) -> int:
        """Bytes of a buffer holding ``num_blocks`` blocks.

        Raises:
            KernelInputError: ``num_blocks`` is negative.
        """
        if num_blocks < 0:
            raise KernelInputError(f"num_blocks must be >= 0, got {num_blocks}")
        return num_blocks * self.block_nbytes
