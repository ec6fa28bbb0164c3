"""Tests for kvbridge.reference.paged.free_queue: the intrusive LRU free-block queue."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import IntegrityError
from kvbridge.reference.paged.free_queue import (
    FreeBlockQueue,
    FreeQueueError,
    KVCacheBlock,
    NoFreeBlocksError,
)


def _make(num_blocks: int) -> tuple[list[KVCacheBlock], FreeBlockQueue]:
    blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
    return blocks, FreeBlockQueue(blocks)


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_initial_order_is_given_order() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in (4, 2, 7)]
    queue = FreeBlockQueue(blocks)
    assert _ids(queue) == [4, 2, 7]
    assert queue.num_free_blocks == len(queue) == 3
    queue.check_integrity()


def test_empty_queue() -> None:
    _, queue = _make(0)
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []
    queue.check_integrity()
    with pytest.raises(NoFreeBlocksError, match="requested 1 blocks but only 0"):
        queue.popleft()
    assert queue.popleft_n(0) == []
    queue.check_integrity()


def test_popleft_takes_front_and_clears_links() -> None:
    blocks, queue = _make(3)
    first = queue.popleft()
    assert first is blocks[0]
    assert first.prev_free is None and first.next_free is None
    assert not FreeBlockQueue.contains(first)
    assert _ids(queue) == [1, 2]
    queue.check_integrity()


def test_popleft_n() -> None:
    blocks, queue = _make(5)
    taken = queue.popleft_n(3)
    assert taken == blocks[:3]
    assert all(b.prev_free is None and b.next_free is None for b in taken)
    assert _ids(queue) == [3, 4]
    queue.check_integrity()
    assert queue.popleft_n(2) == blocks[3:]
    assert queue.num_free_blocks == 0
    queue.check_integrity()


def test_popleft_n_too_many_leaves_queue_unchanged() -> None:
    _, queue = _make(3)
    with pytest.raises(NoFreeBlocksError) as info:
        queue.popleft_n(4)
    assert (info.value.num_requested, info.value.num_free) == (4, 3)
    assert isinstance(info.value, ValueError)
    assert _ids(queue) == [0, 1, 2]
    queue.check_integrity()


def test_popleft_n_negative() -> None:
    _, queue = _make(3)
    with pytest.raises(ValueError, match="-1"):
        queue.popleft_n(-1)
    assert _ids(queue) == [0, 1, 2]


@pytest.mark.parametrize("position", [0, 2, 4])
def test_remove_from_front_middle_back(position: int) -> None:
    blocks, queue = _make(5)
    queue.remove(blocks[position])
    expected = [i for i in range(5) if i != position]
    assert _ids(queue) == expected
    assert not FreeBlockQueue.contains(blocks[position])
    queue.check_integrity()


def test_remove_block_not_in_queue() -> None:
    blocks, queue = _make(3)
    queue.remove(blocks[1])
    with pytest.raises(FreeQueueError, match="block 1 is not in the free queue"):
        queue.remove(blocks[1])
    with pytest.raises(FreeQueueError):
        queue.remove(KVCacheBlock(block_id=9))
    assert _ids(queue) == [0, 2]
    queue.check_integrity()


def test_append_goes_to_back() -> None:
    blocks, queue = _make(3)
    queue.remove(blocks[0])
    queue.append(blocks[0])
    assert _ids(queue) == [1, 2, 0]
    queue.check_integrity()


def test_append_twice_raises() -> None:
    blocks, queue = _make(3)
    with pytest.raises(FreeQueueError, match="block 2 is already"):
        queue.append(blocks[2])
    assert _ids(queue) == [0, 1, 2]
    queue.check_integrity()


def test_append_n_keeps_order() -> None:
    blocks, queue = _make(6)
    taken = queue.popleft_n(4)
    queue.append_n(taken[::-1])
    assert _ids(queue) == [4, 5, 3, 2, 1, 0]
    queue.append_n([])
    assert queue.num_free_blocks == 6
    queue.check_integrity()


@pytest.mark.parametrize("bad", ["duplicate", "already_queued"])
def test_append_n_rejects_and_leaves_queue_unchanged(bad: str) -> None:
    blocks, queue = _make(6)
    taken = queue.popleft_n(3)
    batch = [taken[0], taken[1], taken[0]] if bad == "duplicate" else [taken[0], blocks[4]]
    with pytest.raises(FreeQueueError):
        queue.append_n(batch)
    assert _ids(queue) == [3, 4, 5]
    assert all(not FreeBlockQueue.contains(b) for b in taken)
    queue.check_integrity()
    queue.append_n(taken)  # the rejected blocks are still usable
    assert _ids(queue) == [3, 4, 5, 0, 1, 2]
    queue.check_integrity()


def test_lru_order_tail_blocks_first() -> None:
    # Two requests: A holds 0..2, B holds 3..4. A finishes first, then B; the
    # caller frees each request tail first, as the manager does.
    blocks, queue = _make(8)
    a, b = queue.popleft_n(3), queue.popleft_n(2)
    queue.append_n(a[::-1])
    queue.append_n(b[::-1])
    assert _ids(queue) == [5, 6, 7, 2, 1, 0, 4, 3]
    evicted = [queue.popleft().block_id for _ in range(8)]
    assert evicted == [5, 6, 7, 2, 1, 0, 4, 3]


def test_blocks_compare_by_identity_and_repr_is_short() -> None:
    blocks, _ = _make(3)
    twin = KVCacheBlock(block_id=1)
    assert blocks[1] != twin
    assert blocks.index(blocks[1]) == 1
    text = repr(blocks[1])
    assert "prev_free=0" in text and "next_free=2" in text
    assert len(text) < 200


def test_check_integrity_detects_broken_back_link() -> None:
    blocks, queue = _make(4)
    blocks[2].prev_free = blocks[0]  # corrupt: 1 <-> 2 no longer symmetric
    with pytest.raises(IntegrityError, match="block 2: prev link"):
        queue.check_integrity()


def test_check_integrity_detects_count_mismatch() -> None:
    blocks, queue = _make(4)
    blocks[1].next_free = blocks[3]  # skip block 2
    blocks[3].prev_free = blocks[1]
    with pytest.raises(IntegrityError, match="walked 3 blocks.*says 4"):
        queue.check_integrity()


def test_check_integrity_detects_cycle_and_break() -> None:
    blocks, queue = _make(4)
    blocks[3].next_free = blocks[0]  # cycle; must not hang
    with pytest.raises(IntegrityError):
        queue.check_integrity()
    assert len(queue.get_all_free_blocks()) <= 5
    blocks, queue = _make(4)
    blocks[1].next_free = None
    with pytest.raises(IntegrityError, match="broken"):
        queue.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(0, 12),
    ops=st.lists(
        st.tuples(st.sampled_from(["popleft", "popleft_n", "remove", "append", "append_n"]),
                  st.integers(0, 20)),
        max_size=60,
    ),
)
def test_matches_list_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """Random operations agree with a plain list and keep the links consistent."""
    blocks, queue = _make(num_blocks)
    model = list(blocks)
    out: list[KVCacheBlock] = []  # blocks taken out, in order
    for op, arg in ops:
        if op == "popleft":
            if model:
                block = queue.popleft()
                assert block is model.pop(0)
                out.append(block)
            else:
                with pytest.raises(NoFreeBlocksError):
                    queue.popleft()
        elif op == "popleft_n":
            n = arg % (num_blocks + 2)
            if n <= len(model):
                assert queue.popleft_n(n) == model[:n]
                out += model[:n]
                del model[:n]
            else:
                with pytest.raises(NoFreeBlocksError):
                    queue.popleft_n(n)
        elif op == "remove" and model:
            block = model.pop(arg % len(model))
            queue.remove(block)
            out.append(block)
        elif op == "append" and out:
            block = out.pop(arg % len(out))
            queue.append(block)
            model.append(block)
        elif op == "append_n" and out:
            k = arg % (len(out) + 1)
            batch, out = out[-k:][::-1] if k else [], out[: len(out) - k]
            queue.append_n(batch)
            model += batch
        queue.check_integrity()
        assert queue.get_all_free_blocks() == model
        assert queue.num_free_blocks == len(model)
