"""Per-kind block managers driven directly over a real block pool."""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.reference.paged.block_pool import BlockPool
from kvbridge.reference.paged.coordinator import make_single_type_manager
from kvbridge.reference.paged.free_queue import KVCacheBlock
from kvbridge.reference.paged.hashing import BlockHasher
from kvbridge.reference.paged.kv_cache_config import UniformTypeSpecs
from kvbridge.reference.paged.request import Request
from kvbridge.reference.paged.single_type import (
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeManager,
)
from kvbridge.reference.paged.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvbridge.reference.paged.windowed import ChunkedLocalAttentionManager, SlidingWindowManager

BS = 4
DT = torch.float16


def full_spec(block_size: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 2, 8, DT)


def window_spec(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(BS, 2, 8, DT, sliding_window=window)


def chunk_spec(chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(BS, 2, 8, DT, attention_chunk_size=chunk)


def make(spec: KVCacheSpec, num_blocks: int = 32) -> tuple[SingleTypeManager, BlockPool]:
    pool = BlockPool(num_blocks, enable_caching=True)
    return make_single_type_manager(spec, pool, group_id=0), pool


def run_request(mgr: SingleTypeManager, request: Request) -> list[KVCacheBlock]:
    """Allocate and cache a request's whole prompt, as one prefill step would."""
    mgr.save_new_computed_blocks(request.request_id, [])
    mgr.allocate_new_blocks(request.request_id, request.num_tokens)
    mgr.cache_blocks(request, request.num_tokens)
    return list(mgr.get_blocks(request.request_id))


def hasher() -> BlockHasher:
    return BlockHasher("sha256", b"seed", BS)


def test_dispatch_by_kind() -> None:
    pool = BlockPool(8, enable_caching=False)
    mla = MLAAttentionSpec(BS, 1, 16, DT)
    recorded_window = FullAttentionSpec(BS, 2, 8, DT, sliding_window=16)
    mamba = MambaSpec(BS, shapes=((2, 3),), dtypes=(DT,), num_speculative_blocks=2)
    uniform = UniformTypeSpecs(BS, layer_specs=(("a", window_spec(8)),
                                                ("b", SlidingWindowSpec(BS, 4, 8, DT, 8))))
    cases: list[tuple[KVCacheSpec, type[SingleTypeManager]]] = [
        (full_spec(), FullAttentionManager), (mla, FullAttentionManager),
        (recorded_window, FullAttentionManager), (window_spec(8), SlidingWindowManager),
        (chunk_spec(8), ChunkedLocalAttentionManager), (uniform, SlidingWindowManager),
        (CrossAttentionSpec(BS, 2, 8, DT), CrossAttentionManager), (mamba, MambaManager),
    ]
    for spec, cls in cases:
        assert type(make_single_type_manager(spec, pool, 0)) is cls, spec
    assert isinstance(m := make_single_type_manager(mamba, pool, 0), MambaManager)
    assert m.num_state_blocks == 3
    with pytest.raises(ConfigError, match="EncoderOnlyAttentionSpec"):
        make_single_type_manager(EncoderOnlyAttentionSpec(BS, 2, 8, DT), pool, 0)


def test_dcp_scales_block_size() -> None:
    pool = BlockPool(8, enable_caching=False)
    assert make_single_type_manager(full_spec(), pool, 0, dcp_world_size=4).block_size == 4 * BS


def test_full_attention_hit_is_left_to_right_prefix() -> None:
    mgr, pool = make(full_spec())
    a = Request("a", list(range(5 * BS)), hasher())
    blocks_a = run_request(mgr, a)
    # Same first two blocks, then a different third block.
    b = Request("b", list(range(2 * BS)) + [999] * (3 * BS), hasher())
    hits = mgr.find_longest_cache_hit(b.block_hashes, b.num_tokens, [0])
    assert hits == (blocks_a[:2],)
    # The bound cuts the hit to whole blocks below it.
    hits = mgr.find_longest_cache_hit(a.block_hashes, 3 * BS - 1, [0])
    assert hits == (blocks_a[:2],)
    # A missing middle block ends the hit even if later blocks are cached.
    pool.evict_blocks({blocks_a[1].block_id})
    assert mgr.find_longest_cache_hit(a.block_hashes, a.num_tokens, [0]) == (blocks_a[:1],)


def test_free_releases_tail_first() -> None:
    mgr, pool = make(full_spec(), num_blocks=5)
    a = Request("a", list(range(4 * BS)), hasher())
    blocks_a = run_request(mgr, a)
    assert pool.get_num_free_blocks() == 0
    mgr.free("a")
    mgr.free("a")  # unknown now: no-op
    assert pool.get_num_free_blocks() == 4
    reused = pool.get_new_blocks(4)
    assert reused == blocks_a[::-1]
    pool.free_blocks(reused)
    pool.check_integrity()


def test_common_prefix_counts_blocks_held_by_all() -> None:
    mgr, pool = make(full_spec())
    prompt = list(range(3 * BS))
    run_request(mgr, Request("a", prompt, hasher()))
    b = Request("b", prompt[: 2 * BS] + [7] * BS, hasher())
    hits = mgr.find_longest_cache_hit(b.block_hashes, b.num_tokens - 1, [0])
    pool.touch(hits)
    mgr.save_new_computed_blocks("b", hits[0])
    mgr.allocate_new_blocks("b", b.num_tokens)
    assert mgr.num_common_prefix_blocks("a", 2) == 2
    assert mgr.num_common_prefix_blocks("b", 2) == 2
    assert mgr.num_common_prefix_blocks("a", 3) == 0
    assert mgr.num_common_prefix_blocks("unknown", 2) == 0


def test_sliding_window_hit_searches_right_to_left() -> None:
    window = 2 * BS + 1  # needs the 2 blocks before the hit end
    mgr, pool = make(window_spec(window))
    a = Request("a", list(range(6 * BS)), hasher())
    blocks_a = run_request(mgr, a)
    null = pool.null_block
    hits = mgr.find_longest_cache_hit(a.block_hashes, a.num_tokens, [0])
    assert hits == ([null] * 4 + blocks_a[4:6],)
    # Remove block 4: the rightmost run of two is now blocks 2, 3.
    pool.evict_blocks({blocks_a[4].block_id})
    hits = mgr.find_longest_cache_hit(a.block_hashes, a.num_tokens, [0])
    assert hits == ([null] * 2 + blocks_a[2:4],)
    # Remove block 2 too: no run of two except the one starting at block 0.
    pool.evict_blocks({blocks_a[2].block_id})
    hits = mgr.find_longest_cache_hit(a.block_hashes, a.num_tokens, [0])
    assert hits == (blocks_a[:2],)
    pool.evict_blocks({blocks_a[0].block_id})
    assert mgr.find_longest_cache_hit(a.block_hashes, a.num_tokens, [0]) == ([],)


def test_sliding_window_remove_skipped_blocks() -> None:
    window = 2 * BS
    mgr, pool = make(window_spec(window))
    a = Request("a", list(range(6 * BS)), hasher())
    blocks_a = run_request(mgr, a)
    free_before = pool.get_num_free_blocks()
    for num_computed in range(a.num_tokens + 1):
        expected_skipped = max(num_computed - window + 1, 0) // BS
        assert mgr.num_freed_by_skip("a", num_computed) >= 0
        mgr.remove_skipped_blocks("a", num_computed)
        held = mgr.get_blocks("a")
        assert [b.is_null for b in held] == [i < expected_skipped for i in range(6)]
        assert held[expected_skipped:] == blocks_a[expected_skipped:]
        assert pool.get_num_free_blocks() == free_before + expected_skipped
        assert mgr.check_integrity() == []
        pool.check_integrity()


def test_sliding_window_freed_by_skip_counts_shared_blocks_once() -> None:
    mgr, pool = make(window_spec(BS + 1))
    a = Request("a", list(range(4 * BS)), hasher())
    blocks_a = run_request(mgr, a)
    pool.touch([blocks_a[:1]])  # someone else holds block 0 too
    # At 16 computed tokens token 16 reads 12..16: blocks 0-2 are skipped, but
    # block 0 stays held by the other holder.
    assert mgr.num_freed_by_skip("a", 4 * BS) == 2
    assert mgr.num_held_blocks("a", 4 * BS) == 1
    free_before = pool.get_num_free_blocks()
    mgr.remove_skipped_blocks("a", 4 * BS)
    assert pool.get_num_free_blocks() == free_before + 2
    pool.free_blocks(blocks_a[:1])


def test_chunked_local_hit_and_skip() -> None:
    chunk = 2 * BS
    mgr, pool = make(chunk_spec(chunk))
    a = Request("a", list(range(5 * BS)), hasher())
    blocks_a = run_request(mgr, a)
    null = pool.null_block
    # Bound 19: token 19 is in chunk [16, 24): blocks 0-3 are not needed.
    hits = mgr.find_longest_cache_hit(a.block_hashes, 5 * BS - 1, [0])
    assert hits == ([null] * 4,)
    # Bound 20 (a block boundary inside chunk [16, 24)): block 4 must be cached.
    hits = mgr.find_longest_cache_hit(a.block_hashes, 5 * BS, [0])
    assert hits == ([null] * 4 + blocks_a[4:5],)
    mgr.remove_skipped_blocks("a", 3 * BS + 1)  # token 13 is in chunk [8, 16)
    assert [b.is_null for b in mgr.get_blocks("a")] == [True, True, False, False, False]
    assert mgr.check_integrity() == []


def test_cross_attention_sized_by_encoder_tokens_and_not_cached() -> None:
    mgr, pool = make(CrossAttentionSpec(BS, 2, 8, DT))
    assert not mgr.supports_prefix_cache and mgr.uses_encoder_tokens
    new = mgr.allocate_new_blocks("a", 2 * BS + 1)
    assert len(new) == 3
    assert len(mgr.allocate_new_blocks("a", 2 * BS + 1)) == 0
    request = Request("a", list(range(3 * BS)), hasher())
    mgr.cache_blocks(request, request.num_tokens)
    assert all(b.block_hash is None for b in new)


def test_mamba_holds_fixed_state_blocks() -> None:
    spec = MambaSpec(BS, shapes=((4,),), dtypes=(DT,), num_speculative_blocks=1)
    mgr, pool = make(spec)
    assert mgr.num_blocks_to_allocate("a", 1000, []) == 2
    assert len(mgr.allocate_new_blocks("a", 1000)) == 2
    assert len(mgr.allocate_new_blocks("a", 5000)) == 0
    assert mgr.num_blocks_to_allocate("a", 5000, []) == 0
    mgr.free("a")
    assert pool.get_num_free_blocks() == 31


def test_num_blocks_to_allocate_counts_evictable_hits() -> None:
    mgr, pool = make(full_spec())
    a = Request("a", list(range(3 * BS)), hasher())
    blocks_a = run_request(mgr, a)
    mgr.free("a")
    # All three hits sit in the free queue: holding them costs three free blocks,
    # plus one fresh block for tokens 12..13.
    assert mgr.num_blocks_to_allocate("b", 3 * BS + 2, blocks_a) == 4
    pool.touch([blocks_a[:1]])
    assert mgr.num_blocks_to_allocate("b", 3 * BS + 2, blocks_a) == 3
    pool.free_blocks(blocks_a[:1])


def test_integrity_reports_null_in_full_attention_list() -> None:
    mgr, pool = make(full_spec())
    run_request(mgr, Request("a", list(range(2 * BS)), hasher()))
    mgr._req_blocks["a"][0] = pool.null_block  # corrupt on purpose
    assert any("null" in p for p in mgr.check_integrity())
