"""Exhaustive grid over TP, KV heads, MLA, PP, layer counts, block sizes and layouts.

For every reader rank: every local head of every local layer is read exactly
once and lands at its own index; every needed remote byte is covered exactly
once; notify-only items appear exactly where remote replication needs them;
and on the server side the number of readers that contact each rank equals
``num_expected_readers``. See ``plan_checks`` for the independent derivations.
"""

from __future__ import annotations

import itertools

import pytest

from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout, TpKVTopology
from tests.topology.plan_checks import check_pair, layers_by_rank

TP_SIZES = (1, 2, 4, 8)
KV_HEADS = (1, 2, 4, 8, 16)
PP_SIZES = (1, 2)
BLOCK_SIZES = (16, 32, 64)
NUM_LAYERS = (3, 4)  # 3 does not split evenly over 2 PP ranks


def _engine(
    tp: int, pp: int, block_size: int, heads: int, mla: bool, layout: KVLayout, num_layers: int
) -> EngineTopology:
    return EngineTopology(
        tp_size=tp,
        pp_size=pp,
        block_size=block_size,
        num_kv_heads=heads,
        is_mla=mla,
        layout=layout,
        num_layers=num_layers,
    )


def _model_shapes() -> list[tuple[int, bool]]:
    return [(heads, False) for heads in KV_HEADS] + [(1, True)]


@pytest.mark.parametrize("local_tp", TP_SIZES)
@pytest.mark.parametrize("remote_tp", TP_SIZES)
def test_grid_read_plans(local_tp: int, remote_tp: int) -> None:
    num_checked = 0
    for (heads, mla), local_pp, remote_pp, num_layers, layout in itertools.product(
        _model_shapes(), PP_SIZES, PP_SIZES, NUM_LAYERS, KVLayout
    ):
        if max(local_tp, heads) % min(local_tp, heads) or max(remote_tp, heads) % min(
            remote_tp, heads
        ):
            continue  # not a valid engine (never happens for powers of two)
        # Byte ranges depend on the remote block size only; the local one is
        # covered by the ratio test below.
        for remote_block_size in BLOCK_SIZES:
            local = _engine(local_tp, local_pp, 16, heads, mla, KVLayout.HND, num_layers)
            remote = _engine(
                remote_tp, remote_pp, remote_block_size, heads, mla, layout, num_layers
            )
            check_pair(local, remote)
            num_checked += 1
    assert num_checked == len(_model_shapes()) * 4 * 2 * 2 * len(BLOCK_SIZES)


@pytest.mark.parametrize("local_tp", TP_SIZES)
@pytest.mark.parametrize("remote_tp", TP_SIZES)
def test_grid_ratios(local_tp: int, remote_tp: int) -> None:
    for local_pp, remote_pp, local_bs, remote_bs in itertools.product(
        PP_SIZES, PP_SIZES, BLOCK_SIZES, BLOCK_SIZES
    ):
        local = _engine(local_tp, local_pp, local_bs, 8, False, KVLayout.NHD, 4)
        remote = _engine(remote_tp, remote_pp, remote_bs, 8, False, KVLayout.HND, 4)
        topo = TpKVTopology(local, 0, 0, {"r": remote})
        tp_ratio = topo.tp_ratio_from_engine_id("r")
        if tp_ratio > 0:
            assert local_tp == remote_tp * tp_ratio
        else:
            assert tp_ratio <= -2 and remote_tp == local_tp * -tp_ratio
        pp_ratio = topo.pp_ratio_from_engine_id("r")
        assert (
            (local_pp == remote_pp * pp_ratio)
            if pp_ratio > 0
            else (remote_pp == local_pp * -pp_ratio)
        )
        ratio = topo.block_size_ratio_from_engine_id("r")
        assert min(ratio.num_remote_per_local, ratio.num_local_per_remote) == 1
        assert local_bs * ratio.num_local_per_remote == remote_bs * ratio.num_remote_per_local
        assert topo.plan_reads("r").block_ratio == ratio


@pytest.mark.parametrize("num_layers", range(1, 20))
@pytest.mark.parametrize("pp_size", range(1, 9))
def test_pp_layer_ranges_partition_layers(num_layers: int, pp_size: int) -> None:
    if pp_size > num_layers:
        with pytest.raises(ConfigError):
            _engine(1, pp_size, 16, 1, False, KVLayout.NHD, num_layers)
        return
    engine = _engine(1, pp_size, 16, 1, False, KVLayout.NHD, num_layers)
    ranges = [engine.layers_of(p) for p in range(pp_size)]
    assert [list(r) for r in ranges] == layers_by_rank(num_layers, pp_size)
    assert [layer for r in ranges for layer in r] == list(range(num_layers))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("heads", KV_HEADS)
def test_mla_with_several_heads_is_rejected(heads: int) -> None:
    if heads == 1:
        _engine(2, 1, 16, heads, True, KVLayout.NHD, 4)
        return
    with pytest.raises(ConfigError, match=f"got {heads}"):
        _engine(2, 1, 16, heads, True, KVLayout.NHD, 4)
