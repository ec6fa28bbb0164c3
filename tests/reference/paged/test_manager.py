"""KVCacheManager end to end: hits, allocation, freeing, groups, stats, bad input.

Also covers the ``Request`` and the prefix-cache stats types the manager uses.
"""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import ConfigError, IntegrityError
from kvbridge.reference.paged.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.reference.paged.hashing import BlockHasher, MultiModalSpan, RequestHashExtras
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvbridge.reference.paged.manager import (
    AllocationError,
    CacheTooSmallError,
    KVCacheBlocks,
    KVCacheManager,
    RequestTooLongError,
)
from kvbridge.reference.paged.request import Request
from kvbridge.reference.paged.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvbridge.reference.paged.stats import PrefixCacheHitWindow, PrefixCacheStats

BS = 4
DT = torch.float16


def config(*specs: KVCacheSpec, num_blocks: int = 64) -> KVCacheConfig:
    groups = tuple(KVCacheGroupSpec((f"layer{i}",), spec) for i, spec in enumerate(specs))
    return KVCacheConfig(num_blocks, (), groups)


def full(block_size: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 2, 8, DT)


def window(size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(BS, 2, 8, DT, sliding_window=size)


HASHER = BlockHasher("sha256", b"test-seed", BS)


def manager(*specs: KVCacheSpec, num_blocks: int = 64, max_model_len: int = 256,
            **kwargs: object) -> KVCacheManager:
    m = KVCacheManager(config(*(specs or (full(),)), num_blocks=num_blocks), max_model_len,
                       HASHER, **kwargs)  # type: ignore[arg-type]
    return m


def req(request_id: str, tokens: list[int], **kwargs: object) -> Request:
    return Request(request_id, tokens, HASHER, **kwargs)  # type: ignore[arg-type]


def prefill(m: KVCacheManager, r: Request) -> int:
    """Look up, allocate and 'run' a request's prompt like a scheduler; return hit tokens."""
    hits, num_hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - num_hit, num_hit, hits) is not None
    r.num_computed_tokens = r.num_tokens
    m.check_integrity()
    return num_hit


def decode(m: KVCacheManager, r: Request, token: int = 1) -> KVCacheBlocks | None:
    """Sample one token, then schedule it, like one decode step."""
    r.append_output_token_ids(token)
    out = m.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
    if out is not None:
        r.num_computed_tokens = r.num_tokens
    m.check_integrity()
    return out


def snapshot(m: KVCacheManager, *request_ids: str) -> tuple[object, ...]:
    return (m.num_free_blocks, [m.get_block_ids(rid) for rid in request_ids])


# ------------------------------------------------------------------- request


def test_request_validates_and_hashes_appended_blocks() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Request("r", [], HASHER)
    with pytest.raises(ValueError, match="-3"):
        Request("r", [1, -3], HASHER)
    with pytest.raises(ValueError, match="beyond"):
        Request("r", [1, 2], HASHER,
                hash_extras=RequestHashExtras(mm_features=(MultiModalSpan("img", 1, 5),)))
    r = req("r", list(range(BS + 1)))
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(range(BS - 2))
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(7)
    assert len(r.block_hashes) == 2
    assert r.num_output_tokens == BS - 1 and r.num_tokens == 2 * BS
    # The same tokens hashed in one go give the same chain.
    again = req("q", list(r.all_token_ids))
    assert list(again.block_hashes) == list(r.block_hashes)
    # Extras change the hashes; no hasher keeps none.
    salted = req("s", list(r.all_token_ids), hash_extras=RequestHashExtras(cache_salt="t"))
    assert salted.block_hashes[0] != r.block_hashes[0]
    assert Request("n", list(range(3 * BS))).block_hashes == []


# --------------------------------------------------------------- prefix hits


def test_prompt_shorter_than_a_block() -> None:
    m = manager()
    a = req("a", [1, 2, 3])
    assert prefill(m, a) == 0
    assert [len(ids) for ids in m.get_block_ids("a")] == [1]
    b = req("b", [1, 2, 3])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 0 and hits.is_empty()  # partial block never cached


