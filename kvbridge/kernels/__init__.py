"""Data movement for KV transfers: pack, unpack (with relayout), block copies.

Called by the transfer agent (``kvbridge.transfer``): the sender packs the blocks a
reader asks for into one staging buffer, the receiver unpacks a received buffer
into its own cache, fixing layout, block size and head offset in the same pass.
``copy_blocks`` moves blocks between a device cache and a host mirror.

Caches are given per layer (``Sequence[torch.Tensor]``, one tensor per layer) or
as one stacked tensor with a leading layer dimension::

    NHD  [2, num_blocks, block_size, num_heads, head_dim]
    HND  [2, num_blocks, num_heads, block_size, head_dim]
    MLA  [num_blocks, block_size, latent_dim]       (heads: use 0..1)
    fused K/V (vLLM CPU) as cache[None]:
         [1, num_blocks, num_heads, block_size, 2 * head_size]   (HND; whole blocks of
                                                   one block size only, see caches.py)
    split K/V (SGLang), one entry per K or V plane, as plane[None]:
         [1, num_blocks, block_size, num_heads, head_dim]   (NHD; converts like NHD)

Data is copied as raw elements (fp32, fp16, bf16, fp8, uint8 are all bit-exact).
CUDA tensors run the Triton kernels, CPU tensors a single-pass torch path;
``impl="triton"`` forces Triton (on CPU only under ``TRITON_INTERPRET=1``).
Bad input raises :class:`KernelInputError` (a ``ValueError``) before any write.

Example (sender has block size 16 in HND, receiver block size 32 in NHD and
twice the heads, so this sender's 4 heads land at head offset 4)::

    from kvbridge.kernels import PackedFormat, copy_blocks, pack, unpack, packed_format
    from kvbridge.topology import KVLayout

    # sender: caches = [layer0, layer1, ...], each [2, nb, 4, 16, 128] (HND)
    fmt = packed_format(p_caches, KVLayout.HND, head_start=0, head_end=4)
    buf = pack(p_caches, [7, 3, 9], 0, 4, KVLayout.HND, out=staging)  # 1-D uint8
    assert buf.numel() == fmt.nbytes(3)

    # receiver: caches [2, nb, 32, 8, 128] (NHD); 3 remote blocks = 48 tokens,
    # of which the last block holds 5 valid tokens -> 37 tokens into 2 local blocks
    unpack(buf, fmt, 3, d_caches, [12, 4], KVLayout.NHD, head_offset=4, num_tokens=37)

    # host staging: device cache -> pinned host mirror, same block ids
    copy_blocks(gpu_caches, host_caches, [12, 4])

``PackedFormat(layout, block_size, num_heads, head_dim, elem_nbytes, num_layers, is_mla)``
may also be built by hand from handshake metadata. The packed layout is documented
in :mod:`kvbridge.kernels.packed_format`.
"""

from __future__ import annotations

from kvbridge.kernels.errors import KernelInputError
from kvbridge.kernels.launch import Impl, copy_blocks, on_device, pack, packed_format, unpack
from kvbridge.kernels.packed_format import PackedFormat

__all__ = [
    "Impl",
    "KernelInputError",
    "PackedFormat",
    "copy_blocks",
    "on_device",
    "pack",
    "unpack",
    "packed_format",
]
