"""TpKVTopology: peer registration, lookups, and small hand-worked mappings."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError
from kvbridge.topology import (
    EngineTopology,
    IncompatibleTopologyError,
    KVLayout,
    RemoteRank,
    TpKVTopology,
    UnknownEngineError,
    num_expected_readers,
)


def engine(
    tp: int,
    pp: int = 1,
    *,
    heads: int = 8,
    mla: bool = False,
    block_size: int = 16,
    layout: KVLayout = KVLayout.HND,
    num_layers: int = 4,
) -> EngineTopology:
    return EngineTopology(
        tp_size=tp, pp_size=pp, block_size=block_size, num_kv_heads=heads, is_mla=mla,
        layout=layout, num_layers=num_layers,
    )  # fmt: skip


def test_bad_local_rank_raises() -> None:
    with pytest.raises(ConfigError, match="tp_rank 2 out of range"):
        TpKVTopology(engine(2), 2, 0)
    with pytest.raises(ConfigError, match="pp_rank 1 out of range"):
        TpKVTopology(engine(2), 0, 1)


def test_add_remote_rules() -> None:
    topo = TpKVTopology(engine(2), 0, 0, engine_id="decode")
    topo.add_remote("p", engine(4))
    topo.add_remote("p", engine(4))  # same again: no-op
    with pytest.raises(IncompatibleTopologyError, match="already registered"):
        topo.add_remote("p", engine(8))
    assert topo.topology_of("p") == engine(4)
    with pytest.raises(IncompatibleTopologyError, match="local engine"):
        topo.add_remote("decode", engine(4))
    with pytest.raises(IncompatibleTopologyError, match="num_kv_heads differs: local 8, remote 4"):
        topo.add_remote("q", engine(4, heads=4))
    with pytest.raises(IncompatibleTopologyError, match="num_layers differs"):
        topo.add_remote("q", engine(4, num_layers=6))
    with pytest.raises(IncompatibleTopologyError, match="is_mla differs"):
        TpKVTopology(engine(2, heads=1), 0, 0).add_remote("q", engine(2, heads=1, mla=True))
    assert topo.remote_engine_ids == ("p",)
    topo.add_remote("q", engine(1, layout=KVLayout.NHD))  # layouts may differ
    topo.remove_remote("p")
    topo.remove_remote("never-registered")
    assert topo.remote_engine_ids == ("q",)


def test_unknown_engine_raises_lookup_error() -> None:
    topo = TpKVTopology(engine(2), 0, 0, {"p": engine(4)})
    with pytest.raises(UnknownEngineError, match=r"'x' not registered; known: \['p'\]"):
        topo.plan_reads("x")
    with pytest.raises(LookupError):
        topo.tp_ratio_from_engine_id("x")


def test_replication_queries_by_engine_id() -> None:
    topo = TpKVTopology(
        engine(2, heads=2), 0, 0, {"wide": engine(8, heads=2), "same": engine(2, heads=2)},
        engine_id="me",
    )  # fmt: skip
    assert topo.is_kv_replicated("wide") and topo.replicates_kv_cache("wide")
    assert not topo.is_kv_replicated("same") and not topo.replicates_kv_cache("same")
    assert not topo.is_kv_replicated("me") and topo.tp_ratio_from_engine_id("me") == 1
    mla = TpKVTopology(engine(1, heads=1, mla=True), 0, 0, {"p": engine(1, heads=1, mla=True)})
    assert not mla.is_kv_replicated("p") and mla.replicates_kv_cache("p")


def test_targets_when_local_tp_is_larger() -> None:
    # local TP 4 over remote TP 2: local ranks 2 and 3 share remote rank 1.
    topo = TpKVTopology(engine(4), 3, 0, {"p": engine(2)})
    assert topo.tp_ratio(2) == 2
    assert topo.get_target_remote_ranks_from_engine_id("p") == [RemoteRank(1, 0, 1)]
    (item,) = topo.plan_reads("p").items
    # remote rank 1 holds heads 4..7; local rank 3 holds 6, 7 = remote's 2nd half.
    assert (item.global_heads, item.remote_heads, item.local_head_offset) == (
        range(6, 8), range(2, 4), 0,
    )  # fmt: skip


def test_targets_when_remote_tp_is_larger_with_pp() -> None:
    # local TP 1 PP 1, remote TP 2 PP 2: read every remote worker.
    topo = TpKVTopology(engine(1), 0, 0, {"p": engine(2, pp=2)})
    assert topo.tp_ratio(2) == -2 and topo.pp_ratio(2) == -2
    assert topo.get_target_remote_ranks(2, 2) == [
        RemoteRank(0, 0, 0), RemoteRank(1, 0, 1), RemoteRank(2, 1, 0), RemoteRank(3, 1, 1),
    ]  # fmt: skip
    items = topo.plan_reads("p").items
    assert [item.local_head_offset for item in items] == [0, 4, 0, 4]
    assert [item.global_layers for item in items] == [range(0, 2)] * 2 + [range(2, 4)] * 2
    assert [item.remote_layers for item in items] == [range(0, 2)] * 4


def test_local_pp_larger_reads_one_remote_pp_rank() -> None:
    topo = TpKVTopology(engine(1, pp=2), 0, 1, {"p": engine(1)})
    assert topo.pp_ratio(1) == 2
    (item,) = topo.plan_reads("p").items
    assert (item.global_layers, item.local_layers, item.remote_layers) == (
        range(2, 4), range(0, 2), range(2, 4),
    )  # fmt: skip


def test_uneven_layers_span_two_remote_pp_ranks() -> None:
    # 10 layers: reader PP 2 -> [0,5) [5,10); server PP 4 -> [0,3) [3,6) [6,8) [8,10).
    reader, server = engine(1, 2, num_layers=10), engine(1, 4, num_layers=10)
    plan = TpKVTopology(reader, 0, 0, {"p": server}).plan_reads("p")
    assert [(item.remote_pp_rank, item.global_layers) for item in plan.items] == [
        (0, range(0, 3)), (1, range(3, 5)),
    ]  # fmt: skip
    assert [num_expected_readers(reader, server, 0, pp) for pp in range(4)] == [1, 2, 1, 1]


def test_replicas_share_the_layers_and_a_replica_without_one_only_notifies() -> None:
    # H=2, remote TP 8 (each head on 4 ranks), local TP 2, 3 layers: local rank 0
    # needs h0, which remote ranks 0..3 all hold; three read a layer each, one notifies.
    topo = TpKVTopology(engine(2, heads=2, num_layers=3), 0, 0,
                        {"p": engine(8, heads=2, num_layers=3)})
    plan = topo.plan_reads("p")
    assert [(item.remote_tp_rank, item.read, item.global_layers) for item in plan.items] == [
        (0, True, range(0, 1)), (1, True, range(1, 2)), (2, True, range(2, 3)),
        (3, False, range(0, 3)),
    ]  # fmt: skip
    assert plan.reads == plan.items[:3] and plan.notify_only == plan.items[3:]
    assert plan.notify_only[0].block_byte_ranges(elem_size=2, head_dim=4) == []
    as_server = TpKVTopology(engine(8, heads=2, num_layers=3), 3, 0,
                             {"d": engine(2, heads=2, num_layers=3)})
    assert as_server.expected_readers("d") == 1


@pytest.mark.parametrize(("reader_tp", "server_tp"), [(1, 4), (1, 2), (4, 2), (2, 2)])
def test_mla_reads_the_latent_once_spread_over_the_replicas(reader_tp: int,
                                                             server_tp: int) -> None:
    reader = engine(reader_tp, heads=1, mla=True, layout=KVLayout.NHD)
    server = engine(server_tp, heads=1, mla=True, layout=KVLayout.NHD)
    plan = TpKVTopology(reader, 0, 0, {"p": server}).plan_reads("p")
    num_replicas = max(1, server_tp // reader_tp)  # 4 layers: one run of layers each
    assert len(plan.reads) == num_replicas and not plan.notify_only
    assert [item.global_layers for item in plan.reads] == [
        range(-(-i * 4 // num_replicas), -(-(i + 1) * 4 // num_replicas))
        for i in range(num_replicas)]
    assert plan.reads[0].num_planes == 1
    assert plan.reads[0].block_byte_ranges(elem_size=2, head_dim=576) == [(0, 16 * 576 * 2)]
    assert num_expected_readers(reader, server, 0, 0) == max(1, reader_tp // server_tp)


def test_nhd_byte_ranges_by_hand() -> None:
    # Remote: 1 rank, 4 heads, block of 2 tokens, head_dim 1, 1-byte elements:
    # plane-block bytes = t0h0 t0h1 t0h2 t0h3 t1h0 t1h1 t1h2 t1h3.
    remote = engine(1, heads=4, block_size=2, layout=KVLayout.NHD)
    for tp_rank, expected in [(0, [(0, 2), (4, 2)]), (1, [(2, 2), (6, 2)])]:
        topo = TpKVTopology(engine(2, heads=4, block_size=2), tp_rank, 0, {"p": remote})
        (item,) = topo.plan_reads("p").items
        assert item.block_byte_ranges(elem_size=1, head_dim=1) == expected
    whole = TpKVTopology(engine(1, heads=4, block_size=4), 0, 0, {"p": remote})
    assert whole.plan_reads("p").items[0].block_byte_ranges(1, 1) == [(0, 8)]  # merged
    with pytest.raises(ConfigError, match="elem_size 0"):
        item.block_byte_ranges(elem_size=0, head_dim=1)
