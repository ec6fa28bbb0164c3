"""Split K/V engines (SGLang's one tensor per K and per V): validation, pairing, read plans."""

from __future__ import annotations

import pytest

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

HEAD_DIM, ELEM = 8, 2


def split(tp_size: int = 1, *, block_size: int = 16, num_kv_heads: int = 4,
          num_layers: int = 4) -> EngineTopology:
    return EngineTopology(tp_size=tp_size, pp_size=1, block_size=block_size,
                          num_kv_heads=num_kv_heads, is_mla=False, layout=KVLayout.NHD,
                          num_layers=num_layers, split_kv=True)


def test_split_kv_defaults_off_and_is_kept() -> None:
    assert EngineTopology(1, 1, 16, 4, False, KVLayout.NHD, 2).split_kv is False
    assert split().split_kv is True
    assert split(num_layers=3).num_layers == 3  # planes; an even count is the engine's business


@pytest.mark.parametrize(("layout", "is_mla", "heads"), [
    (KVLayout.HND, False, 4), (KVLayout.NHD, True, 1), ("hnd", False, 4),
])
def test_split_kv_needs_nhd_and_no_mla(layout: KVLayout, is_mla: bool, heads: int) -> None:
    with pytest.raises(ConfigError, match="split K/V cache .* needs layout NHD, no MLA and no "
                                          "fused K/V"):
        EngineTopology(1, 1, 16, heads, is_mla, layout, 2, split_kv=True)


def test_split_kv_is_not_fused() -> None:
    with pytest.raises(ConfigError, match="split K/V cache .* fused_kv True"):
        EngineTopology(1, 1, 16, 4, False, KVLayout.HND, 2, fused_kv=True, split_kv=True)


def test_split_and_pair_engines_never_pair() -> None:
    pairs = EngineTopology(1, 1, 16, 4, False, KVLayout.NHD, 4)
    for local, remote in ((split(), pairs), (pairs, split())):
        match = f"split_kv differs: local {local.split_kv}, remote {remote.split_kv}"
        with pytest.raises(IncompatibleTopologyError, match=match):
            check_compatible(local, remote)
        with pytest.raises(IncompatibleTopologyError, match=match):
            TpKVTopology(local, 0, 0, {"p": remote})
        with pytest.raises(IncompatibleTopologyError, match=match):
            num_expected_readers(local, remote, 0, 0)  # the serving side refuses too


@pytest.mark.parametrize(("local_bs", "remote_bs"), [(32, 16), (16, 32), (16, 16)])
def test_split_block_sizes_convert(local_bs: int, remote_bs: int) -> None:
    check_compatible(split(2, block_size=local_bs), split(1, block_size=remote_bs))


def test_plan_p_tp2_to_d_tp1_reads_each_rank_into_its_heads() -> None:
    plan = build_read_plan(split(1, block_size=32), 0, 0, split(2), "p")
    assert [(it.remote_tp_rank, it.remote_heads, it.local_head_offset) for it in plan.items] == [
        (0, range(0, 2), 0), (1, range(0, 2), 2),
    ]
    for item in plan.items:
        assert (item.split_kv, item.num_planes, item.remote_layout) == (True, 1, KVLayout.NHD)
        assert item.global_layers == range(4)  # every plane, K0 V0 K1 V1
        # all the remote rank's heads: its whole NHD block, one run
        assert item.block_byte_ranges(ELEM, HEAD_DIM) == [(0, 16 * 2 * HEAD_DIM * ELEM)]


def test_plan_p_tp1_to_d_tp2_reads_a_head_slice_per_token() -> None:
    head = HEAD_DIM * ELEM
    for rank, heads in ((0, range(0, 2)), (1, range(2, 4))):
        [item] = build_read_plan(split(2), rank, 0, split(1), "p").items
        assert (item.remote_heads, item.local_head_offset, item.num_planes) == (heads, 0, 1)
        assert item.block_byte_ranges(ELEM, HEAD_DIM) == [
            (token * 4 * head + heads.start * head, 2 * head) for token in range(16)]
