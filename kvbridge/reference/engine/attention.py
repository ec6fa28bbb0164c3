"""Paged attention over one layer's KV cache tensor (NHD or HND), in plain torch.

The model runner allocates one cache tensor per layer and builds one
:class:`AttentionMetadata` per step; each attention layer of the model calls
:func:`paged_attention`, which

1. writes the step's new keys and values at their slots
   (``slot = block_id * block_size + offset``), then
2. for each sequence gathers its whole context (earlier tokens and the new
   ones) from the cache through its block ids and computes causal attention.

The cache is the only source of context: earlier tokens may have been written
by an earlier step, or by another engine and copied in by the transfer layer.
Correctness over speed: one vectorised pass per sequence, no custom kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbridge.topology import KVLayout


def kv_cache_shape(
    layout: KVLayout, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's cache: ``[2, N, B, H, D]`` (NHD) or ``[2, N, H, B, D]`` (HND)."""
    if KVLayout.parse(layout) == KVLayout.NHD:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)
    return (2, num_blocks, num_kv_heads, block_size, head_dim)


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """Where one sequence's tokens sit in the step and in the cache.

    Step tokens ``[query_start, query_start + num_query_tokens)`` are the
    sequence's positions ``[context_len - num_query_tokens, context_len)``::

        positions   0 1 2 3 4 5 6 7 8 9
                    |-- cached --|-new-|      context_len = 10, 3 new tokens
                                  ^ first new position = 10 - 3 = 7

    Attributes:
        query_start: Index of the sequence's first new token in the step.
        num_query_tokens: New tokens of this sequence in the step (>= 1).
        context_len: Tokens of the sequence after this step (cached + new).
        block_ids: int64 tensor of at least ``ceil(context_len / block_size)``
            block ids, on the cache's device.
    """

    query_start: int
    num_query_tokens: int
    context_len: int
    block_ids: torch.Tensor


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one step, shared by all layers.

    Attributes:
        slot_mapping: int64 ``[num_tokens]`` cache slot of each new token.
        sequences: One slice per sequence, in step order.
        block_size: Tokens per cache block.
        layout: Cache layout.
    """

    slot_mapping: torch.Tensor
    sequences: Sequence[SequenceSlice]
    block_size: int
    layout: KVLayout


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    layout: KVLayout,
) -> None:
    """Store each new token's key and value at its cache slot.

    Args:
        kv_cache: One layer's cache in ``layout``; modified in place.
        key: ``[T, H, D]`` keys of the new tokens.
        value: ``[T, H, D]`` values.
        slot_mapping: int64 ``[T]``, ``block_id * block_size + offset`` per token.
        block_size: Tokens per block.
        layout: Layout of ``kv_cache``.
    """
    if layout == KVLayout.NHD:
        # [2, N, B, H, D] -> [2, N*B, H, D]: a slot is a row index directly.
        flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
        flat[0, slot_mapping] = key
        flat[1, slot_mapping] = value
        return
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # Advanced indices on dims 0 and 2 of [N, H, B, D] select [T, H, D].
    kv_cache[0][block_ids, :, offsets] = key
    kv_cache[1][block_ids, :, offsets] = value


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int, layout: KVLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a sequence's context back from the cache, in position order.

    Args:
        kv_cache: One layer's cache in ``layout``.
        block_ids: int64 block ids of the sequence, at least ``ceil(context_len / B)``.
        context_len: Positions to read.
        layout: Layout of ``kv_cache``.

    Returns:
        Keys and values, each ``[H, context_len, D]`` (copies, not views).
    """
    block_size = kv_cache.shape[2] if layout == KVLayout.NHD else kv_cache.shape[3]
    num_blocks = -(-context_len // block_size)
    blocks = kv_cache.index_select(1, block_ids[:num_blocks])
    if layout == KVLayout.NHD:
        # [2, n, B, H, D] -> [2, H, n*B, D]
        tokens = blocks.flatten(1, 2).transpose(1, 2)
    else:
        # [2, n, H, B, D] -> [2, H, n, B, D] -> [2, H, n*B, D]
        tokens = blocks.transpose(1, 2).flatten(2, 3)
    return tokens[0, :, :context_len], tokens[1, :, :context_len]


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ``n`` new tokens over a context whose last ``n`` positions they are.

    Args:
        query: ``[n, Hq, D]``, query head ``j`` reading KV head ``j // (Hq / Hkv)``.
        key: ``[Hkv, L, D]`` for positions ``0..L-1`` (``L >= n``).
        value: ``[Hkv, L, D]``.
        scale: Score multiplier (``1/sqrt(D)``).

    Returns:
        ``[n, Hq, D]``; query ``i`` (position ``L - n + i``) sees keys ``0..L-n+i``.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, context_len = key.shape[0], key.shape[1]
    group = num_q_heads // num_kv_heads
    # [n, Hkv*G, D] -> [Hkv, G, n, D]; each KV head serves G query heads.
    q = query.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2).unsqueeze(1)) * scale
    first_pos = context_len - num_tokens
    query_pos = torch.arange(first_pos, context_len, device=query.device)
    key_pos = torch.arange(context_len, device=query.device)
    hidden = key_pos[None, :] > query_pos[:, None]  # [n, L], True above the diagonal
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value.float().unsqueeze(1))  # [Hkv, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim).to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the step's K/V into ``kv_cache``, then attend over each sequence's context.

    Args:
        query: ``[T, Hq, D]`` for the step's ``T`` new tokens (after rotary).
        key: ``[T, Hkv, D]`` (after rotary).
        value: ``[T, Hkv, D]``.
        kv_cache: This layer's cache in ``metadata.layout``; modified in place.
        metadata: The step's slots and sequences.
        scale: Score multiplier.

    Returns:
        ``[T, Hq, D]`` attention output.
    """
    write_kv(kv_cache, key, value, metadata.slot_mapping, metadata.block_size, metadata.layout)
    out = torch.empty_like(query)
    for seq in metadata.sequences:
        k, v = gather_kv(kv_cache, seq.block_ids, seq.context_len, metadata.layout)
        rows = slice(seq.query_start, seq.query_start + seq.num_query_tokens)
        out[rows] = causal_attention(query[rows], k, v, scale)
    return out
