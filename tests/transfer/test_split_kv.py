"""Split K/V caches (SGLang) on the transfer side: LocalKV, wire, compat, and real reads.

A split engine registers one ``[num_blocks, block_size, num_heads, head_dim]``
tensor per K and per V plane, K0, V0, K1, V1, ... (``EngineTopology.split_kv``,
``num_layers`` counting planes). The reads run between real ``TransferAgent``s in
this process on loopback: staged over UCX (TP 2 -> 1 and 1 -> 2, block size 16
-> 32, from inside a block), direct over UCX, and the same-host copy. Every
byte is compared token by token with what P holds.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

import msgspec
import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.agent import TransferAgent
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks.ranges import head_span
from kvbridge.transfer.local_kv import LocalKV, topology_from_info, topology_info, topology_of
from kvbridge.transfer.protocol import security as sec
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.jobs import ReadStats
from tests.waiting import wait_until

MODEL_LAYERS, HEADS, HEAD_DIM, NUM_BLOCKS = 2, 4, 8, 12
PLANES = 2 * MODEL_LAYERS  # K0, V0, K1, V1
CODEC = wire.MessageCodec()
HOST = "127.0.0.1"
UCX_ONLY: dict[str, object] = dict(local_copy=False)
FAST = dict(connect_timeout_s=5.0, handshake_timeout_s=5.0, reply_timeout_s=5.0,
            chunk_timeout_s=5.0, read_timeout_s=20.0, heartbeat_s=5.0)


def split_topology(tp_size: int = 1, block_size: int = 16, **overrides: object
                   ) -> EngineTopology:
    fields: dict[str, object] = dict(
        tp_size=tp_size, pp_size=1, block_size=block_size, num_kv_heads=HEADS, is_mla=False,
        layout=KVLayout.NHD, num_layers=PLANES, split_kv=True,
    )  # fmt: skip
    fields.update(overrides)
    return EngineTopology(**fields)  # type: ignore[arg-type]


def compat_of(topo: EngineTopology) -> sec.CompatInfo:
    return sec.CompatInfo("m", "bfloat16", HEADS, HEAD_DIM, topo.num_layers, topo.layout,
                          topo.block_size, False, split_kv=topo.split_kv)


def model_kv(block_size: int, seed: int) -> torch.Tensor:
    """The whole model's K/V planes ``[PLANES, NUM_BLOCKS, block_size, HEADS, HEAD_DIM]``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (PLANES, NUM_BLOCKS, block_size, HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def rank_planes(kv: torch.Tensor, tp_size: int, tp_rank: int) -> list[torch.Tensor]:
    """One TP rank's layer list: each plane's heads of that rank, ``[N, B, H / t, D]``."""
    per_rank = HEADS // tp_size
    heads = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    return [plane[:, :, heads].contiguous() for plane in kv]


def tokens_of(ranks: list[list[torch.Tensor]], block_ids: list[int]) -> torch.Tensor:
    """``[PLANES, tokens, HEADS, HEAD_DIM]`` of ``block_ids`` in token order, all ranks' heads."""
    planes = [torch.cat([rank[p][block_ids] for rank in ranks], dim=2) for p in range(PLANES)]
    return torch.stack([p.flatten(0, 1) for p in planes])


# ------------------------------------------------------------------ LocalKV and the wire

def test_local_kv_takes_each_plane_as_a_layer_of_one_plane() -> None:
    planes = rank_planes(model_kv(16, seed=1), 2, 1)
    local = LocalKV(split_topology(tp_size=2), 1, 0, planes)
    assert (local.num_blocks, local.num_heads, local.head_dim, local.num_planes) == (
        NUM_BLOCKS, 2, HEAD_DIM, 1)
    assert local.block_nbytes == 16 * 2 * HEAD_DIM * 2 == local.plane_block_nbytes
    assert [t.shape for t in local.layers] == [(1, NUM_BLOCKS, 16, 2, HEAD_DIM)] * PLANES
    # one origin per entry, its own address: K and V of a layer need not be neighbours
    assert local.plane_origins(slice(0, PLANES)).tolist() == [t.data_ptr() for t in planes]
    assert local.plane_origins(slice(1, 3)).tolist() == [t.data_ptr() for t in planes[1:3]]
    again = LocalKV(split_topology(tp_size=2), 1, 0, [t[None] for t in planes])
    assert again.block_nbytes == local.block_nbytes
    # a head slice of a split plane is a run only when it is every head (NHD)
    assert head_span(local, 0, 2) is not None and head_span(local, 1, 2) is None


