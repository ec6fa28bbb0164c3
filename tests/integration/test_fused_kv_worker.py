"""``ConnectorWorker`` with vLLM CPU (fused K/V) caches: registration, and a real read.

Two workers in this process, each with its own transfer agent on loopback. The
caches are what vLLM's CPU backend registers: one contiguous ``[num_blocks,
num_kv_heads, block_size, 2 * head_size]`` tensor per layer, all views of one
storage. Host-buffer mode stages them through a host copy with ``copy_blocks``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbridge.connector.binding import kv_digest
from kvbridge.connector.metadata import ConnectorMetadata, RecvRequest, SendRequest
from kvbridge.connector.worker import ConnectorWorker
from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.agent import AgentConfig
from kvbridge.transfer.protocol.security import CompatInfo
from tests.connector.helpers import wait_finished

pytestmark = pytest.mark.integration

NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, BLOCK, HEAD_SIZE = 2, 8, 2, 32, 16
FAST = AgentConfig(connect_timeout_s=2.0, handshake_timeout_s=2.0, reply_timeout_s=3.0,
                   chunk_timeout_s=3.0, heartbeat_s=0.5, read_timeout_s=10.0,
                   local_copy_min_nbytes=0)


def make_worker(engine_id: str, host_buffer: bool = False) -> ConnectorWorker:
    topo = EngineTopology(tp_size=1, pp_size=1, block_size=BLOCK, num_kv_heads=NUM_HEADS,
                          is_mla=False, layout=KVLayout.HND, num_layers=NUM_LAYERS,
                          fused_kv=True)
    compat = CompatInfo("m", "bfloat16", NUM_HEADS, HEAD_SIZE, NUM_LAYERS, KVLayout.HND, BLOCK,
                        False, fused_kv=True)
    return ConnectorWorker(engine_id, topo, 0, 0, compat, host="127.0.0.1", base_port=0,
                           secret=None, host_buffer=host_buffer, agent_config=FAST)


def cpu_caches(seed: int | None) -> list[torch.Tensor]:
    """Per-layer views of one storage, random bf16 (zeros when ``seed`` is None)."""
    shape = (NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, BLOCK, 2 * HEAD_SIZE)
    if seed is None:
        return list(torch.zeros(shape, dtype=torch.bfloat16).unbind(0))
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randn(shape, generator=gen).to(torch.bfloat16).unbind(0))


@pytest.fixture
def workers() -> Iterator[list[ConnectorWorker]]:
    made: list[ConnectorWorker] = []
    yield made
    for worker in made:
        worker.shutdown()


def test_fused_caches_register_as_they_are(workers: list[ConnectorWorker]) -> None:
    worker = make_worker("e")
    workers.append(worker)
    worker.register_kv_caches(cpu_caches(1))
    meta = worker.handshake_metadata
    assert meta is not None and meta.port > 0
    assert (meta.layout, meta.block_size, meta.num_blocks) == ("HND", BLOCK, NUM_BLOCKS)


@pytest.mark.parametrize(("caches", "match"), [
    ([t.transpose(1, 2) for t in cpu_caches(1)], "not a contiguous fused K/V cache"),
    (list(torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, NUM_HEADS, BLOCK, HEAD_SIZE).unbind(0)),
     "not a contiguous fused K/V cache"),
    (list(torch.zeros(NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, 16, 2 * HEAD_SIZE).unbind(0)),
     "block size 32"),
    (list(torch.zeros(NUM_LAYERS, NUM_BLOCKS, 4, BLOCK, 2 * HEAD_SIZE).unbind(0)), "2 heads"),
])
def test_caches_that_are_not_fused_are_refused(
    workers: list[ConnectorWorker], caches: list[torch.Tensor], match: str,
) -> None:
    worker = make_worker("e")
    workers.append(worker)
    with pytest.raises(ConfigError, match=match):
        worker.register_kv_caches(caches)


@pytest.mark.parametrize("host_buffer", [False, True])
def test_workers_move_fused_blocks_exactly(
    workers: list[ConnectorWorker], host_buffer: bool,
) -> None:
    p, d = make_worker("p-cpu", host_buffer), make_worker("d-cpu", host_buffer)
    workers.extend([p, d])
    p_caches, d_caches = cpu_caches(7), cpu_caches(None)
    p.register_kv_caches(p_caches)
    d.register_kv_caches(d_caches)
    tokens, p_blocks, d_blocks = list(range(100, 170)), [5, 1, 6], [2, 7, 0]  # 70 tokens
    digest = kv_digest(tokens, p_blocks)
    p.start_load_kv(ConnectorMetadata(reqs_to_send=[SendRequest(
        request_id="p-r", block_ids=p_blocks, grant="G" * 22, lease_s=30.0, kv_digest=digest)]))
    p.wait_for_save()
    assert p.handshake_metadata is not None
    d.start_load_kv(ConnectorMetadata(reqs_to_recv=[RecvRequest(
        request_id="d-r", local_block_ids=d_blocks, first_token=0, num_tokens=69,
        remote_engine_id="p-cpu", remote_host="127.0.0.1", remote_port=p.handshake_metadata.port,
        remote_tp_size=1, remote_pp_size=1, remote_block_size=BLOCK, remote_block_ids=p_blocks,
        grant="G" * 22, kv_digest=digest,
    )]))
    d.wait_for_save()
    assert wait_finished(d, "d-r", recving=True) == set()
    landed, sent = torch.stack(d_caches)[:, d_blocks], torch.stack(p_caches)[:, p_blocks]
    assert torch.equal(landed.view(torch.int16), sent.view(torch.int16))
    assert not torch.stack(d_caches)[:, [1, 3, 4, 5, 6]].view(torch.int16).any()
    assert wait_finished(p, "p-r", recving=False) == set()
