"""ConnectorScheduler on its own: token arithmetic, metadata, request ends, failures, stats.

A real ``KVCacheManager`` allocates the blocks and requests are admitted as the
engine admits them (``RemoteKVTracker``, through ``helpers.admit``); worker
outputs are written by hand (the multi-process tests run real workers).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvbridge.connector.metadata import ConnectorMetadata
from kvbridge.connector.outputs import TransferStats, WorkerOutput
from kvbridge.connector.params import KVTransferParams
from kvbridge.connector.scheduler import ConnectorScheduler, StepOutcome
from kvbridge.errors import ConfigError
from kvbridge.reference.paged.manager import KVCacheManager
from tests.connector.helpers import (
    NOW,
    TOKENS,
    admit,
    manager,
    remote,
    request,
    scheduler,
    topology,
)


def cache_prefix(mgr: KVCacheManager, tokens: list[int], block_size: int = 16) -> None:
    """A finished local request leaves ``tokens``' full blocks in the prefix cache."""
    warm = request("warm", tokens, None, block_size)
    assert mgr.allocate_slots(warm, len(tokens)) is not None
    mgr.free(warm)


@pytest.mark.parametrize(
    ("num_prompt", "num_remote", "num_cached", "expected"),
    [
        (40, 40, 0, (0, 39)),  # load all but the last prompt token
        (5, 5, 0, (0, 4)),  # shorter than one block
        (40, 30, 0, (0, 30)),  # P computed fewer tokens: D computes the rest
        (70, 70, 40, (32, 37)),  # partial local hit (2 full blocks)
        (33, 33, 40, (32, 0)),  # full local hit: nothing to load
        (1, 1, 0, (0, 0)),  # a one-token prompt is computed on D
    ],
)
def test_tokens_to_load(num_prompt: int, num_remote: int, num_cached: int,
                        expected: tuple[int, int]) -> None:
    conn, mgr = scheduler(), manager()
    if num_cached:
        cache_prefix(mgr, TOKENS[:num_cached])
    req = request("r", TOKENS[:num_prompt], remote(num_remote))
    assert admit(conn, mgr, req) == expected
    meta = conn.build_connector_meta()
    if expected[1]:
        (recv,) = meta.reqs_to_recv
        assert (recv.first_token, recv.num_tokens) == expected
        assert recv.local_block_ids == mgr.get_block_ids("r")[0][: math.ceil(sum(expected) / 16)]
        assert recv.remote_block_ids == remote(num_remote).remote_block_ids
        assert meta.reqs_to_notify == []
    else:  # P is told at once that its blocks are not needed
        assert meta.reqs_to_recv == []
        (notice,) = meta.reqs_to_notify
        assert (notice.grant, notice.ok, notice.remote_port) == ("g" * 22, True, 5600)
    assert conn.build_connector_meta().is_empty()  # each item is sent once


def test_block_size_mismatch_aligns_the_read() -> None:
    # D blocks of 16, P blocks of 32, D has 16 tokens cached: the read starts in
    # the middle of P's first block
    conn, mgr = scheduler(16), manager(16)
    cache_prefix(mgr, TOKENS[:20])
    req = request("r", TOKENS[:70], remote(70, block_size=32))
    num_local, num_ext = admit(conn, mgr, req)
    assert (num_local, num_ext) == (16, 70 - 1 - 16)
    (recv,) = conn.build_connector_meta().reqs_to_recv
    assert (recv.first_token, recv.remote_block_size, recv.remote_block_ids) == (
        16, 32, [100, 101, 102])
    assert recv.local_block_ids == mgr.get_block_ids("r")[0][:5]
    # D blocks of 32, P blocks of 16: every D boundary is a P boundary
    conn, mgr = scheduler(32), manager(32)
    cache_prefix(mgr, TOKENS[:40], 32)
    assert admit(conn, mgr, request("r", TOKENS[:70], remote(70, 16), 32)) == (32, 37)


def test_each_request_loads_at_most_once() -> None:
    conn, mgr = scheduler(), manager()
    req = request("r", TOKENS[:40], remote(40))
    assert conn.get_num_new_matched_tokens(req, 0) == (39, True)
    assert conn.get_num_new_matched_tokens(req, 0) == (39, True)  # retry before allocation
    admit(conn, mgr, req)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # loading
    conn.build_connector_meta()
    assert conn.update_connector_output(WorkerOutput(finished_recving={"r"})) == StepOutcome(
        {"r": None}, frozenset())
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # e.g. after preemption
    # and a loaded request is never held for another reader
    assert conn.request_finished(req, mgr.get_block_ids("r")[0]) == (False, None)


