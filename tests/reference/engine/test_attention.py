"""Tests for kvbridge.reference.engine.attention: paged attention equals dense causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbridge.reference.engine.attention import (
    AttentionMetadata,
    SequenceSlice,
    gather_kv,
    kv_cache_shape,
    paged_attention,
    write_kv,
)
from kvbridge.topology import KVLayout

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 16
SCALE = HEAD_DIM**-0.5


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: full-sequence causal SDPA over ``[L, H, D]`` inputs, GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=SCALE
    )
    return out.transpose(0, 1)


def random_seq(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v


def slots_for(block_ids: list[int], positions: range, block_size: int) -> torch.Tensor:
    # slot = block_id * block_size + offset, counted token by token.
    return torch.tensor(
        [block_ids[p // block_size] * block_size + p % block_size for p in positions]
    )


def run_chunks(
    seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    block_rows: list[list[int]],
    chunks: list[list[int]],
    layout: KVLayout,
    block_size: int,
    num_blocks: int = 24,
) -> list[torch.Tensor]:
    """Run every sequence through paged attention in steps; step ``s`` takes
    ``chunks[i][s]`` new tokens of sequence ``i`` (0 = not in this step)."""
    cache = torch.zeros(kv_cache_shape(layout, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM))
    done = [0] * len(seqs)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(len(chunks[0])):
        qs, ks, vs, slots, slices, members = [], [], [], [], [], []
        start = 0
        for i, (q, k, v) in enumerate(seqs):
            n = chunks[i][step]
            if n == 0:
                continue
            new = range(done[i], done[i] + n)
            qs.append(q[new.start : new.stop])
            ks.append(k[new.start : new.stop])
            vs.append(v[new.start : new.stop])
            slots.append(slots_for(block_rows[i], new, block_size))
            slices.append(SequenceSlice(start, n, new.stop, torch.tensor(block_rows[i])))
            members.append(i)
            start += n
            done[i] = new.stop
        meta = AttentionMetadata(torch.cat(slots), slices, block_size, layout)
        out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, SCALE)
        for i, sl in zip(members, slices, strict=True):
            outs[i].append(out[sl.query_start : sl.query_start + sl.num_query_tokens])
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
@pytest.mark.parametrize("block_size", [16, 32])
def test_one_shot_prefill_matches_dense(layout: KVLayout, block_size: int) -> None:
    # Lengths: inside one block, exactly one block, spanning several with a tail.
    lengths = [5, block_size, 2 * block_size + 7]
    seqs = [random_seq(n, seed=n) for n in lengths]
    # Scattered, non-monotonic block ids so a wrong gather cannot pass by accident.
    rows = [[9], [3], [17, 0, 12]]
    outs = run_chunks(seqs, rows, [[n] for n in lengths], layout, block_size)
    for (q, k, v), out in zip(seqs, outs, strict=True):
        torch.testing.assert_close(out, dense_attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_and_decode_match_dense(layout: KVLayout, block_size: int) -> None:
    # Two sequences advancing at different rates in shared steps: chunks that end
    # mid-block, decode steps (1 token), and steps where one sequence is absent.
    a_chunks = [7, block_size, 0, 9, 1, 1]
    b_chunks = [3, 1, 1 + block_size, 0, 1, 1]
    seqs = [random_seq(sum(a_chunks), seed=1), random_seq(sum(b_chunks), seed=2)]
    rows = [[4, 11, 2], [7, 1, 20]]
    outs = run_chunks(seqs, rows, [a_chunks, b_chunks], layout, block_size)
    for (q, k, v), out in zip(seqs, outs, strict=True):
        torch.testing.assert_close(out, dense_attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
def test_nhd_and_hnd_hold_the_same_values(block_size: int) -> None:
    _, k, v = random_seq(block_size + 5, seed=3)
    block_ids = [5, 2]
    slots = slots_for(block_ids, range(k.shape[0]), block_size)
    gathered = []
    for layout in (KVLayout.NHD, KVLayout.HND):
        cache = torch.zeros(kv_cache_shape(layout, 8, block_size, NUM_KV_HEADS, HEAD_DIM))
        write_kv(cache, k, v, slots, block_size, layout)
        # Untouched blocks stay zero.
        assert cache[:, [0, 1, 3, 4, 6, 7]].abs().sum() == 0
        gathered.append(gather_kv(cache, torch.tensor(block_ids), k.shape[0], layout))
        if layout == KVLayout.HND:
            torch.testing.assert_close(cache[0, 5, :, 3], k[3], rtol=0, atol=0)
        else:
            torch.testing.assert_close(cache[1, 2, 4], v[block_size + 4], rtol=0, atol=0)
    for got in gathered:
        assert torch.equal(got[0], k.transpose(0, 1))
        assert torch.equal(got[1], v.transpose(0, 1))
