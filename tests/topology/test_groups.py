"""KV cache groups: what P holds of each group and the block pairs D reads (topology/groups.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.topology import CacheGroup, hold_groups, load_problem, plan_group_read

BS = 32
NULL = 0
FULL = CacheGroup("tokens", label="full attention")
SWA = CacheGroup("window", window=96, label="sliding window 96")
STATE = CacheGroup("state", label="GDN state")


def swa_blocks(first_id: int, num_tokens: int, num_computed: int) -> list[int]:
    """A sliding-window group's list as vLLM keeps it after ``num_computed`` tokens."""
    num_blocks = -(-num_tokens // BS)
    skipped = max(0, num_computed - SWA.window + 1)
    return [NULL if (i + 1) * BS <= skipped else first_id + i for i in range(num_blocks)]


def test_group_kinds_are_checked() -> None:
    with pytest.raises(ValueError, match="window"):
        CacheGroup("window")
    with pytest.raises(ValueError, match="window"):
        CacheGroup("tokens", window=4)
    with pytest.raises(ValueError, match="kind"):
        CacheGroup("ring")  # type: ignore[arg-type]


def test_p_holds_every_full_block_the_window_and_the_state() -> None:
    # 300 tokens computed: the window keeps tokens >= 205, i.e. blocks 6..9
    full = list(range(10, 20))
    window = swa_blocks(30, 300, 300)
    assert window[:6] == [NULL] * 6 and window[6:] == [36, 37, 38, 39]
    state = [NULL, NULL, 55]  # vLLM's align mode: the state at the last computed block
    with pytest.raises(ValueError, match="no state after 300"):  # not at token 299's block
        hold_groups([FULL, SWA, STATE], [full, window, state + [NULL] * 7], 300, BS, NULL)
    held = hold_groups([FULL, SWA, STATE], [full, window, [NULL] * 9 + [55]], 300, BS, NULL)
    assert held.block_ids == full + [36, 37, 38, 39] + [55]
    assert held.spans == [(0, 10), (6, 4), (9, 1)]
    held = hold_groups([FULL, SWA, STATE], [full, window, [77]], 300, BS, NULL)
    assert held.spans == [(0, 10), (6, 4), (0, 1)]  # a table of one state block


@pytest.mark.parametrize(("lists", "match"), [
    ([[1, 2], [NULL, NULL]], "holds blocks"),  # the window kept nothing
    ([[1], [2, 3]], r"holds blocks \[0, 1\) of the 2"),  # too few blocks
])
def test_p_refuses_what_a_reader_could_not_use(lists: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hold_groups([FULL, SWA], lists, 40, BS, NULL)
    with pytest.raises(ValueError, match="no state"):
        hold_groups([FULL, STATE], [[1, 2], [NULL, NULL]], 40, BS, NULL)
    with pytest.raises(ValueError, match="2 block lists for 3"):
        hold_groups([FULL, SWA, STATE], [[1], [2]], 10, BS, NULL)


def test_d_reads_its_window_blocks_and_the_state_in_one_plan() -> None:
    # D: local hit of 64 tokens; loads [64, 299); its window keeps tokens >= 204
    p_full, p_window = list(range(10, 20)), swa_blocks(30, 300, 300)
    held = hold_groups([FULL, SWA, STATE], [p_full, p_window, [NULL, NULL, 55]], 299, BS,
                       NULL)
    d_full = [1, 2, 103, 104, 105, 106, 107, 108, 109, 110]
    d_window = swa_blocks(200, 299, 299)
    d_state = [NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 300]
    assert load_problem([FULL, SWA, STATE], held.spans, 64, 299, 299, BS) is None
    read = plan_group_read([FULL, SWA, STATE], [d_full, d_window, d_state], held.spans,
                           held.block_ids, 64, 299, BS, NULL)
    assert read.local_block_ids == d_full[2:] + [206, 207, 208, 209] + [300]
    assert read.remote_block_ids == p_full[2:] + [36, 37, 38, 39] + [55]
    assert read.missing == []


def test_a_block_d_needs_that_p_freed_is_a_problem_or_missing() -> None:
    # P computed 607 tokens: its window freed tokens < 512 (blocks 0..15); D,
    # computing token 606, attends to token 511 (block 15)
    held = hold_groups([FULL, SWA], [list(range(1, 20)), swa_blocks(100, 607, 607)], 607, BS,
                       NULL)
    assert held.spans[1] == (16, 3)
    problem = load_problem([FULL, SWA], held.spans, 0, 606, 607, BS)
    assert problem is not None and "sliding window 96" in problem and "[15, 19)" in problem
    assert load_problem([FULL, SWA], held.spans, 0, 607, 607, BS) is None  # first-token flow
    read = plan_group_read([FULL, SWA], [list(range(50, 69)), swa_blocks(200, 606, 606)],
                           held.spans, held.block_ids, 0, 606, BS, NULL)
    assert read.missing == [215] and 215 not in read.local_block_ids


def test_a_state_is_only_loaded_after_the_tokens_p_computed() -> None:
    held = hold_groups([FULL, STATE], [[1, 2, 3], [NULL, NULL, 9]], 70, BS, NULL)
    problem = load_problem([FULL, STATE], held.spans, 0, 69, 70, BS)
    assert problem is not None and "cannot be rewound" in problem
    assert load_problem([FULL, STATE], held.spans, 0, 70, 70, BS) is None
    assert "2 KV cache groups" in str(load_problem([FULL, STATE, SWA], held.spans, 0, 70, 70,
                                                   BS))


def test_d_without_a_state_block_cannot_plan() -> None:
    held = hold_groups([FULL, STATE], [[1, 2], [NULL, 9]], 40, BS, NULL)
    with pytest.raises(ValueError, match="no block for the GDN state"):
        plan_group_read([FULL, STATE], [[5, 6], [NULL, NULL]], held.spans, held.block_ids,
                        0, 40, BS, NULL)


@given(num_tokens=st.integers(2, 700), num_hit_blocks=st.integers(0, 22),
       classic=st.booleans())
def test_every_block_d_keeps_is_read_from_the_same_position_on_p(
    num_tokens: int, num_hit_blocks: int, classic: bool
) -> None:
    end = num_tokens - 1 if classic else num_tokens
    first = min(num_hit_blocks * BS, (end - 1) // BS * BS)
    p_full = [1000 + i for i in range(-(-num_tokens // BS))]
    p_window = swa_blocks(2000, num_tokens, num_tokens)
    held = hold_groups([FULL, SWA], [p_full, p_window], num_tokens, BS, NULL)
    d_full = [3000 + i for i in range(-(-end // BS))]
    d_window = swa_blocks(4000, end, end)
    read = plan_group_read([FULL, SWA], [d_full, d_window], held.spans, held.block_ids, first,
                           end, BS, NULL)
    problem = load_problem([FULL, SWA], held.spans, first, end, num_tokens, BS)
    assert (problem is None) == (read.missing == [])
    pairs = list(zip(read.remote_block_ids, read.local_block_ids, strict=True))
    assert all(local % 1000 == remote % 1000 for remote, local in pairs)  # same position
    needed = {4000 + i for i in range(max(first, end - 95) // BS, -(-end // BS))}
    assert {local for _, local in pairs if local >= 4000} | set(read.missing) == needed
    assert {local for _, local in pairs if local < 4000} == set(d_full[first // BS:])