def test_expired_params_prefill_locally_and_tell_p() -> None:
    conn = scheduler()
    req = request("r", TOKENS[:40], remote(40, expires_at=NOW - 1))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = conn.build_connector_meta()  # P may hold it still (clocks differ): let it go
    assert (meta.reqs_to_recv, [n.ok for n in meta.reqs_to_notify]) == ([], [False])
    assert conn.get_stats().num_params_refused == 1


def test_prefill_finish_holds_blocks_and_returns_params() -> None:
    conn, mgr = scheduler(lease_s=12.0), manager()
    req = request("r", TOKENS[:40], KVTransferParams(do_remote_decode=True))
    mgr.allocate_slots(req, 40)
    block_ids = mgr.get_block_ids("r")[0]
    delay, params = conn.request_finished(req, block_ids)
    assert delay and params is not None
    assert params.do_remote_prefill and not params.do_remote_decode
    assert (params.remote_engine_id, params.remote_host, params.remote_port) == (
        "me", "10.0.0.2", 7000)
    assert (params.remote_tp_size, params.remote_block_size, params.remote_num_tokens) == (
        2, 16, 40)
    assert params.remote_block_ids == block_ids and params.expires_at == NOW + 12.0
    assert params.grant is not None and len(params.grant) >= 22
    assert conn.num_held_blocks == 3 and conn.has_pending_work()
    (send,) = conn.build_connector_meta().reqs_to_send
    assert (send.request_id, send.block_ids, send.grant, send.lease_s) == (
        "r", block_ids, params.grant, 12.0)
    # readers done on every worker (aggregated): the engine frees the blocks
    outcome = conn.update_connector_output(WorkerOutput(finished_sending={"r"}))
    assert outcome == StepOutcome({}, frozenset({"r"}))
    assert conn.num_held_blocks == 0 and not conn.has_pending_work()
    stats = conn.get_stats()
    assert (stats.num_grants_issued, stats.num_grants_released) == (1, 1)


@pytest.mark.parametrize(
    ("params", "aborted", "role"),
    [
        (KVTransferParams(do_remote_decode=True), True, "both"),  # aborted: free now
        (None, False, "both"),
        (KVTransferParams(), False, "both"),
        (KVTransferParams(do_remote_decode=True), False, "decode"),  # decode-only engine
    ],
)
def test_no_hold(params: KVTransferParams | None, aborted: bool, role: Any) -> None:
    conn, mgr = scheduler(role=role), manager()
    req = request("r", TOKENS[:40], params)
    mgr.allocate_slots(req, 40)
    assert conn.request_finished(req, mgr.get_block_ids("r")[0], aborted=aborted) == (
        False, None)
    assert conn.build_connector_meta().is_empty()


def test_one_token_prompt_is_not_held() -> None:
    conn, mgr = scheduler(), manager()
    req = request("r", TOKENS[:1], KVTransferParams(do_remote_decode=True))
    mgr.allocate_slots(req, 1)
    assert conn.request_finished(req, mgr.get_block_ids("r")[0]) == (False, None)


def notices(meta: ConnectorMetadata) -> list[tuple[str, bool]]:
    return [(n.request_id, n.ok) for n in meta.reqs_to_notify]


def test_abort_on_d_before_and_after_the_load_started() -> None:
    conn, mgr = scheduler(), manager()
    # never scheduled: P is told it may free
    idle = request("idle", TOKENS[:40], remote(40))
    assert conn.request_finished(idle, [], aborted=True) == (False, None)
    # allocated but the metadata not built yet: no worker touched the blocks
    early = request("early", TOKENS[:40], remote(40))
    admit(conn, mgr, early)
    assert conn.request_finished(early, mgr.get_block_ids("early")[0], aborted=True) == (
        False, None)
    meta = conn.build_connector_meta()
    assert meta.reqs_to_recv == []
    assert notices(meta) == [("idle", False), ("early", False)]
    # dispatched: the blocks stay until the workers are done with them
    late = request("late", TOKENS[:40], remote(40))
    admit(conn, mgr, late)
    assert len(conn.build_connector_meta().reqs_to_recv) == 1
    assert conn.request_finished(late, mgr.get_block_ids("late")[0], aborted=True) == (
        True, None)
    outcome = conn.update_connector_output(WorkerOutput(finished_recving={"late"}))
    assert outcome.loads_ended == {}  # never exposed as loaded
    assert outcome.to_free == {"late"}  # the engine frees it now
    assert not conn.has_pending_work()


