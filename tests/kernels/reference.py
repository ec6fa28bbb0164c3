"""Plain, obviously-correct reference of pack, unpack and copy_blocks (tests only).

One Python loop iteration per (layer, kv, block) or per token; every copy goes
through same-size integer views so it is bit-exact for any dtype. Nothing here is
fast and nothing here is shared with ``kvbridge.kernels``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbridge.kernels import PackedFormat
from kvbridge.topology import KVLayout

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the integer dtype of the same size (a view, no copy)."""
    return t.view(_INT[t.element_size()])


def as_layers(caches: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """Per-layer tensors from a list or a stacked ``[L, ...]`` tensor."""
    if isinstance(caches, torch.Tensor):
        return list(caches.unbind(0))
    return list(caches)


def _kv_blocks(layer: torch.Tensor) -> list[torch.Tensor]:
    """``[num_blocks, ...]`` tensors, one per K/V (MLA: the latent alone; a split
    K/V cache's ``[1, ...]`` plane: that plane)."""
    return [layer] if layer.dim() == 3 else list(layer.unbind(0))


def _token_heads(block: torch.Tensor, layout: KVLayout, token: int) -> torch.Tensor:
    """``[heads, head_dim]`` of one token of one block (MLA: ``[1, latent]``)."""
    if block.dim() == 2:
        return block[token : token + 1]
    return block[token] if layout == KVLayout.NHD else block[:, token]


def pack(
    caches: Sequence[torch.Tensor] | torch.Tensor,
    block_ids: Sequence[int],
    head_start: int,
    head_end: int,
    layout: KVLayout,
) -> torch.Tensor:
    """Packed bytes: ``[layer][kv][i][payload in the sender's layout, head slice]``."""
    pieces = []
    for layer in as_layers(caches):
        for blocks in _kv_blocks(raw(layer)):
            for block_id in block_ids:
                block = blocks[block_id]
                if block.dim() == 2:
                    payload = block
                elif layout == KVLayout.NHD:
                    payload = block[:, head_start:head_end]
                else:
                    payload = block[head_start:head_end]
                pieces.append(payload.contiguous().reshape(-1).view(torch.uint8))
    if not pieces:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(pieces)


def unpack(
    buf: torch.Tensor,
    fmt: PackedFormat,
    num_remote_blocks: int,
    caches: Sequence[torch.Tensor] | torch.Tensor,
    local_block_ids: Sequence[int],
    local_layout: KVLayout,
    head_offset: int = 0,
    num_tokens: int | None = None,
    token_offset: int = 0,
    src_token_offset: int = 0,
) -> None:
    """Write token by token: buffer token src + k -> block ids[(offset + k) // bs],
    slot (offset + k) % bs."""
    layers = as_layers(caches)
    if num_tokens is None:
        num_tokens = num_remote_blocks * fmt.block_size - src_token_offset
    elem = _INT[fmt.elem_nbytes]
    payload_shape = (
        (fmt.block_size, fmt.head_dim)
        if fmt.is_mla
        else (fmt.block_size, fmt.num_heads, fmt.head_dim)
        if fmt.layout == KVLayout.NHD
        else (fmt.num_heads, fmt.block_size, fmt.head_dim)
    )
    payloads = buf.reshape(-1).view(torch.uint8)[: fmt.nbytes(num_remote_blocks)]
    payloads = payloads.view(elem).view(
        fmt.num_layers, fmt.num_kv, num_remote_blocks, *payload_shape
    )
    local_bs = layers[0].shape[1] if fmt.is_mla else _block_size(layers[0], local_layout)
    for layer_index, layer in enumerate(layers):
        for kv, blocks in enumerate(_kv_blocks(raw(layer))):
            for k in range(num_tokens):
                remote_block, token = divmod(src_token_offset + k, fmt.block_size)
                source = _token_heads(payloads[layer_index, kv, remote_block], fmt.layout, token)
                local_index, slot = divmod(token_offset + k, local_bs)
                target = _token_heads(blocks[local_block_ids[local_index]], local_layout, slot)
                target[head_offset : head_offset + fmt.num_heads].copy_(source)


def copy_blocks(
    src: Sequence[torch.Tensor] | torch.Tensor,
    dst: Sequence[torch.Tensor] | torch.Tensor,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
) -> None:
    """Block by block, layer by layer."""
    for s_layer, d_layer in zip(as_layers(src), as_layers(dst), strict=True):
        for s_blocks, d_blocks in zip(
            _kv_blocks(raw(s_layer)), _kv_blocks(raw(d_layer)), strict=True
        ):
            for s, d in zip(src_ids, dst_ids, strict=True):
                d_blocks[d].copy_(s_blocks[s])


def _block_size(layer: torch.Tensor, layout: KVLayout) -> int:
    return layer.shape[2] if layout == KVLayout.NHD else layer.shape[3]
