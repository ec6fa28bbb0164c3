"""Smoke tests of the benchmark peers and the workload they share.

The workload's verify must catch misplaced, torn and stray blocks (else a
peer's ``verified=True`` means nothing). ``ucx_perftest`` comes with the
libucx wheel kvbridge depends on, so it must run. NIXL and Mooncake are
optional: absent or unable to start, they are skipped with the reason; when
they do run, every byte must verify.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.bench.peers import (
    KVShape,
    KVWorkload,
    PeerResult,
    Unavailable,
    WorkloadError,
    run_named_peer,
    sizes_for_blocks,
)
from kvbridge.bench.peers.harness import PeerRunError, run_pair, workload_spec
from kvbridge.bench.peers.results import summarize
from kvbridge.bench.peers.ucx_perftest import PerftestError, _parse_final_csv, run_perftest

SMALL_SHAPE = KVShape(num_kv_heads=2, head_dim=16, block_size=4)  # 512 B blocks


def _copy_blocks(workload: KVWorkload, src: np.ndarray, dst: np.ndarray,
                 remote_ids: np.ndarray, local_ids: np.ndarray) -> None:
    """What a correct transfer does, by hand."""
    block = workload.block_nbytes
    for r, loc in zip(remote_ids, local_ids, strict=True):
        dst[loc * block:(loc + 1) * block] = src[r * block:(r + 1) * block]


@settings(max_examples=25, deadline=None)
@given(num_pool_blocks=st.integers(1, 40), data=st.data())
def test_verify_accepts_exact_copy_and_catches_any_flipped_byte(
    num_pool_blocks: int, data: st.DataObject
) -> None:
    workload = KVWorkload(num_pool_blocks=num_pool_blocks, shape=SMALL_SHAPE, seed=7)
    num_blocks = data.draw(st.integers(1, num_pool_blocks))
    remote_ids, local_ids = workload.block_ids(num_blocks)
    src, dst = workload.new_pool(), workload.new_pool()
    workload.fill_source(src)
    _copy_blocks(workload, src, dst, remote_ids, local_ids)
    assert workload.verify(dst, remote_ids, local_ids) == 0

    offset = data.draw(st.integers(0, dst.size - 1))
    dst[offset] ^= 0x01
    assert workload.verify(dst, remote_ids, local_ids) == 1


def test_verify_catches_swapped_blocks_and_stray_writes() -> None:
    workload = KVWorkload(num_pool_blocks=16, shape=SMALL_SHAPE)
    remote_ids, local_ids = workload.block_ids(4)
    src, dst = workload.new_pool(), workload.new_pool()
    workload.fill_source(src)
    _copy_blocks(workload, src, dst, remote_ids, local_ids[[1, 0, 2, 3]])
    assert workload.verify(dst, remote_ids, local_ids) == 2

    dst[:] = 0
    _copy_blocks(workload, src, dst, remote_ids, local_ids)
    stray = next(i for i in range(16) if i not in set(local_ids.tolist()))
    dst[stray * workload.block_nbytes] = 1
    assert workload.verify(dst, remote_ids, local_ids) == 1


def test_block_ids_are_deterministic_unique_and_in_range() -> None:
    workload = KVWorkload.for_sizes(sizes_for_blocks([64]))
    remote_a, local_a = workload.block_ids(64)
    remote_b, local_b = workload.block_ids(64)
    assert np.array_equal(remote_a, remote_b) and np.array_equal(local_a, local_b)
    for ids in (remote_a, local_a):
        assert len(set(ids.tolist())) == 64
        assert ids.min() >= 0 and ids.max() < workload.num_pool_blocks
    assert not np.array_equal(np.sort(local_a), np.arange(64))  # really scattered


def test_default_shape_is_64_kib_blocks() -> None:
    assert KVShape().block_nbytes == 2 * 16 * 8 * 128 * 2 == 64 * 1024
    assert sizes_for_blocks([1, 1024]) == [64 * 1024, 64 * 1024 * 1024]


@pytest.mark.parametrize("nbytes", [0, 100, 64 * 1024 + 8])
def test_sizes_that_are_not_whole_blocks_are_rejected(nbytes: int) -> None:
    with pytest.raises(WorkloadError, match=str(nbytes)):
        KVWorkload.for_sizes([nbytes])


def test_request_larger_than_pool_is_rejected() -> None:
    workload = KVWorkload(num_pool_blocks=4)
    with pytest.raises(WorkloadError, match="5 blocks"):
        workload.num_blocks_for(5 * workload.block_nbytes)


def test_summarize_reports_median_rate_and_percentiles() -> None:
    result = summarize("x", 2_000_000, 2, [0.001, 0.002, 0.004], verified=True)
    assert result.gbps_median == pytest.approx(1.0)
    assert result.latency_p50_us == pytest.approx(2000.0)
    assert 2000.0 < (result.latency_p99_us or 0.0) <= 4000.0
    with pytest.raises(ValueError, match="no timed requests"):
        summarize("x", 1, 1, [], verified=True)


def test_perftest_csv_is_parsed_in_decimal_gb() -> None:
    out = ("iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,"
           "overall_mr\n500,0.217,545.844,545.844,1832.03,1000.00,1832,1832\n")
    run = _parse_final_csv(out, 1 << 20)
    assert run.num_iters == 500
    assert run.gbps_overall == pytest.approx(1000.0 * 2**20 / 1e9)
    with pytest.raises(PerftestError, match="no final CSV"):
        _parse_final_csv("Waiting for connection...\n", 1 << 20)


def test_perftest_csv_is_found_between_ucx_log_lines() -> None:
    """UCX prints warnings (an unused variable) between the header and the values."""
    warn = "[1795877025.759285] [vm:5011 :0]  parser.c:2355 UCX  WARN  unused environment"
    out = ("iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,"
           f"overall_mr\n{warn}\n{warn}\n  50,121.9,124.1,124.1,8052.65,8052.65,8053,8053\n"
           "[1795877025.853710] [vm:5011 :0]   | perftest intra-node cfg#0 | remote read |\n")
    run = _parse_final_csv(out, 1 << 20)
    assert run.num_iters == 50 and run.gbps_overall == pytest.approx(8052.65 * 2**20 / 1e9)


@pytest.mark.integration
@pytest.mark.parametrize("test", ["tag_bw", "ucp_get"])
def test_ucx_perftest_reports_positive_bandwidth(test: str) -> None:
    run = run_perftest(64 * 1024, iters=64, warmup=4, timeout_s=60.0, test=test)
    assert run.num_iters == 64 and run.gbps_overall > 0.0


@pytest.mark.integration
def test_ucx_perftest_peer_returns_one_result_per_size() -> None:
    outcome = run_named_peer("ucx_perftest", [64 * 1024], iters=1)
    assert not isinstance(outcome, Unavailable), str(outcome)
    assert [(r.peer, r.nbytes) for r in outcome] == [("ucx_perftest", 64 * 1024)]
    assert outcome[0].gbps_median > 0.0 and outcome[0].num_iters >= 64
    assert not outcome[0].verified  # the tool moves no checkable data


@pytest.mark.integration
@pytest.mark.parametrize("peer", ["nixl", "mooncake"])
def test_optional_peer_moves_verified_bytes_or_says_why_not(peer: str) -> None:
    sizes = sizes_for_blocks([1, 5], SMALL_SHAPE)
    workload = KVWorkload.for_sizes(sizes, SMALL_SHAPE, seed=3)
    outcome = run_named_peer(peer, sizes, iters=2, workload=workload)
    if isinstance(outcome, Unavailable):
        assert outcome.reason
        pytest.skip(str(outcome))
    assert [(r.peer, r.nbytes, r.num_blocks, r.num_iters) for r in outcome] == [
        (peer, sizes[0], 1, 2), (peer, sizes[1], 5, 2)]
    for result in outcome:
        assert isinstance(result, PeerResult)
        assert result.verified, result.note
        assert result.gbps_median > 0.0


@pytest.mark.integration
def test_child_failure_surfaces_as_error_not_hang() -> None:
    spec = workload_spec(KVWorkload(num_pool_blocks=1), [512], 1, 0, timeout_s=30.0)
    spec["num_pool_blocks"] = 0  # the target child rejects it before any transfer
    with pytest.raises(PeerRunError, match="num_pool_blocks"):
        run_pair("kvbridge.bench.peers.nixl_peer", spec, timeout_s=30.0)


def test_unknown_peer_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown peer"):
        run_named_peer("rdma-magic", [64 * 1024], 1)
