"""Fused K/V engines (vLLM's CPU cache): validation, pairing rules, read plans."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.errors import ConfigError
from kvbridge.topology import (
    EngineTopology,
    IncompatibleTopologyError,
    KVLayout,
    TpKVTopology,
    build_read_plan,
    check_compatible,
    num_expected_readers,
)

BLOCK, HEAD_SIZE, ELEM = 32, 16, 2
ROW = 2 * HEAD_SIZE  # one head's K and V per token slot


def fused(tp_size: int = 1, *, num_kv_heads: int = 4, block_size: int = BLOCK,
          pp_size: int = 1, num_layers: int = 4) -> EngineTopology:
    return EngineTopology(tp_size=tp_size, pp_size=pp_size, block_size=block_size,
                          num_kv_heads=num_kv_heads, is_mla=False, layout=KVLayout.HND,
                          num_layers=num_layers, fused_kv=True)


def test_fused_kv_defaults_off_and_is_kept() -> None:
    plain = EngineTopology(1, 1, 16, 4, False, KVLayout.HND, 2)
    assert plain.fused_kv is False
    assert fused().fused_kv is True


@pytest.mark.parametrize(("layout", "is_mla", "heads"), [
    (KVLayout.NHD, False, 4), (KVLayout.HND, True, 1), ("nhd", False, 4),
])
def test_fused_kv_needs_hnd_and_no_mla(layout: KVLayout, is_mla: bool, heads: int) -> None:
    with pytest.raises(ConfigError, match="fused K/V cache .* needs layout HND and no MLA"):
        EngineTopology(1, 1, 16, heads, is_mla, layout, 2, fused_kv=True)


def test_fused_and_plain_engines_never_pair() -> None:
    plain = EngineTopology(1, 1, BLOCK, 4, False, KVLayout.HND, 4)
    for local, remote in ((fused(), plain), (plain, fused())):
        with pytest.raises(IncompatibleTopologyError,
                           match=f"fused_kv differs: local {local.fused_kv}, "
                                 f"remote {remote.fused_kv}"):
            check_compatible(local, remote)


@pytest.mark.parametrize(("local_bs", "remote_bs"), [(32, 64), (64, 32), (16, 32)])
def test_fused_block_sizes_must_be_equal(local_bs: int, remote_bs: int) -> None:
    local, remote = fused(block_size=local_bs), fused(2, block_size=remote_bs)
    match = (f"move only between equal block sizes: local {local_bs}, remote {remote_bs}; "
             f"start P and D with the same --block-size")
    with pytest.raises(IncompatibleTopologyError, match=match):
        check_compatible(local, remote)
    with pytest.raises(IncompatibleTopologyError, match=match):
        TpKVTopology(local, 0, 0, {"p": remote})
    with pytest.raises(IncompatibleTopologyError, match="equal block sizes"):
        num_expected_readers(local, remote, 0, 0)  # the serving side refuses too


@pytest.mark.parametrize(("local_tp", "remote_tp"), [(1, 1), (1, 2), (2, 1), (4, 2), (2, 4)])
def test_fused_engines_of_any_tp_pair(local_tp: int, remote_tp: int) -> None:
    check_compatible(fused(local_tp), fused(remote_tp))


def test_plan_p_tp2_to_d_tp1_reads_one_head_run_per_rank() -> None:
    plan = build_read_plan(fused(1), 0, 0, fused(2), "p")
    assert [(it.remote_tp_rank, it.remote_heads, it.local_head_offset) for it in plan.items] == [
        (0, range(0, 2), 0), (1, range(0, 2), 2),
    ]
    for item in plan.items:
        assert (item.fused_kv, item.num_planes, item.remote_layout) == (True, 1, KVLayout.HND)
        # both heads of the remote rank: its whole block, one run
        assert item.block_byte_ranges(ELEM, ROW) == [(0, 2 * BLOCK * ROW * ELEM)]


def test_plan_p_tp1_to_d_tp2_reads_each_ranks_half_of_the_block() -> None:
    head_run = BLOCK * ROW * ELEM  # one head's K^T | V
    for rank, heads in ((0, range(0, 2)), (1, range(2, 4))):
        [item] = build_read_plan(fused(2), rank, 0, fused(1), "p").items
        assert (item.remote_heads, item.local_head_offset, item.num_planes) == (heads, 0, 1)
        assert item.block_byte_ranges(ELEM, ROW) == [(heads.start * head_run, 2 * head_run)]


def test_plain_plans_keep_two_planes() -> None:
    plain = EngineTopology(1, 1, BLOCK, 4, False, KVLayout.HND, 4)
    [item] = build_read_plan(plain, 0, 0, plain, "p").items
    assert (item.fused_kv, item.num_planes) == (False, 2)


@given(
    heads_exp=st.integers(0, 3), local_exp=st.integers(0, 3), remote_exp=st.integers(0, 3),
    pp=st.sampled_from([(1, 1), (1, 2), (2, 1)]),
)
def test_fused_plans_read_every_local_head_once_in_one_run(
    heads_exp: int, local_exp: int, remote_exp: int, pp: tuple[int, int],
) -> None:
    num_kv_heads, local_tp, remote_tp = 2**heads_exp, 2**local_exp, 2**remote_exp
    local = fused(local_tp, num_kv_heads=num_kv_heads, pp_size=pp[0])
    remote = fused(remote_tp, num_kv_heads=num_kv_heads, pp_size=pp[1])
    head_run = BLOCK * ROW * ELEM
    for pp_rank in range(local.pp_size):
        for tp_rank in range(local_tp):
            plan = build_read_plan(local, tp_rank, pp_rank, remote, "p")
            read: dict[int, list[int]] = {}
            for item in plan.reads:
                ranges = item.block_byte_ranges(ELEM, ROW)
                held = remote.num_heads_per_rank
                assert ranges == [(item.remote_heads.start * head_run,
                                   len(item.remote_heads) * head_run)]
                assert ranges[0][0] + ranges[0][1] <= held * head_run
                for layer in item.global_layers:
                    read.setdefault(layer, []).extend(item.global_heads)
            assert sorted(read) == list(local.layers_of(pp_rank))
            for heads in read.values():
                assert sorted(heads) == list(local.heads_of(tp_rank))
