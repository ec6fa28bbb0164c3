"""EngineTopology validation, the head split over TP ranks, and the signed ratios."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.errors import ConfigError
from kvbridge.topology import (
    BlockSizeRatio,
    EngineTopology,
    KVLayout,
    block_size_ratio,
    heads_for_tp_rank,
    signed_ratio,
)
from tests.topology.plan_checks import heads_by_rank


def _engine(**overrides: object) -> EngineTopology:
    fields: dict[str, object] = dict(
        tp_size=2, pp_size=1, block_size=16, num_kv_heads=8, is_mla=False,
        layout=KVLayout.NHD, num_layers=4,
    )  # fmt: skip
    fields.update(overrides)
    return EngineTopology(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"tp_size": 0}, "tp_size must be >= 1, got 0"),
        ({"pp_size": -1}, "pp_size must be >= 1, got -1"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1"),
        ({"num_layers": 0}, "num_layers must be >= 1"),
        ({"tp_size": 3}, "tp_size 3 and num_kv_heads 8"),
        ({"tp_size": 12}, "tp_size 12 and num_kv_heads 8"),
        ({"pp_size": 5}, "pp_size 5 exceeds num_layers 4"),
        ({"is_mla": True}, "num_kv_heads must be 1, got 8"),
        ({"layout": "XYZ"}, "unknown KV cache layout"),
    ],
)
def test_invalid_engines_raise(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError if "layout" not in overrides else ValueError, match=match):
        _engine(**overrides)


def test_layout_string_is_parsed() -> None:
    assert _engine(layout="hnd").layout is KVLayout.HND


@pytest.mark.parametrize(("heads", "tp"), list(itertools.product([1, 2, 3, 4, 6, 8, 16], repeat=2)))
def test_heads_split_matches_chunks(heads: int, tp: int) -> None:
    if max(heads, tp) % min(heads, tp):
        with pytest.raises(ConfigError):
            heads_for_tp_rank(heads, tp, 0)
        return
    expected = heads_by_rank(heads, tp)
    assert [list(heads_for_tp_rank(heads, tp, r)) for r in range(tp)] == expected
    engine = _engine(tp_size=tp, num_kv_heads=heads)
    assert all(len(engine.heads_of(r)) == engine.num_heads_per_rank for r in range(tp))
    # Replicated exactly when some head sits on two ranks.
    assert engine.is_kv_replicated == (len({tuple(h) for h in expected}) < tp)
    assert engine.replicates_kv_cache == engine.is_kv_replicated


def test_mla_always_replicates() -> None:
    for tp in (1, 2, 8):
        engine = _engine(tp_size=tp, num_kv_heads=1, is_mla=True)
        assert engine.replicates_kv_cache
        assert engine.is_kv_replicated == (tp > 1)
        assert all(engine.heads_of(r) == range(0, 1) for r in range(tp))


def test_ranks_out_of_range_raise() -> None:
    engine = _engine(pp_size=2)
    with pytest.raises(ConfigError, match="tp_rank 2 out of range for size 2"):
        engine.heads_of(2)
    with pytest.raises(ConfigError, match="pp_rank -1"):
        engine.layers_of(-1)
    with pytest.raises(ConfigError, match="pp_rank 2"):
        engine.global_rank(0, 2)
    assert [engine.global_rank(t, p) for p in range(2) for t in range(2)] == [0, 1, 2, 3]
    assert engine.world_size == 4


@pytest.mark.parametrize(("local", "remote"), list(itertools.product(range(1, 13), repeat=2)))
def test_signed_ratio(local: int, remote: int) -> None:
    if max(local, remote) % min(local, remote):
        with pytest.raises(ValueError, match=f"{max(local, remote)}.*{min(local, remote)}"):
            signed_ratio("tensor parallel size", local, remote)
        return
    ratio = signed_ratio("tensor parallel size", local, remote)
    if local >= remote:
        assert ratio >= 1 and remote * ratio == local
    else:
        assert ratio <= -2 and local * -ratio == remote


@pytest.mark.parametrize(("local", "remote"), list(itertools.product([4, 8, 12, 16, 64], repeat=2)))
def test_block_size_ratio_both_ways(local: int, remote: int) -> None:
    if max(local, remote) % min(local, remote):
        with pytest.raises(ValueError, match="block size"):
            block_size_ratio(local, remote)
        return
    ratio = block_size_ratio(local, remote)
    assert ratio == BlockSizeRatio(local, remote)
    # Both sides tile the same tokens: count on the smaller side * its size = larger size.
    assert ratio.num_remote_per_local * remote == ratio.num_local_per_remote * local
    assert min(ratio.num_remote_per_local, ratio.num_local_per_remote) == 1
    assert ratio.is_identity == (local == remote)
    assert (ratio.num_remote_per_local > 1) == (remote < local)
