"""Fused K/V caches (vLLM CPU) on the transfer side: LocalKV, direct ranges, wire, compat.

Also the per-rank port lists a read may be given instead of a base port.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.blocks.ranges import block_ranges, head_span
from kvbridge.transfer.errors import MissingPortError
from kvbridge.transfer.local_kv import LocalKV, topology_from_info, topology_info, topology_of
from kvbridge.transfer.protocol import security as sec
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.jobs import ReadJob

NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE, LAYERS = 6, 4, 8, 4, 3
ROW = 2 * HEAD_SIZE
CODEC = wire.MessageCodec()


def fused_topology(**overrides: object) -> EngineTopology:
    fields: dict[str, object] = dict(
        tp_size=1, pp_size=1, block_size=BLOCK, num_kv_heads=HEADS, is_mla=False,
        layout=KVLayout.HND, num_layers=LAYERS, fused_kv=True,
    )  # fmt: skip
    fields.update(overrides)
    return EngineTopology(**fields)  # type: ignore[arg-type]


def vllm_cpu_caches(num_heads: int = HEADS, block_size: int = BLOCK) -> list[torch.Tensor]:
    """One ``[N, H, B, 2 * head_size]`` view per layer, all over one storage (as vLLM does)."""
    store = torch.arange(LAYERS * NUM_BLOCKS * num_heads * block_size * ROW, dtype=torch.int32)
    store = store.to(torch.bfloat16).view(LAYERS, NUM_BLOCKS, num_heads, block_size, ROW)
    return list(store.unbind(0))


def test_local_kv_takes_fused_caches_as_one_plane() -> None:
    caches = vllm_cpu_caches()
    local = LocalKV(fused_topology(), 0, 0, caches)
    assert (local.num_blocks, local.num_heads, local.head_dim) == (NUM_BLOCKS, HEADS, ROW)
    assert (local.num_planes, local.elem_nbytes) == (1, 2)
    assert local.block_nbytes == HEADS * BLOCK * ROW * 2 == local.plane_block_nbytes
    # kept as single-plane views of the caller's memory, as the kernels take them
    assert [t.shape for t in local.layers] == [(1, NUM_BLOCKS, HEADS, BLOCK, ROW)] * LAYERS
    assert [t.data_ptr() for t in local.layers] == [t.data_ptr() for t in caches]
    origins = local.plane_origins(slice(0, LAYERS))
    assert origins.tolist() == [t.data_ptr() for t in caches]
    assert local.plane_origins(slice(1, 3)).tolist() == [t.data_ptr() for t in caches[1:]]
    # the single-plane view [1, N, ...] is taken as it is
    again = LocalKV(fused_topology(), 0, 0, [t.unsqueeze(0) for t in caches])
    assert again.block_nbytes == local.block_nbytes


@pytest.mark.parametrize(("topology", "caches", "match"), [
    (fused_topology(), [torch.zeros(2, NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE)] * LAYERS,
     r"expected a \[num_blocks, heads, block_size, 2 \* head_size\] fused K/V cache"),
    (fused_topology(block_size=16), vllm_cpu_caches(), "does not match block size 16 .fused"),
    (fused_topology(tp_size=2), vllm_cpu_caches(), "cache holds 4 heads, topology says 2"),
    (fused_topology(fused_kv=False), vllm_cpu_caches(), r"expected a \[2, ...\] 5-D K/V"),
    (fused_topology(), [t.transpose(1, 2) for t in vllm_cpu_caches(num_heads=BLOCK,
                                                                   block_size=HEADS)],
     "not contiguous"),
])
def test_local_kv_refuses_caches_that_are_not_what_the_topology_says(
    topology: EngineTopology, caches: list[torch.Tensor], match: str,
) -> None:
    with pytest.raises(ConfigError, match=match):
        LocalKV(topology, 0, 0, caches)


@pytest.mark.parametrize(("heads", "ids"), [((0, 4), [5, 1, 3]), ((1, 3), [2, 3, 4]),
                                            ((3, 4), [0])])
def test_direct_ranges_are_the_heads_k_and_v_runs(heads: tuple[int, int], ids: list[int]) -> None:
    caches = vllm_cpu_caches()
    local = LocalKV(fused_topology(), 0, 0, caches)
    span = head_span(local, *heads)
    assert span is not None
    got = block_ranges(local, np.array(ids, dtype=np.int64), slice(0, LAYERS), span)
    expected: list[tuple[int, int]] = []
    for cache in caches:  # stream order: layer, then block; one plane
        for block in ids:
            run = cache[block, heads[0] : heads[1]]  # [heads, B, 2D]: K^T | V of each head
            piece = (run.data_ptr(), run.numel() * run.element_size())
            if expected and sum(expected[-1]) == piece[0]:
                expected[-1] = (expected[-1][0], expected[-1][1] + piece[1])
            else:
                expected.append(piece)
    assert [tuple(r) for r in got.tolist()] == expected


def test_topology_round_trips_through_the_handshake() -> None:
    topo = fused_topology(tp_size=2, num_kv_heads=4)
    assert topology_from_info(CODEC.decode(CODEC.encode(
        wire.Hello("d", 0, sec.PROTOCOL_VERSION, "h" * 64, b"n" * 32,
                   topology=topology_info(topo)))).topology) == topo  # type: ignore[union-attr]
    local = LocalKV(topo, 1, 0, vllm_cpu_caches(num_heads=2))
    meta = local.metadata("p", None)
    decoded = CODEC.decode(CODEC.encode(meta))
    assert isinstance(decoded, wire.AgentMetadata)
    assert decoded == meta and decoded.fused_kv and decoded.head_dim == ROW
    assert decoded.layer_block_nbytes == [2 * BLOCK * ROW * 2] * LAYERS
    assert topology_of(decoded) == topo


def test_topology_info_leaves_fused_kv_out_unless_set() -> None:
    """A non-fused reader's Hello decodes on a server that has no such field."""
    plain = dataclasses.replace(fused_topology(), fused_kv=False)
    assert "fused_kv" not in msgspec.msgpack.decode(msgspec.msgpack.encode(topology_info(plain)))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(topology_info(fused_topology())))[
        "fused_kv"] is True
    old = msgspec.msgpack.encode({"tp_size": 1, "pp_size": 1, "block_size": 16,
                                  "num_kv_heads": 4, "is_mla": False, "layout": "HND",
                                  "num_layers": 2})
    assert msgspec.msgpack.decode(old, type=wire.TopologyInfo).fused_kv is False