@pytest.mark.parametrize("prompt_len", [BS, 2 * BS, 2 * BS + 1, 3 * BS - 1, 3 * BS])
def test_full_prefix_hit_recomputes_last_token(prompt_len: int) -> None:
    m = manager()
    prompt = list(range(100, 100 + prompt_len))
    prefill(m, req("a", prompt))
    b = req("b", prompt)
    hits, num_hit = m.get_computed_blocks(b)
    # Every full block is cached, but the last token must run: whole blocks
    # strictly below prompt_len.
    assert num_hit == (prompt_len - 1) // BS * BS
    assert hits.get_block_ids()[0] == m.get_block_ids("a")[0][: num_hit // BS]
    assert m.allocate_slots(b, prompt_len - num_hit, num_hit, hits) is not None
    m.check_integrity()


def test_partial_hit_shares_only_matching_blocks() -> None:
    m = manager()
    prefill(m, req("a", list(range(3 * BS))))
    b = req("b", list(range(BS + 1)) + [999] * (2 * BS))
    assert prefill(m, b) == BS
    ids_a, ids_b = m.get_block_ids("a")[0], m.get_block_ids("b")[0]
    assert ids_b[0] == ids_a[0]
    assert not set(ids_b[1:]) & set(ids_a)


def test_skip_prefix_cache_and_disabled_caching() -> None:
    m = manager()
    prefill(m, req("a", list(range(3 * BS))))
    assert m.get_computed_blocks(req("b", list(range(3 * BS)), skip_prefix_cache=True))[1] == 0
    off = manager(enable_caching=False)
    prefill(off, req("a", list(range(3 * BS))))
    assert off.get_computed_blocks(req("b", list(range(3 * BS))))[1] == 0


def test_evicting_cached_copy_leaves_held_duplicate_findable() -> None:
    # a and b compute the same prompt independently (b skips the cache), so
    # each hash has two cached blocks. Freeing a and evicting its copies
    # through allocation pressure must leave b's copies as hits.
    m = manager(num_blocks=9)  # 8 usable
    prompt = list(range(3 * BS))
    a, b = req("a", prompt), req("b", prompt, skip_prefix_cache=True)
    prefill(m, a)
    prefill(m, b)
    ids_a, ids_b = m.get_block_ids("a")[0], m.get_block_ids("b")[0]
    assert not set(ids_a) & set(ids_b)
    m.free(a)
    # 2 never-used blocks, then a's three blocks, tail first.
    filler = req("filler", [7] * (5 * BS))
    prefill(m, filler)
    assert set(m.get_block_ids("filler")[0][2:]) == set(ids_a)
    c = req("c", prompt)
    hits, num_hit = m.get_computed_blocks(c)
    assert num_hit == 2 * BS
    assert hits.get_block_ids()[0] == ids_b[:2]
    assert m.allocate_slots(c, c.num_tokens - num_hit, num_hit, hits) is None  # cache full
    m.free(filler)
    assert m.allocate_slots(c, c.num_tokens - num_hit, num_hit, hits) is not None
    m.check_integrity()
    assert m.get_num_common_prefix_blocks("c", 2) == [2]


def test_free_order_evicts_tail_first() -> None:
    m = manager(num_blocks=5)  # 4 usable
    a = req("a", list(range(4 * BS)))
    prefill(m, a)
    ids_a = m.get_block_ids("a")[0]
    m.free(a)
    m.free("a")  # unknown: no-op
    assert m.num_free_blocks == 4
    # A new request gets the tail of a first; a's leading block survives longest.
    b = req("b", [5] * (2 * BS))
    prefill(m, b)
    assert m.get_block_ids("b")[0] == ids_a[::-1][:2]
    c = req("c", list(range(4 * BS)))
    assert m.get_computed_blocks(c)[1] == 2 * BS


def test_lookahead_slots_are_allocated_but_not_cached() -> None:
    m = manager(max_model_len=64, enable_kv_cache_events=True)
    a = req("a", list(range(2 * BS + 1)))
    out = m.allocate_slots(a, a.num_tokens, num_lookahead_tokens=2 * BS)
    assert out is not None
    assert len(out.get_block_ids()[0]) == -(-(a.num_tokens + 2 * BS) // BS)
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_ids) for e in stored) == a.num_tokens // BS
    # Lookahead is clipped at max_model_len.
    b = req("b", list(range(60)))
    out = m.allocate_slots(b, 60, num_lookahead_tokens=100)
    assert out is not None and len(out.get_block_ids()[0]) == 64 // BS