@pytest.mark.parametrize(("topology", "caches", "match"), [
    (split_topology(), [torch.zeros(2, NUM_BLOCKS, 16, HEADS, HEAD_DIM)] * PLANES,
     r"expected a \[num_blocks, block_size, heads, head_dim\] split K or V cache"),
    (split_topology(block_size=32), [torch.zeros(NUM_BLOCKS, 16, HEADS, HEAD_DIM)] * PLANES,
     r"does not match block size 32 \(split\)"),
    (split_topology(tp_size=2), [torch.zeros(NUM_BLOCKS, 16, HEADS, HEAD_DIM)] * PLANES,
     "cache holds 4 heads, topology says 2"),
    (split_topology(), [torch.zeros(NUM_BLOCKS, 16, HEADS, HEAD_DIM)] * MODEL_LAYERS,
     "holds 4 layers, got 2 cache tensors"),
])
def test_local_kv_refuses_caches_that_are_not_what_the_topology_says(
    topology: EngineTopology, caches: list[torch.Tensor], match: str,
) -> None:
    with pytest.raises(ConfigError, match=match):
        LocalKV(topology, 0, 0, caches)


def test_topology_round_trips_through_the_handshake() -> None:
    topo = split_topology(tp_size=2)
    hello = wire.Hello("d", 0, sec.PROTOCOL_VERSION, "h" * 64, b"n" * 32,
                       topology=topology_info(topo))
    decoded_hello = CODEC.decode(CODEC.encode(hello))
    assert isinstance(decoded_hello, wire.Hello) and decoded_hello.topology is not None
    assert topology_from_info(decoded_hello.topology) == topo
    meta = LocalKV(topo, 0, 0, rank_planes(model_kv(16, seed=2), 2, 0)).metadata("p", None)
    decoded = CODEC.decode(CODEC.encode(meta))
    assert isinstance(decoded, wire.AgentMetadata)
    assert decoded == meta and decoded.split_kv and not decoded.fused_kv
    assert decoded.layer_block_nbytes == [16 * 2 * HEAD_DIM * 2] * PLANES
    assert topology_of(decoded) == topo


def test_topology_info_leaves_split_kv_out_unless_set() -> None:
    plain = dataclasses.replace(split_topology(), split_kv=False)
    assert "split_kv" not in msgspec.msgpack.decode(msgspec.msgpack.encode(topology_info(plain)))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(topology_info(split_topology())))[
        "split_kv"] is True


def test_split_kv_is_part_of_the_compat_hash_and_of_the_agents_check() -> None:
    split = compat_of(split_topology())
    plain = dataclasses.replace(split, split_kv=False)
    for conversions in (False, True):
        assert sec.compat_hash(split, conversions) != sec.compat_hash(plain, conversions)
        assert sec.compat_diff(plain, split, conversions) == [
            "split_kv: local False != remote True"]
    with pytest.raises(ConfigError, match="CompatInfo.split_kv must be a bool, got 1"):
        dataclasses.replace(plain, split_kv=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="CompatInfo.split_kv False != EngineTopology.split_kv "
                                          "True: describe one cache"):
        TransferAgent("p", split_topology(), 0, 0, plain)


# ------------------------------------------------------------------ reads between agents

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="process_vm_readv is Linux's")


class Agents:
    """Agents started in this process, each serving or reading one rank's planes."""

    def __init__(self) -> None:
        self.made: list[TransferAgent] = []

    def start(self, engine_id: str, topo: EngineTopology, tp_rank: int,
              caches: list[torch.Tensor], **config: object) -> TransferAgent:
        agent = TransferAgent(engine_id, topo, tp_rank, 0, compat_of(topo),
                              config=AgentConfig(**FAST | config))  # type: ignore[arg-type]
        self.made.append(agent)
        agent.register_kv_caches(caches)
        agent.start()
        return agent


@pytest.fixture
def agents() -> Iterator[Agents]:
    made = Agents()
    yield made
    for agent in reversed(made.made):
        agent.close()


def read(servers: list[TransferAgent], readers: list[TransferAgent], request_id: str,
         remote_ids: list[int], local_ids: list[int], num_tokens: int, first_token: int
         ) -> list[ReadStats]:
    """Grant on every P rank, read on every D rank, wait; each reader's stats."""
    grant = "g" * 16 + request_id
    for server in servers:
        server.issue_grant(request_id, remote_ids, None, grant=grant)
    ports = [server.port for server in servers]
    for reader in readers:
        reader.start_read(request_id, engine_id="p", host=HOST, port=ports,
                          remote_block_ids=remote_ids, local_block_ids=local_ids, grant=grant,
                          num_tokens=num_tokens, first_token=first_token)
    return [outcome(reader, request_id) for reader in readers]


def outcome(reader: TransferAgent, request_id: str) -> ReadStats:
    """Wait for ``reader``'s read ``request_id`` to end; its stats."""
    wait_until(lambda: request_id in reader.get_finished()[1], 20.0,
               message=f"read {request_id}")
    got: list[ReadStats] = []

    def collected() -> bool:
        got.extend(reader.get_stats())
        return bool(got)

    wait_until(collected, 5.0, message="stats")
    [stats] = [s for s in got if s.request_id == request_id]
    return stats


