"""Tests for kvbridge.reference.paged.block_pool: ref counts, prefix cache, eviction, events."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbridge.errors import ConfigError, IntegrityError
from kvbridge.reference.paged.block_pool import BlockPool, DoubleFreeError, NoFreeBlocksError
from kvbridge.reference.paged.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_events,
    encode_events,
)
from kvbridge.reference.paged.free_queue import KVCacheBlock
from kvbridge.reference.paged.hashing import (
    BlockHasher,
    get_block_hash,
    make_block_hash_with_group_id,
)

HASHER = BlockHasher("sha256", b"test-seed", 4)


def _hashes(*tokens: int) -> list[bytes]:
    return HASHER.hash_request_blocks(list(tokens), 0, [], None)


def _snapshot(pool: BlockPool) -> tuple[object, ...]:
    blocks = [pool.get_block(i) for i in range(pool.num_blocks)]
    return (
        [(b.ref_cnt, b.block_hash) for b in blocks],
        [b.block_id for b in pool._free_queue.get_all_free_blocks()],
        pool.get_num_free_blocks(),
    )


def _free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool._free_queue.get_all_free_blocks()]


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ----------------------------------------------------------------- basics


@pytest.mark.parametrize("num_blocks", [-1, 0, 1])
def test_too_few_blocks(num_blocks: int) -> None:
    with pytest.raises(ConfigError, match=str(num_blocks)):
        BlockPool(num_blocks, enable_caching=True)


def test_null_block_is_reserved() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block is pool.get_block(0)
    assert pool.null_block.is_null
    assert pool.num_blocks == 5
    assert pool.num_usable_blocks == pool.get_num_free_blocks() == 4
    assert _free_ids(pool) == [1, 2, 3, 4]
    assert 0 not in _ids(pool.get_new_blocks(4))
    pool.check_integrity()


@pytest.mark.parametrize("block_id", [-1, 5, 100])
def test_get_block_out_of_range(block_id: int) -> None:
    pool = BlockPool(5, enable_caching=True)
    with pytest.raises(ValueError, match=f"block id {block_id} out of range"):
        pool.get_block(block_id)


def test_get_new_blocks_and_usage() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert _ids(blocks) == [1, 2, 3]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
    assert pool.get_num_free_blocks() == 1
    assert pool.get_usage() == pytest.approx(3 / 4)
    assert pool.get_new_blocks(0) == []
    pool.check_integrity()


def test_get_new_blocks_not_enough_leaves_pool_unchanged() -> None:
    pool = BlockPool(5, enable_caching=True)
    pool.get_new_blocks(2)
    before = _snapshot(pool)
    with pytest.raises(NoFreeBlocksError, match="requested 3 blocks but only 2") as info:
        pool.get_new_blocks(3)
    assert isinstance(info.value, ValueError)
    assert _snapshot(pool) == before
    with pytest.raises(ValueError, match="-2"):
        pool.get_new_blocks(-2)
    assert _snapshot(pool) == before
    pool.check_integrity()


# ------------------------------------------------------------------ cache


def test_cache_and_lookup() -> None:
    pool = BlockPool(8, enable_caching=True)
    hashes = _hashes(*range(10))  # 2 full blocks
    blocks = pool.get_new_blocks(3)
    assert pool.get_cached_block(hashes[0], [0]) is None
    pool.cache_full_blocks(hashes, blocks, 0, 1, 0)
    pool.check_integrity()
    assert pool.get_cached_block(hashes[0], [0]) == [blocks[0]]
    assert pool.get_cached_block(hashes[1], [0]) is None
    pool.cache_full_blocks(hashes, blocks, 1, 2, 0)
    assert pool.get_cached_block(hashes[1], [0]) == [blocks[1]]
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(hashes[0], [1]) is None  # other group
    pool.check_integrity()


def test_lookup_over_groups_needs_every_group() -> None:
    pool = BlockPool(8, enable_caching=True)
    (h,) = _hashes(1, 2, 3, 4)
    g0, g1 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks([h], g0, 0, 1, 0)
    assert pool.get_cached_block(h, [0, 1]) is None
    pool.cache_full_blocks([h], g1, 0, 1, 1)
    assert pool.get_cached_block(h, [0, 1]) == [g0[0], g1[0]]
    assert pool.get_cached_block(h, [1]) == [g1[0]]
    assert g1[0].block_hash == make_block_hash_with_group_id(h, 1)
    pool.check_integrity()


def test_cache_skips_null_and_already_cached_blocks() -> None:
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    hashes = _hashes(*range(12))
    blocks = [pool.null_block, *pool.get_new_blocks(2)]
    pool.cache_full_blocks(hashes, blocks, 0, 2, 0)
    pool.cache_full_blocks(hashes, blocks, 1, 3, 0)  # block 1 again: no-op for it
    assert pool.null_block.block_hash is None
    assert pool.get_cached_block(hashes[0], [0]) is None
    assert pool.get_cached_block(hashes[2], [0]) == [blocks[2]]
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert [e.block_ids for e in stored] == [[blocks[1].block_id], [blocks[2].block_id]]
    pool.check_integrity()


def test_cache_disabled_is_a_no_op() -> None:
    pool = BlockPool(8, enable_caching=False, enable_kv_cache_events=True)
    hashes = _hashes(*range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, blocks, 0, 2, 0)
    assert all(b.block_hash is None for b in blocks)
    assert pool.get_cached_block(hashes[0], [0]) is None
    assert pool.take_events() == []
    pool.check_integrity()


@pytest.mark.parametrize(
    ("num_cached", "num_full", "num_hashes", "match"),
    [
        (2, 1, 3, "num_cached_blocks"),
        (-1, 1, 3, "num_cached_blocks"),
        (0, 4, 4, "len\\(blocks\\) \\(3\\)"),
        (0, 3, 2, "3 > 2 block hashes"),
    ],
)
def test_cache_bad_counts(num_cached: int, num_full: int, num_hashes: int, match: str) -> None:
    pool = BlockPool(8, enable_caching=True)
    hashes = _hashes(*range(16))[:num_hashes]
    blocks = pool.get_new_blocks(3)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=match):
        pool.cache_full_blocks(hashes, blocks, num_cached, num_full, 0)
    assert _snapshot(pool) == before


def test_cache_rejects_free_block_and_rehash_leaving_pool_unchanged() -> None:
    pool = BlockPool(8, enable_caching=True)
    hashes = _hashes(*range(12))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(hashes, blocks, 0, 1, 0)
    before = _snapshot(pool)
    # Block 0 cached under hashes[0]; a second request claims it is hashes[1].
    with pytest.raises(ValueError, match="already cached under another hash"):
        pool.cache_full_blocks(hashes[1:], [blocks[1], blocks[0]], 0, 2, 0)
    assert _snapshot(pool) == before
    pool.free_blocks([blocks[2]])
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=f"block {blocks[2].block_id} is free"):
        pool.cache_full_blocks(hashes, blocks, 1, 3, 0)
    assert _snapshot(pool) == before
    pool.check_integrity()


# --------------------------------------------------------- free and evict


def test_free_reverse_order_evicts_tail_blocks_first() -> None:
    pool = BlockPool(9, enable_caching=True)
    a, b = pool.get_new_blocks(3), pool.get_new_blocks(2)  # a: 1..3, b: 4..5
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    pool.check_integrity()
    assert _free_ids(pool) == [6, 7, 8, 3, 2, 1, 5, 4]
    assert _ids(pool.get_new_blocks(8)) == [6, 7, 8, 3, 2, 1, 5, 4]


def test_freed_cached_blocks_stay_findable_until_reused() -> None:
    pool = BlockPool(5, enable_caching=True, enable_kv_cache_events=True)
    hashes = _hashes(*range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, blocks, 0, 2, 0)
    pool.free_blocks(reversed(blocks))
    pool.take_events()
    assert pool.get_cached_block(hashes[0], [0]) == [blocks[0]]
    assert pool.get_cached_block(hashes[1], [0]) == [blocks[1]]
    # Two uncached blocks are ahead in the queue; the third pop evicts the
    # tail block (hashes[1]) but keeps the head block cached.
    new = pool.get_new_blocks(3)
    assert blocks[1] in new and blocks[0] not in new
    assert blocks[1].block_hash is None and blocks[1].ref_cnt == 1
    assert pool.get_cached_block(hashes[1], [0]) is None
    assert pool.get_cached_block(hashes[0], [0]) == [blocks[0]]
    assert pool.take_events() == [
        BlockRemoved(block_hash=hashes[1], block_id=blocks[1].block_id, group_id=0)
    ]
    pool.check_integrity()


def test_evicting_one_holder_of_a_hash_keeps_the_other() -> None:
    # Requests A and B computed the same first block at the same time (both
    # missed), so two physical blocks hold hash h.
    pool = BlockPool(6, enable_caching=True)
    (h,) = _hashes(9, 9, 9, 9)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks([h], a, 0, 1, 0)
    pool.cache_full_blocks([h], b, 0, 1, 0)
    pool.check_integrity()
    assert pool.get_cached_block(h, [0]) in ([a[0]], [b[0]])
    pool.free_blocks(a)  # B still holds its copy
    pool.get_new_blocks(pool.get_num_free_blocks())  # evicts A's copy
    assert a[0].block_hash is None
    assert pool.get_cached_block(h, [0]) == [b[0]]
    pool.check_integrity()
    pool.evict_blocks({b[0].block_id})
    assert pool.get_cached_block(h, [0]) is None
    pool.check_integrity()


def test_touch_revives_a_cached_free_block() -> None:
    pool = BlockPool(5, enable_caching=True)
    hashes = _hashes(*range(4))
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(hashes, [block], 0, 1, 0)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.block_id in _free_ids(pool)
    hit = pool.get_cached_block(hashes[0], [0])
    assert hit == [block]
    pool.touch([hit])
    assert block.ref_cnt == 1 and block.block_id not in _free_ids(pool)
    assert pool.get_num_free_blocks() == 3
    pool.touch([hit, [pool.null_block]])  # second holder; null block skipped
    assert block.ref_cnt == 2 and pool.null_block.ref_cnt == 0
    pool.check_integrity()
    assert block not in pool.get_new_blocks(3)  # revived block is not handed out
    assert block.block_hash is not None
    pool.free_blocks([block, block])
    assert block.ref_cnt == 0
    pool.check_integrity()


def test_double_free_raises_and_leaves_pool_unchanged() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[1]])
    before = _snapshot(pool)
    with pytest.raises(DoubleFreeError, match=f"block {blocks[1].block_id}") as info:
        pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert isinstance(info.value, ValueError)
    assert info.value.ref_cnt == 0
    assert _snapshot(pool) == before
    # Listing a singly held block twice is a double free too.
    with pytest.raises(DoubleFreeError, match="freed 2 time"):
        pool.free_blocks([blocks[0], blocks[2], blocks[0]])
    assert _snapshot(pool) == before
    pool.check_integrity()


def test_free_repeated_block_with_enough_refs_queues_it_once() -> None:
    pool = BlockPool(6, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.touch([[a]])
    pool.free_blocks([a, b, a, pool.null_block])
    assert a.ref_cnt == b.ref_cnt == 0
    assert _free_ids(pool)[-2:] == [a.block_id, b.block_id]
    pool.check_integrity()


@pytest.mark.parametrize("block_id", [1, 7])
def test_foreign_blocks_are_rejected(block_id: int) -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    stranger = KVCacheBlock(block_id=block_id, ref_cnt=1)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=f"block {block_id} does not belong"):
        pool.free_blocks([blocks[0], stranger])
    with pytest.raises(ValueError, match=f"block {block_id} does not belong"):
        pool.touch([[blocks[1]], [stranger]])
    assert _snapshot(pool) == before
    pool.check_integrity()


def test_evict_blocks() -> None:
    pool = BlockPool(6, enable_caching=True, enable_kv_cache_events=True)
    hashes = _hashes(*range(12))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(hashes, blocks, 0, 3, 0)
    pool.free_blocks([blocks[2]])
    pool.take_events()
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=r"\[-1, 6\] out of range"):
        pool.evict_blocks({blocks[0].block_id, -1, 6})
    assert _snapshot(pool) == before
    pool.evict_blocks({blocks[0].block_id, blocks[2].block_id, 0, 5})
    assert blocks[0].block_hash is None and blocks[0].ref_cnt == 1  # still held
    assert blocks[2].block_hash is None and blocks[2].ref_cnt == 0  # still free
    assert pool.get_cached_block(hashes[1], [0]) == [blocks[1]]
    removed = pool.take_events()
    assert sorted(e.block_id for e in removed if isinstance(e, BlockRemoved)) == sorted(
        [blocks[0].block_id, blocks[2].block_id]
    )
    pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(6, enable_caching=True, enable_kv_cache_events=True)
    hashes = _hashes(*range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, blocks, 0, 2, 0)
    pool.free_blocks([blocks[1]])
    before = _snapshot(pool)
    assert pool.reset_prefix_cache() is False  # blocks[0] still held
    assert _snapshot(pool) == before
    pool.free_blocks([blocks[0]])
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert all(pool.get_block(i).block_hash is None for i in range(6))
    assert pool.get_cached_block(hashes[0], [0]) is None
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_num_free_blocks() == 5
    pool.check_integrity()


# ----------------------------------------------------------------- events


def test_events_record_and_drain() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    hashes = _hashes(*range(12))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(hashes, blocks, 0, 1, 0, token_ids=[0, 1, 2, 3])
    pool.cache_full_blocks(hashes, blocks, 1, 3, 0)
    events = pool.take_events()
    assert events == [
        BlockStored([hashes[0]], None, [blocks[0].block_id], 0, [0, 1, 2, 3]),
        BlockStored(hashes[1:3], hashes[0], _ids(blocks[1:3]), 0, None),
    ]
    assert pool.take_events() == []
    assert decode_events(encode_events(events)) == events


def test_events_disabled_records_nothing() -> None:
    pool = BlockPool(4, enable_caching=True)
    hashes = _hashes(*range(4))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(hashes, blocks, 0, 1, 0)
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)
    assert pool.take_events() == []


def test_decode_events_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        decode_events(b"\x91\xa3abc")
    with pytest.raises(msgspec.DecodeError):
        decode_events(b"\xc1")


# -------------------------------------------------------------- integrity


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(6, enable_caching=True)
    hashes = _hashes(*range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, blocks, 0, 2, 0)
    pool.check_integrity()

    blocks[0].ref_cnt = 0  # leaked: unreferenced yet not free
    with pytest.raises(IntegrityError, match="free \\(3\\) \\+ held \\(1\\) != usable \\(5\\)"):
        pool.check_integrity()
    blocks[0].ref_cnt = 1

    blocks[1].block_hash = blocks[0].block_hash  # map entry now disagrees
    with pytest.raises(IntegrityError, match="1 cache map entries"):
        pool.check_integrity()
    blocks[1].block_hash = make_block_hash_with_group_id(hashes[1], 0)

    free_block = pool.get_block(5)
    free_block.ref_cnt = 1  # referenced while in the free queue
    with pytest.raises(IntegrityError, match="both free and referenced: \\[5\\]"):
        pool.check_integrity()
    free_block.ref_cnt = 0

    free_block.block_hash = make_block_hash_with_group_id(hashes[0], 3)  # not in the map
    with pytest.raises(IntegrityError, match=r"2 entries, 3 blocks .*missing from the map: \[5\]"):
        pool.check_integrity()
    free_block.block_hash = None
    pool.check_integrity()


# ---------------------------------------------------------------- property


class _Req:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.hashes: list[bytes] = []
        self.blocks: list[KVCacheBlock] = []
        self.num_cached = 0


class PoolMachine(RuleBasedStateMachine):
    """Random request traffic against one pool; every invariant after every step.

    A small token alphabet and block size make prefix hits, shared blocks and
    evictions of cached blocks frequent.
    """

    BLOCK_SIZE = 2

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(14, enable_caching=True, enable_kv_cache_events=True)
        self.hasher = BlockHasher("blake2b", b"prop", self.BLOCK_SIZE)
        self.reqs: list[_Req] = []
        self.history: list[list[int]] = []
        # Model of the prefix cache: block id -> hash it must be cached under.
        self.cached: dict[int, bytes] = {}

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.BLOCK_SIZE)

    def _cache(self, req: _Req) -> None:
        num_full = min(len(req.hashes), len(req.blocks))
        self.pool.cache_full_blocks(req.hashes, req.blocks, req.num_cached, num_full, 0)
        for block, h in zip(req.blocks[req.num_cached : num_full], req.hashes[req.num_cached :],
                            strict=False):
            self.cached[block.block_id] = h
        req.num_cached = num_full

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def new_request(self, tokens: list[int]) -> None:
        self._admit(tokens)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=3))
    def repeat_prefix(self, data: st.DataObject, tail: list[int]) -> None:
        past = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(past)))
        if past[:cut] + tail:
            self._admit(past[:cut] + tail)

    def _admit(self, tokens: list[int]) -> None:
        self.history.append(tokens)
        req = _Req(tokens)
        req.hashes = self.hasher.hash_request_blocks(tokens, 0, [], None)
        hits: list[KVCacheBlock] = []
        # Never the last token: at least one block is always newly allocated.
        for h in req.hashes[: (len(tokens) - 1) // self.BLOCK_SIZE]:
            found = self.pool.get_cached_block(h, [0])
            if found is None:
                break
            assert self.cached[found[0].block_id] == h  # a hit holds that content
            hits.append(found[0])
        num_new = self._num_blocks_for(len(tokens)) - len(hits)
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new > self.pool.get_num_free_blocks() - num_free_hits:
            before = _snapshot(self.pool)
            with pytest.raises(NoFreeBlocksError):
                self.pool.get_new_blocks(self.pool.get_num_free_blocks() + 1)
            assert _snapshot(self.pool) == before
            return
        self.pool.touch([hits])
        new_blocks = self.pool.get_new_blocks(num_new)
        for block in new_blocks:
            self.cached.pop(block.block_id, None)
        req.blocks = hits + new_blocks
        req.num_cached = len(hits)
        self._cache(req)
        self.reqs.append(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def decode(self, data: st.DataObject, extra: list[int]) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        num_needed = self._num_blocks_for(len(req.tokens) + len(extra)) - len(req.blocks)
        if num_needed > self.pool.get_num_free_blocks():
            return
        req.tokens = req.tokens + extra
        req.hashes += self.hasher.hash_request_blocks(
            req.tokens, len(req.hashes), req.hashes, None
        )
        for block in self.pool.get_new_blocks(num_needed):
            self.cached.pop(block.block_id, None)
            req.blocks.append(block)
        self._cache(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.pool.free_blocks(reversed(req.blocks))

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        free = self.pool._free_queue.get_all_free_blocks()
        held = [b for r in self.reqs for b in r.blocks]
        if not free:
            return
        victim = data.draw(st.sampled_from(free))
        batch = [*held[:2], victim]
        before = _snapshot(self.pool)
        with pytest.raises(DoubleFreeError):
            self.pool.free_blocks(batch)
        assert _snapshot(self.pool) == before

    @rule(block_ids=st.sets(st.integers(0, 13), max_size=3))
    def evict(self, block_ids: set[int]) -> None:
        self.pool.evict_blocks(block_ids)
        for block_id in block_ids:
            self.cached.pop(block_id, None)

    @rule(attempt=st.integers(0, 3))
    def reset(self, attempt: int) -> None:
        if attempt:  # reset rarely, or cached free blocks would seldom be hit
            return
        any_held = any(r.blocks for r in self.reqs)
        assert self.pool.reset_prefix_cache() is not any_held
        if not any_held:
            self.cached.clear()
            assert self.pool.take_events()[-1] == AllBlocksCleared()

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        expected = [0] * self.pool.num_blocks
        for r in self.reqs:
            for b in r.blocks:
                expected[b.block_id] += 1
        actual = [self.pool.get_block(i).ref_cnt for i in range(self.pool.num_blocks)]
        assert actual == expected
        hashes = {
            i: get_block_hash(key)
            for i in range(self.pool.num_blocks)
            if (key := self.pool.get_block(i).block_hash) is not None
        }
        assert hashes == self.cached
        for h in self.cached.values():
            assert self.pool.get_cached_block(h, [0]) is not None
        assert self.pool.get_usage() == pytest.approx(
            sum(1 for n in expected if n) / self.pool.num_usable_blocks
        )


PoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestPoolMachine = PoolMachine.TestCase
