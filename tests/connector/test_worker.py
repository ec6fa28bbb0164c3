"""ConnectorWorker set-up: cache layout detection, the agent's address, misuse."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbridge.connector.metadata import ConnectorMetadata, RecvRequest
from kvbridge.connector.worker import ConnectorWorker
from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.protocol.security import CompatInfo


def make_worker(layout: KVLayout, host_buffer: bool = False) -> ConnectorWorker:
    topo = EngineTopology(tp_size=2, pp_size=1, block_size=16, num_kv_heads=8, is_mla=False,
                          layout=layout, num_layers=2)
    compat = CompatInfo("m", "float32", 8, 4, 2, layout, 16, False)
    return ConnectorWorker("e", topo, 1, 0, compat, host="127.0.0.1", base_port=0, secret=None,
                           host_buffer=host_buffer)


@pytest.fixture
def workers() -> Iterator[list[ConnectorWorker]]:
    made: list[ConnectorWorker] = []
    yield made
    for worker in made:
        worker.shutdown()
        worker.shutdown()  # idempotent


def test_prefers_hnd() -> None:
    assert ConnectorWorker.prefers_layout() is KVLayout.HND


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
def test_contiguous_caches_and_transposed_views_register(
    workers: list[ConnectorWorker], layout: KVLayout
) -> None:
    # 4 heads per rank (8 over TP 2), block size 16
    shape = (2, 10, 16, 4, 4) if layout is KVLayout.NHD else (2, 10, 4, 16, 4)
    for view in (False, True):
        caches = [torch.zeros(shape) for _ in range(2)]
        if view:  # memory in `layout`, seen through the other logical order
            caches = [t.transpose(2, 3) for t in caches]
        worker = make_worker(layout, host_buffer=view)
        workers.append(worker)
        worker.register_kv_caches(caches)
        meta = worker.handshake_metadata
        assert meta is not None and meta.port > 0 and meta.global_rank == 1
        assert (meta.layout, meta.block_size, meta.num_blocks) == (str(layout), 16, 10)
        out = worker.get_output()
        assert out.is_empty()


def test_wrong_layout_is_rejected(workers: list[ConnectorWorker]) -> None:
    worker = make_worker(KVLayout.HND)
    workers.append(worker)
    with pytest.raises(ConfigError, match="not a HND cache"):
        worker.register_kv_caches([torch.zeros(2, 10, 16, 4, 4)] * 2)  # NHD memory
    with pytest.raises(ConfigError, match="not a HND cache"):
        worker.register_kv_caches([torch.zeros(2, 10, 4, 32, 4)] * 2)  # block size 32
    with pytest.raises(ConfigError, match="register_kv_caches must be called first"):
        worker.start_load_kv(ConnectorMetadata())


def test_read_that_cannot_start_is_reported_failed(workers: list[ConnectorWorker]) -> None:
    worker = make_worker(KVLayout.NHD)
    workers.append(worker)
    worker.register_kv_caches([torch.zeros(2, 10, 16, 4, 4)] * 2)
    recv = RecvRequest(
        request_id="r", local_block_ids=[3], first_token=0, num_tokens=40,  # needs 3 blocks
        remote_engine_id="p", remote_host="127.0.0.1", remote_port=5600, remote_tp_size=1,
        remote_pp_size=1, remote_block_size=16, remote_block_ids=[1, 2, 3], grant="g" * 22,
        kv_digest=bytes(32),
    )
    worker.start_load_kv(ConnectorMetadata(reqs_to_recv=[recv]))
    worker.wait_for_save()
    out = worker.get_output()
    assert out.finished_recving == {"r"} and out.invalid_block_ids == {3}
    assert worker.take_failed_recving() == {"r"} and worker.take_failed_recving() == set()


def test_a_read_that_names_missing_blocks_fails_per_request(
    workers: list[ConnectorWorker],
) -> None:
    # several KV cache groups: a load whose blocks P does not all hold, or that
    # has nothing it could read, is reported received and failed (vLLM then
    # recomputes or fails the request), never as a load that went well
    worker = make_worker(KVLayout.NHD)
    workers.append(worker)
    worker.register_kv_caches([torch.zeros(2, 10, 16, 4, 4)] * 2)
    empty = RecvRequest(
        request_id="empty", local_block_ids=[], first_token=0, num_tokens=0,
        remote_engine_id="p", remote_host="127.0.0.1", remote_port=5600, remote_tp_size=1,
        remote_pp_size=1, remote_block_size=16, remote_block_ids=[], grant="g" * 22,
        kv_digest=bytes(32), missing_block_ids=[4, 5],
    )
    worker.start_load_kv(ConnectorMetadata(reqs_to_recv=[empty]))
    worker.wait_for_save()
    out = worker.get_output()
    assert out.finished_recving == {"empty"} and out.invalid_block_ids == {4, 5}
    assert worker.take_failed_recving() == {"empty"}