@pytest.mark.parametrize(("p_tp", "d_tp", "p_bs", "d_bs", "first_token", "num_tokens"), [
    (2, 1, 16, 32, 3, 50),  # heads from two P ranks; re-blocked; from inside a block
    (1, 2, 16, 32, 0, 37),  # each D rank its half of P's heads; a partial last block
    (2, 1, 32, 16, 20, 30),  # D blocks smaller than P's
], ids=["tp2to1-bs16to32-first3", "tp1to2-bs16to32", "tp2to1-bs32to16-first20"])
def test_staged_reads_move_split_planes_token_for_token(
    agents: Agents, p_tp: int, d_tp: int, p_bs: int, d_bs: int, first_token: int,
    num_tokens: int,
) -> None:
    kv = model_kv(p_bs, seed=3)
    p_ranks = [rank_planes(kv, p_tp, r) for r in range(p_tp)]
    d_ranks = [[torch.zeros(NUM_BLOCKS, d_bs, HEADS // d_tp, HEAD_DIM, dtype=torch.bfloat16)
                for _ in range(PLANES)] for _ in range(d_tp)]
    servers = [agents.start("p", split_topology(p_tp, p_bs), r, p_ranks[r], **UCX_ONLY)
               for r in range(p_tp)]
    readers = [agents.start("d", split_topology(d_tp, d_bs), r, d_ranks[r], **UCX_ONLY)
               for r in range(d_tp)]
    end = first_token + num_tokens
    remote_ids = [7, 2, 9, 4][: -(-end // p_bs)]
    local_ids = [5, 0, 11, 3, 8][: -(-end // d_bs)]
    stats = read(servers, readers, "staged", remote_ids, local_ids, num_tokens, first_token)
    assert [(s.ok, s.num_direct) for s in stats] == [(True, 0)] * d_tp, stats
    want = tokens_of(p_ranks, remote_ids)
    got = tokens_of(d_ranks, local_ids)
    assert torch.equal(got[:, first_token:end], want[:, first_token:end])
    assert not got[:, :first_token].any() and not got[:, end:].any()  # nothing else landed
    untouched = [b for b in range(NUM_BLOCKS) if b not in local_ids]
    assert not any(plane[untouched].any() for rank in d_ranks for plane in rank)


DIRECT_PATHS: dict[str, dict[str, object]] = {
    "same-host-board": dict(local_copy_min_nbytes=0),  # on the grant board's word
    "same-host-go": dict(local_copy_min_nbytes=0, grant_board=False,  # asks: CopyGo
                         inline_copy_max_nbytes=0),
    "ucx-direct": UCX_ONLY,
}


@linux_only
@pytest.mark.parametrize("path", sorted(DIRECT_PATHS))
def test_direct_reads_copy_each_plane_at_its_own_address(agents: Agents, path: str) -> None:
    kv = model_kv(16, seed=4)
    p_planes = rank_planes(kv, 1, 0)
    d_planes = [torch.zeros_like(p) for p in p_planes]
    config = DIRECT_PATHS[path]
    server = agents.start("p", split_topology(), 0, p_planes, **config)
    reader = agents.start("d", split_topology(), 0, d_planes, **config)
    # tokens [16, 56): from block 1 on (block 0 a local hit), a partial last block
    remote_ids, local_ids = [7, 2, 9, 4], [5, 0, 11, 3]
    [stats] = read([server], [reader], "direct", remote_ids, local_ids, 40, 16)
    assert stats.ok and stats.num_direct == 1, stats
    assert stats.num_local_copies == (0 if path == "ucx-direct" else 1), stats
    got, want = tokens_of([d_planes], local_ids), tokens_of([p_planes], remote_ids)
    assert torch.equal(got[:, 16:56], want[:, 16:56])
    assert not got[:, :16].any()
    untouched = [b for b in range(NUM_BLOCKS) if b not in local_ids]
    assert not any(plane[untouched].any() for plane in d_planes)


@pytest.mark.parametrize("reader_split", [True, False], ids=["split-reader", "split-server"])
def test_split_and_pair_caches_refuse_each_other_at_the_handshake(
    agents: Agents, reader_split: bool,
) -> None:
    split = split_topology()
    pairs = dataclasses.replace(split, split_kv=False)  # PLANES layers of K/V pairs
    split_caches = [torch.zeros(NUM_BLOCKS, 16, HEADS, HEAD_DIM, dtype=torch.bfloat16)
                    for _ in range(PLANES)]
    pair_caches = [torch.zeros(2, NUM_BLOCKS, 16, HEADS, HEAD_DIM, dtype=torch.bfloat16)
                   for _ in range(PLANES)]
    d_topo, d_caches, p_topo, p_caches = split, split_caches, pairs, pair_caches
    if not reader_split:
        d_topo, d_caches, p_topo, p_caches = pairs, pair_caches, split, split_caches
    server = agents.start("p", p_topo, 0, p_caches)
    reader = agents.start("d", d_topo, 0, d_caches)
    [stats] = read([server], [reader], "refused", [1], [2], 16, 0)
    assert not stats.ok
    assert "this reader's KV cache and the server's differ (split_kv: local " \
           f"{reader_split} != remote {not reader_split}):" in stats.error, stats
    assert not any(t.any() for t in d_caches)