def test_delay_cache_blocks_then_cache_blocks() -> None:
    m = manager(enable_kv_cache_events=True)
    prompt = list(range(3 * BS))
    d = req("d", prompt)
    # All prompt tokens arrive from a remote prefill; nothing is computed here.
    out = m.allocate_slots(d, 0, num_external_computed_tokens=d.num_tokens,
                           delay_cache_blocks=True)
    assert out is not None and len(out.get_block_ids()[0]) == 3
    assert m.take_events() == []
    assert m.get_computed_blocks(req("x", prompt + [1]))[1] == 0
    # Transfer done: the last token is recomputed, so cache what came before it.
    m.cache_blocks(d, d.num_tokens - 1)
    stored = m.take_events()
    assert [type(e) for e in stored] == [BlockStored]
    assert isinstance(stored[0], BlockStored)
    assert stored[0].block_ids == out.get_block_ids()[0][:2]
    assert stored[0].token_ids == prompt[: 2 * BS]
    assert m.get_computed_blocks(req("y", prompt + [1]))[1] == 2 * BS
    with pytest.raises(AllocationError):
        m.cache_blocks(d, d.num_tokens + 1)
    m.check_integrity()


# -------------------------------------------------------------------- groups


def test_sliding_window_releases_blocks_during_decode() -> None:
    size = 2 * BS
    m = manager(window(size))
    r = req("r", list(range(BS + 1)))
    prefill(m, r)
    for step in range(6 * BS):
        free_before = m.num_free_blocks
        assert decode(m, r, token=step) is not None
        ids = m.get_block_ids("r")[0]
        # Blocks ending before token num_computed - window + 1 (as of the
        # allocation) hold the null block 0.
        num_computed_at_alloc = r.num_computed_tokens - 1
        num_skipped = max(num_computed_at_alloc - size + 1, 0) // BS
        assert ids[:num_skipped] == [0] * num_skipped
        assert 0 not in ids[num_skipped:]
        assert len(ids) == -(-r.num_tokens // BS)
        assert free_before - m.num_free_blocks <= 1
    # Real blocks held stay bounded by the window, not the length.
    assert len([i for i in m.get_block_ids("r")[0] if i]) <= size // BS + 1
    m.free(r)
    assert m.num_free_blocks == m.num_usable_blocks


def test_hybrid_full_and_sliding_window() -> None:
    m = manager(full(), window(BS + 1))  # window needs one block before the hit end
    prompt = list(range(4 * BS))
    a = req("a", prompt)
    prefill(m, a)
    full_a, win_a = m.get_block_ids("a")
    assert len(full_a) == len(win_a) == 4 and not set(full_a) & set(win_a)
    b = req("b", prompt + [9] * BS)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 4 * BS
    full_hit, win_hit = hits.get_block_ids()
    assert full_hit == full_a
    assert win_hit == [0, 0, 0, win_a[3]]
    # Without the window block at the hit end, both groups agree on a shorter hit.
    m.evict_blocks({win_a[3]})
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 3 * BS
    assert hits.get_block_ids() == (full_a[:3], [0, 0, win_a[2]])
    assert m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is not None
    m.check_integrity()
    m.free(a)
    m.free(b)
    m.check_integrity()
    assert m.num_free_blocks == m.num_usable_blocks


def test_chunked_local_attention_group() -> None:
    chunk = 2 * BS
    m = manager(full(), ChunkedLocalAttentionSpec(BS, 2, 8, DT, attention_chunk_size=chunk))
    prompt = list(range(5 * BS))
    a = req("a", prompt)
    prefill(m, a)
    b = req("b", prompt + [3] * 3)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 5 * BS
    full_hit, chunk_hit = hits.get_block_ids()
    # Token 20 is in chunk [16, 24): only block 4 of the chunked group is needed.
    assert chunk_hit == [0, 0, 0, 0, m.get_block_ids("a")[1][4]]
    assert full_hit == m.get_block_ids("a")[0]
    for step in range(3 * BS):
        decode(m, a, token=step)
    chunk_ids = m.get_block_ids("a")[1]
    num_skipped = (a.num_computed_tokens - 1) // chunk * chunk // BS
    assert chunk_ids[:num_skipped] == [0] * num_skipped and 0 not in chunk_ids[num_skipped:]


def test_cross_attention_and_mamba_groups_without_caching() -> None:
    mamba = MambaSpec(BS, shapes=((8,),), dtypes=(DT,))
    m = manager(full(), CrossAttentionSpec(BS, 2, 8, DT), mamba, enable_caching=False)
    r = req("r", list(range(5)), num_encoder_tokens=3 * BS + 1)
    out = m.allocate_slots(r, r.num_tokens)
    assert out is not None and out.num_blocks == (2, 4, 1)
    r.num_computed_tokens = r.num_tokens
    for step in range(2 * BS):
        decode(m, r, token=step)
    assert [len(ids) for ids in m.get_block_ids("r")] == [-(-r.num_tokens // BS), 4, 1]
    with pytest.raises(ConfigError, match="cannot be prefix-cached"):
        manager(full(), CrossAttentionSpec(BS, 2, 8, DT))


def test_dcp_multiplies_block_size() -> None:
    dcp = 2
    hasher = BlockHasher("sha256", b"test-seed", BS * dcp)
    m = KVCacheManager(config(full()), 256, hasher, dcp_world_size=dcp)
    assert m.block_size == BS * dcp
    r = Request("r", list(range(2 * BS * dcp + 1)), hasher)
    out = m.allocate_slots(r, r.num_tokens)
    assert out is not None and len(out.get_block_ids()[0]) == 3
    r.num_computed_tokens = r.num_tokens
    hits, num_hit = m.get_computed_blocks(Request("s", list(r.all_token_ids), hasher))
    assert num_hit == 2 * BS * dcp
    with pytest.raises(ConfigError, match="hasher block_size"):
        KVCacheManager(config(full()), 256, HASHER, dcp_world_size=dcp)
    with pytest.raises(ConfigError, match="one KV cache group"):
        KVCacheManager(config(full(), full()), 256, hasher, dcp_world_size=dcp)


def test_common_prefix_blocks() -> None:
    m = manager(full(), window(BS + 1))
    shared = list(range(2 * BS))
    for i in range(3):
        prefill(m, req(f"r{i}", shared + [50 + i] * BS))
    assert m.get_num_common_prefix_blocks("r0", 3) == [2, 0]
    prefill(m, req("other", [7] * (3 * BS)))
    assert m.get_num_common_prefix_blocks("r0", 4) == [0, 0]
    assert m.get_num_common_prefix_blocks("missing", 4) == [0, 0]
    with pytest.raises(ValueError):
        m.get_num_common_prefix_blocks("r0", 0)


# ---------------------------------------------------------- stats and reset


def test_prefix_cache_stats_and_hit_window() -> None:
    m = manager(log_stats=True)
    prompt = list(range(3 * BS))
    prefill(m, req("a", prompt))
    prefill(m, req("b", prompt))
    stats = m.make_prefix_cache_stats()
    assert stats == PrefixCacheStats(requests=2, queries=2 * len(prompt), hits=2 * BS)
    empty = m.make_prefix_cache_stats()
    assert empty is not None and empty.requests == 0
    assert manager().make_prefix_cache_stats() is None

    window_ = PrefixCacheHitWindow(max_recent_requests=3)
    window_.observe(stats)
    window_.observe(PrefixCacheStats(requests=2, queries=10, hits=10))
    # 4 requests > 3: the oldest record (hit rate 1/3) is dropped.
    assert window_.num_requests == 2 and window_.hit_rate == 1.0
    window_.observe(PrefixCacheStats(requests=1, queries=10, hits=0))
    assert window_.num_requests == 3 and window_.hit_rate == pytest.approx(0.5)
    window_.observe(PrefixCacheStats(reset=True))
    assert window_.num_requests == 0 and window_.hit_rate == 0.0
    with pytest.raises(ValueError):
        PrefixCacheHitWindow(0)
    with pytest.raises(ValueError):
        PrefixCacheStats().record(4, 5)


def test_reset_prefix_cache_refuses_while_blocks_in_use() -> None:
    m = manager(log_stats=True, enable_kv_cache_events=True)
    prompt = list(range(3 * BS))
    a = req("a", prompt)
    prefill(m, a)
    m.take_events()
    assert not m.reset_prefix_cache()
    assert m.get_computed_blocks(req("b", prompt))[1] == 2 * BS
    assert m.take_events() == []
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]
    assert m.get_computed_blocks(req("c", prompt))[1] == 0
    stats = m.make_prefix_cache_stats()
    assert stats is not None and stats.reset
    m.check_integrity()


def test_eviction_emits_removed_events() -> None:
    m = manager(num_blocks=3, enable_kv_cache_events=True)  # 2 usable
    a = req("a", list(range(2 * BS)))
    prefill(m, a)
    m.free(a)
    m.take_events()
    prefill(m, req("b", [9] * (2 * BS)))
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(e.block_id for e in removed) == sorted(m.get_block_ids("b")[0])


# ----------------------------------------------------------------- bad input


def test_invalid_allocations_raise_and_change_nothing() -> None:
    m = manager(num_blocks=9, max_model_len=40)
    a = req("a", list(range(2 * BS)))
    prefill(m, a)
    before = snapshot(m, "a")
    with pytest.raises(AllocationError, match="-1"):
        m.allocate_slots(a, -1)
    with pytest.raises(AllocationError, match="nothing to allocate"):
        m.allocate_slots(a, 0)
    with pytest.raises(RequestTooLongError, match="40"):
        m.allocate_slots(a, 40 - a.num_computed_tokens + 1)
    big = req("big", list(range(36)))
    with pytest.raises(CacheTooSmallError, match="needs 9 blocks"):
        m.allocate_slots(big, 36)
    hits, num_hit = m.get_computed_blocks(req("c", list(range(3 * BS))))
    with pytest.raises(AllocationError, match="already holds"):
        m.allocate_slots(a, 1, num_hit, hits)
    with pytest.raises(AllocationError, match="do not match"):
        m.allocate_slots(req("c", list(range(3 * BS))), 4, num_hit + BS, hits)
    with pytest.raises(AllocationError, match="no new_computed_blocks"):
        m.allocate_slots(req("c", list(range(3 * BS))), 4, BS)
    other = BlockHasher("blake2b", b"test-seed", BS)
    with pytest.raises(ConfigError, match="hashed by"):
        m.allocate_slots(Request("z", [1, 2], other), 2)
    assert snapshot(m, "a") == before
    assert not m.get_block_ids("big")[0] and not m.get_block_ids("c")[0]
    m.check_integrity()


def test_not_enough_free_blocks_returns_none_unchanged() -> None:
    m = manager(window(BS + 1), num_blocks=7)  # 6 usable
    a = req("a", list(range(4 * BS)))
    prefill(m, a)
    b = req("b", [3] * (2 * BS + 1))
    before = snapshot(m, "a", "b")
    # b needs 3 blocks, 2 are free. a's window blocks 0-2 could be released
    # but only at a's next allocation: b's failure must not touch a.
    assert m.allocate_slots(b, b.num_tokens) is None
    assert snapshot(m, "a", "b") == before
    m.check_integrity()
    # a's own allocation counts the blocks its window releases.
    assert decode(m, a) is not None
    assert m.get_block_ids("a")[0][:3] == [0, 0, 0]
    assert m.allocate_slots(b, b.num_tokens) is not None
    m.check_integrity()


def test_kv_cache_blocks_add_and_ids() -> None:
    m = manager(full(), window(BS + 1))
    r = req("r", list(range(2 * BS)))
    out = m.allocate_slots(r, r.num_tokens)
    assert out is not None
    both = m.empty_blocks() + out
    assert both.get_block_ids() == m.get_block_ids("r") == out.get_block_ids()
    assert m.empty_blocks().is_empty() and not out.is_empty()
    with pytest.raises(ValueError):
        _ = out + KVCacheBlocks(((),))


def test_check_integrity_catches_ref_count_drift() -> None:
    m = manager()
    r = req("r", list(range(2 * BS)))
    prefill(m, r)
    block = m.get_blocks("r").blocks[0][0]
    m._pool.touch([[block]])  # a reference no request list accounts for
    with pytest.raises(IntegrityError, match="ref_cnt differs"):
        m.check_integrity()
    m._pool.free_blocks([block])
    m.check_integrity()