def test_failed_load_rolls_back_to_the_first_bad_block() -> None:
    conn, mgr = scheduler(), manager()
    cache_prefix(mgr, TOKENS[:20])
    req = request("r", TOKENS[:80], remote(80))
    assert admit(conn, mgr, req) == (16, 63)
    conn.build_connector_meta()
    block_ids = mgr.get_block_ids("r")[0]
    # one worker reports the failure this step, the last worker finishes the next
    outcome = conn.update_connector_output(WorkerOutput(invalid_block_ids=set(block_ids[2:5])))
    assert outcome == StepOutcome({}, frozenset())
    outcome = conn.update_connector_output(WorkerOutput(
        finished_recving={"r"}, stats=TransferStats(num_failures=2)))
    assert outcome.loads_ended == {"r": 2 * 16}  # the first bad block's first token
    stats = conn.get_stats()
    assert (stats.num_loads_failed, stats.num_failures) == (1, 2)


def test_successful_load_needs_no_rollback() -> None:
    conn, mgr = scheduler(), manager()
    req = request("r", TOKENS[:40], remote(40))
    admit(conn, mgr, req)
    conn.build_connector_meta()
    outcome = conn.update_connector_output(WorkerOutput(finished_recving={"r"}))
    assert outcome.loads_ended == {"r": None}


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ConfigError, match="block_size 32 != topology block size 16"):
        ConnectorScheduler("e", "both", topology(16), "h", 7000, 32, lease_s=1.0)
    with pytest.raises(ConfigError, match="role"):
        ConnectorScheduler("e", "server", topology(), "h", 7000, 16, lease_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="base_port 65535"):
        ConnectorScheduler("e", "both", topology(), "h", 65535, 16, lease_s=1.0)
    with pytest.raises(ConfigError, match="lease_s"):
        ConnectorScheduler("e", "both", topology(), "h", 7000, 16, lease_s=0.0)


def test_update_state_checks_the_blocks() -> None:
    conn, mgr = scheduler(), manager()
    req = request("r", TOKENS[:40], remote(40))
    assert conn.get_num_new_matched_tokens(req, 0) == (39, True)
    with pytest.raises(ConfigError, match="need 3 blocks"):
        conn.update_state_after_alloc(req, mgr.empty_blocks(), 39)
    with pytest.raises(ConfigError, match="planned 39"):
        conn.update_state_after_alloc(req, mgr.empty_blocks(), 40)
    # the engine may still decide to prefill locally: P is told
    conn.update_state_after_alloc(req, mgr.empty_blocks(), 0)
    assert notices(conn.build_connector_meta()) == [("r", True)]


def test_prometheus_exposition() -> None:
    conn, mgr = scheduler(), manager()
    req = request("r", TOKENS[:40], KVTransferParams(do_remote_decode=True))
    mgr.allocate_slots(req, 40)
    conn.request_finished(req, mgr.get_block_ids("r")[0])
    conn.update_connector_output(WorkerOutput(stats=TransferStats(
        num_transfers=2, nbytes=4096, durations_s=[0.003, 0.2], num_failures=1)))
    text = conn.get_stats().to_prometheus("kvb")
    lines = text.splitlines()
    assert "kvb_kv_transfers_total 2.0" in lines  # prometheus_client writes floats
    assert "kvb_kv_transfer_bytes_total 4096.0" in lines
    assert "kvb_kv_transfer_failures_total 1.0" in lines
    assert "kvb_kv_held_blocks 3.0" in lines
    assert 'kvb_kv_transfer_seconds_bucket{le="0.0025"} 0.0' in lines
    assert 'kvb_kv_transfer_seconds_bucket{le="0.005"} 1.0' in lines
    assert 'kvb_kv_transfer_seconds_bucket{le="0.25"} 2.0' in lines
    assert 'kvb_kv_transfer_seconds_bucket{le="+Inf"} 2.0' in lines
    assert "kvb_kv_transfer_seconds_count 2.0" in lines
    assert "# TYPE kvb_kv_transfer_seconds histogram" in lines
    assert text.endswith("\n")