def test_fused_kv_is_part_of_the_compat_hash_not_a_conversion() -> None:
    plain = sec.CompatInfo("m", "bfloat16", HEADS, HEAD_SIZE, LAYERS, KVLayout.HND, BLOCK, False)
    cpu = dataclasses.replace(plain, fused_kv=True)
    assert plain.fused_kv is False
    for conversions in (False, True):
        assert sec.compat_hash(cpu, conversions) != sec.compat_hash(plain, conversions)
        assert sec.compat_diff(plain, cpu, conversions) == ["fused_kv: local False != remote True"]
    with pytest.raises(ConfigError, match="CompatInfo.fused_kv must be a bool, got 1"):
        dataclasses.replace(plain, fused_kv=1)  # type: ignore[arg-type]


def job(port: int | tuple[int, ...]) -> ReadJob:
    return ReadJob("r", "p", "127.0.0.1", port, (1,), (2,), "g" * 16, 16, 0.0)


def test_a_base_port_gives_base_plus_rank() -> None:
    assert [job(5600).port_of(rank) for rank in range(3)] == [5600, 5601, 5602]
    assert job(5600).has_port(1000)


def test_a_port_list_gives_each_ranks_port_and_a_typed_error_beyond() -> None:
    ports = job((7001, 6002, 9003))
    assert [ports.port_of(rank) for rank in range(3)] == [7001, 6002, 9003]
    assert ports.has_port(2) and not ports.has_port(3)
    with pytest.raises(MissingPortError, match=r"needs rank 3 of engine 'p', but only the "
                                               r"ports of ranks \[0, 3\) were given"):
        ports.port_of(3)
    assert issubclass(MissingPortError, ConfigError)
