"""Tests for kvbridge.reference.paged.block_table: row edits, slot mapping, kernel split, DCP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ConfigError
from kvbridge.reference.paged.block_table import (
    REMOTE_SLOT,
    BlockTable,
    ContextParallelConfig,
    GroupTableSpec,
    MultiGroupBlockTable,
)


def make_table(
    block_size: int = 4,
    max_blocks: int = 8,
    kernel_block_size: int | None = None,
    cp: ContextParallelConfig | None = None,
    max_num_reqs: int = 4,
    max_tokens: int = 256,
) -> BlockTable:
    spec = GroupTableSpec(block_size, max_blocks, kernel_block_size)
    return BlockTable(spec, max_num_reqs=max_num_reqs, max_num_batched_tokens=max_tokens, cp=cp)


def row(table: BlockTable, row_idx: int) -> list[int]:
    return [int(x) for x in table.block_ids_np[row_idx, : table.num_blocks_per_row[row_idx]]]


def reference_slot(
    block_ids: list[int], position: int, block_size: int, world: int, rank: int, interleave: int
) -> int:
    """Slot by counting: which rank owns each earlier token, and how many this rank has."""
    owner = (position // interleave) % world
    if owner != rank:
        return REMOTE_SLOT
    local_index = sum(1 for q in range(position) if (q // interleave) % world == rank)
    return block_ids[local_index // block_size] * block_size + local_index % block_size


# -- row edits ----------------------------------------------------------------


def test_append_add_move_swap_clear() -> None:
    table = make_table()
    table.append_row([5, 2], 0)
    table.append_row([7], 0)
    table.add_row([1, 3], 1)
    assert row(table, 0) == [5, 2, 7]
    assert row(table, 1) == [1, 3]

    table.add_row([9], 0)  # replaces the row
    assert row(table, 0) == [9]

    table.move_row(1, 2)
    assert row(table, 2) == [1, 3]
    assert row(table, 1) == [1, 3]

    table.append_row([4], 2)
    table.swap_row(0, 2)
    assert row(table, 0) == [1, 3, 4]
    assert row(table, 2) == [9]

    table.clear()
    assert table.num_blocks_per_row.tolist() == [0, 0, 0, 0]
    assert not table.block_ids_np.any()


def test_append_empty_is_noop() -> None:
    table = make_table()
    table.append_row([3], 1)
    table.append_row([], 1)
    assert row(table, 1) == [3]


def test_views_are_read_only() -> None:
    table = make_table()
    with pytest.raises(ValueError):
        table.block_ids_np[0, 0] = 1
    with pytest.raises(ValueError):
        table.num_blocks_per_row[0] = 1


@pytest.mark.parametrize("row_idx", [-1, 4, 100])
def test_row_out_of_range(row_idx: int) -> None:
    table = make_table(max_num_reqs=4)
    with pytest.raises(ValueError, match=f"row_idx {row_idx} outside"):
        table.append_row([1], row_idx)
    with pytest.raises(ValueError, match="outside"):
        table.move_row(0, row_idx)
    with pytest.raises(ValueError, match="outside"):
        table.swap_row(row_idx, 0)


def test_too_many_blocks_leaves_row_unchanged() -> None:
    table = make_table(max_blocks=3)
    table.append_row([1, 2], 0)
    with pytest.raises(ValueError, match=r"would hold 4 blocks \(2 \+ 2\).* is 3"):
        table.append_row([3, 4], 0)
    assert row(table, 0) == [1, 2]
    table.add_row([7, 8, 9], 0)  # add_row replaces, so three fit
    assert row(table, 0) == [7, 8, 9]


def test_negative_block_id_rejected() -> None:
    table = make_table()
    with pytest.raises(ValueError, match="min -1"):
        table.append_row([2, -1], 0)
    assert table.num_blocks_per_row[0] == 0


def test_block_id_that_overflows_int32_after_split_rejected() -> None:
    table = make_table(block_size=16, kernel_block_size=4)
    with pytest.raises(ValueError, match="block ids must lie in"):
        table.append_row([2**29], 0)
    table.append_row([2**29 - 1], 0)
    assert row(table, 0)[-1] == 2**31 - 1


def test_commit_copies_to_device_mirror() -> None:
    table = make_table()
    table.add_row([3, 4], 0)
    table.add_row([6], 1)
    assert not table.block_ids_device.any()  # nothing committed yet
    table.commit_block_table(1)
    assert table.block_ids_device[0, :2].tolist() == [3, 4]
    assert not table.block_ids_device[1].any()
    table.commit_block_table(2)
    assert torch.equal(table.block_ids_device, torch.from_numpy(table.block_ids_np.copy()))
    with pytest.raises(ValueError, match="num_reqs 5 outside"):
        table.commit_block_table(5)
    table.clear()
    assert not table.block_ids_device.any()


@st.composite
def row_ops(draw: st.DrawFn) -> list[tuple[str, int, int, list[int]]]:
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["append", "add", "move", "swap", "clear"]))
        a, b = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        ids = draw(st.lists(st.integers(0, 50), max_size=3))
        ops.append((kind, a, b, ids))
    return ops


@settings(max_examples=60, deadline=None)
@given(ops=row_ops(), k=st.sampled_from([1, 2, 4]))
def test_row_edits_match_list_model(ops: list[tuple[str, int, int, list[int]]], k: int) -> None:
    table = make_table(block_size=4, max_blocks=5, kernel_block_size=4 // k)
    model: list[list[int]] = [[] for _ in range(4)]
    for kind, a, b, ids in ops:
        if kind in ("append", "add"):
            base = [] if kind == "add" else model[a]
            if len(base) + len(ids) > 5:
                with pytest.raises(ValueError):
                    getattr(table, f"{kind}_row")(ids, a)
                continue
            getattr(table, f"{kind}_row")(ids, a)
            model[a] = base + ids
        elif kind == "move":
            table.move_row(a, b)
            model[b] = list(model[a])
        elif kind == "swap":
            table.swap_row(a, b)
            model[a], model[b] = model[b], model[a]
        else:
            table.clear()
            model = [[] for _ in range(4)]
        for r in range(4):
            expected = [blk * k + j for blk in model[r] for j in range(k)]
            assert row(table, r) == expected


# -- kernel block size ----------------------------------------------------------


def test_kernel_block_split_maps_ids() -> None:
    table = make_table(block_size=16, kernel_block_size=4)
    table.append_row([3, 0], 0)
    assert row(table, 0) == [12, 13, 14, 15, 0, 1, 2, 3]
    assert table.num_blocks_per_row[0] == 8
    assert table.block_ids_np.shape == (4, 8 * 4)


@pytest.mark.parametrize("kernel_block_size", [3, 5, 0, 32])
def test_kernel_block_size_must_divide(kernel_block_size: int) -> None:
    with pytest.raises(ConfigError, match=f"kernel_block_size {kernel_block_size} does not"):
        GroupTableSpec(16, 4, kernel_block_size)


@pytest.mark.parametrize("kernel_block_size", [1, 2, 4, 8, 16])
def test_kernel_split_keeps_slots(kernel_block_size: int) -> None:
    plain = make_table(block_size=16, max_blocks=4)
    split = make_table(block_size=16, max_blocks=4, kernel_block_size=kernel_block_size)
    for table in (plain, split):
        table.add_row([7, 2, 5], 0)
        table.add_row([1], 1)
    req = np.array([0] * 48 + [1] * 16)
    pos = np.concatenate([np.arange(48), np.arange(16)])
    plain.compute_slot_mapping(req, pos)
    split.compute_slot_mapping(req, pos)
    expected = [[7, 2, 5][p // 16] * 16 + p % 16 for p in range(48)] + [16 + p for p in range(16)]
    assert plain.slot_mapping_np[:64].tolist() == expected
    assert split.slot_mapping_np[:64].tolist() == expected


# -- slot mapping -----------------------------------------------------------------


def test_slot_mapping_without_cp_matches_reference() -> None:
    table = make_table(block_size=4, max_blocks=4)
    table.add_row([3, 9, 1], 0)
    table.add_row([6, 2], 2)
    req = np.array([0, 0, 0, 2, 2, 0, 2], dtype=np.int32)
    pos = np.array([0, 5, 11, 0, 7, 4, 3], dtype=np.int32)
    table.compute_slot_mapping(req, pos)
    rows = {0: [3, 9, 1], 2: [6, 2]}
    expected = [reference_slot(rows[r], p, 4, 1, 0, 1) for r, p in zip(req, pos, strict=True)]
    assert table.slot_mapping_np[: len(pos)].tolist() == expected
    table.commit_slot_mapping(len(pos))
    assert table.slot_mapping_device[: len(pos)].tolist() == expected


@pytest.mark.parametrize(
    ("world", "interleave", "block_size", "kernel_block_size"),
    [
        (2, 1, 4, None),
        (2, 2, 4, None),
        (4, 2, 8, None),
        (2, 4, 8, None),
        (3, 2, 4, None),
        (2, 2, 8, 4),
        (4, 4, 16, 4),
    ],
)
def test_cp_slot_mapping_matches_reference(
    world: int, interleave: int, block_size: int, kernel_block_size: int | None
) -> None:
    blocks = {0: [5, 1, 7], 1: [2, 8]}
    num_positions = {r: len(ids) * block_size * world for r, ids in blocks.items()}
    req = np.array([r for r in blocks for _ in range(num_positions[r])])
    pos = np.concatenate([np.arange(num_positions[r]) for r in blocks])
    seen: dict[tuple[int, int], set[int]] = {}
    owners = np.zeros(len(pos), dtype=np.int64)
    for rank in range(world):
        cp = ContextParallelConfig(world, rank, interleave)
        table = make_table(block_size, 4, kernel_block_size, cp=cp, max_tokens=len(pos))
        for r, ids in blocks.items():
            table.add_row(ids, r)
        table.compute_slot_mapping(req, pos)
        got = table.slot_mapping_np[: len(pos)].tolist()
        expected = [
            reference_slot(blocks[r], p, block_size, world, rank, interleave)
            for r, p in zip(req.tolist(), pos.tolist(), strict=True)
        ]
        assert got == expected
        owners += np.array(got) != REMOTE_SLOT
        for r, slot in zip(req.tolist(), got, strict=True):
            if slot != REMOTE_SLOT:
                seen.setdefault((rank, r), set()).add(slot)
    assert (owners == 1).all()  # every token is stored by exactly one rank
    for (_, r), slots in seen.items():  # each rank fills its blocks of a row completely
        assert slots == {b * block_size + o for b in blocks[r] for o in range(block_size)}


def test_cp_virtual_block_size() -> None:
    cp = ContextParallelConfig(dcp_world_size=4, dcp_rank=1, cp_kv_cache_interleave_size=2)
    table = make_table(block_size=8, kernel_block_size=4, cp=cp)
    assert table.virtual_block_size == 16
    spec = GroupTableSpec.for_max_model_len(8, max_model_len=100, dcp_world_size=4)
    assert spec.max_num_blocks_per_req == 4  # ceil(100 / 32)


def test_cp_interleave_must_divide_kernel_block() -> None:
    cp = ContextParallelConfig(2, 0, 3)
    with pytest.raises(ConfigError, match="interleave_size 3 does not divide kernel block size 4"):
        make_table(block_size=8, kernel_block_size=4, cp=cp)


@pytest.mark.parametrize(
    ("world", "rank", "interleave"), [(0, 0, 1), (2, 2, 1), (2, -1, 1), (2, 0, 0)]
)
def test_cp_config_rejects_bad_values(world: int, rank: int, interleave: int) -> None:
    with pytest.raises(ConfigError):
        ContextParallelConfig(world, rank, interleave)


def test_slot_mapping_input_errors_leave_buffer_unchanged() -> None:
    table = make_table(block_size=4, max_blocks=4, max_tokens=8)
    table.add_row([2, 3], 0)
    table.compute_slot_mapping(np.array([0, 0]), np.array([1, 6]))
    before = table.slot_mapping_np.copy()
    cases = [
        (np.array([0]), np.array([8]), "position 8 of row 0 is beyond its 8 allocated"),
        (np.array([1]), np.array([0]), "position 0 of row 1 is beyond its 0"),
        (np.array([4]), np.array([0]), r"req_indices span \[4, 4\], rows are \[0, 4\)"),
        (np.array([0]), np.array([-1]), "negative position -1"),
        (np.array([0, 0]), np.array([0]), "must be equal"),
        (np.zeros(9, dtype=np.int64), np.zeros(9, dtype=np.int64), "9 tokens exceed"),
        (np.array([0]), np.array([0.5]), "positions must be integers"),
    ]
    for req, pos, message in cases:
        with pytest.raises(ValueError, match=message):
            table.compute_slot_mapping(req, pos)
        assert np.array_equal(table.slot_mapping_np, before)


def test_cp_position_limit_uses_virtual_block() -> None:
    cp = ContextParallelConfig(2, 1, 2)
    table = make_table(block_size=4, cp=cp)
    table.add_row([3], 0)
    table.compute_slot_mapping(np.array([0]), np.array([7]))  # 1 block spans 8 positions
    assert table.slot_mapping_np[0] == 3 * 4 + 3
    with pytest.raises(ValueError, match="position 8 of row 0"):
        table.compute_slot_mapping(np.array([0]), np.array([8]))


# -- multiple KV cache groups ---------------------------------------------------------


def make_multi() -> MultiGroupBlockTable:
    specs = [GroupTableSpec(16, 4, kernel_block_size=8), GroupTableSpec(4, 2)]
    return MultiGroupBlockTable(specs, max_num_reqs=3, max_num_batched_tokens=64)


def test_multi_group_forwards_operations() -> None:
    tables = make_multi()
    assert len(tables) == 2
    tables.add_row(([1, 2], [5]), 0)
    tables.append_row(([3], [6]), 0)
    tables.add_row(([4], [0]), 1)
    assert row(tables[0], 0) == [2, 3, 4, 5, 6, 7]
    assert row(tables[1], 0) == [5, 6]
    tables.swap_row(0, 1)
    assert row(tables[0], 0) == [8, 9] and row(tables[1], 0) == [0]
    tables.move_row(1, 2)
    assert row(tables[1], 2) == [5, 6]

    tables.compute_slot_mapping(np.array([2, 2]), np.array([0, 5]))
    assert tables[0].slot_mapping_np[:2].tolist() == [16, 21]
    assert tables[1].slot_mapping_np[:2].tolist() == [20, 25]
    tables.commit_block_table(3)
    tables.commit_slot_mapping(2)
    assert tables[1].block_ids_device[2, :2].tolist() == [5, 6]
    assert tables[0].slot_mapping_device[:2].tolist() == [16, 21]
    tables.clear()
    assert all(not t.num_blocks_per_row.any() for t in tables.block_tables)


def test_multi_group_validates_all_groups_before_writing() -> None:
    tables = make_multi()
    tables.add_row(([1], [2]), 0)
    with pytest.raises(ValueError, match=r"would hold 3 blocks \(1 \+ 2\)"):
        tables.append_row(([7], [8, 9]), 0)  # group 1 allows only 2 blocks
    assert row(tables[0], 0) == [2, 3]
    with pytest.raises(ValueError, match="got block ids for 1 groups, table has 2"):
        tables.add_row(([1],), 0)
    tables.compute_slot_mapping(np.array([0]), np.array([3]))
    before = [t.slot_mapping_np.copy() for t in tables.block_tables]
    # Position 5 fits group 0 (16 tokens per block) but not group 1 (4).
    with pytest.raises(ValueError, match="position 5 of row 0"):
        tables.compute_slot_mapping(np.array([0]), np.array([5]))
    for t, b in zip(tables.block_tables, before, strict=True):
        assert np.array_equal(t.slot_mapping_np, b)


def test_multi_group_needs_specs() -> None:
    with pytest.raises(ConfigError):
        MultiGroupBlockTable([], max_num_reqs=1, max_num_batched_tokens=1)
