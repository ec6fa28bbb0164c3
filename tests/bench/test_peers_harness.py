"""The pieces every peer shares: ``PairPeer.run``'s checks and the stand-alone CLI."""

from __future__ import annotations

import argparse

import pytest

from kvbridge.bench.peers import KVShape, KVWorkload, PeerResult, Unavailable, sizes_for_blocks
from kvbridge.bench.peers.cli import standalone_main
from kvbridge.bench.peers.harness import PairPeer
from kvbridge.bench.peers.results import PeerOutcome
from kvbridge.bench.peers.workload import WorkloadError

SHAPE = KVShape(num_kv_heads=2, head_dim=16, block_size=4)
ABSENT = PairPeer("absent", "kvbridge.bench.peers.absent_peer", "kvbridge_no_such_package",
                  missing="not installed here", min_gbps=1.0)


def test_a_missing_package_is_reported_not_raised() -> None:
    sizes = sizes_for_blocks([1], SHAPE)
    outcome = ABSENT.run(sizes, iters=1, workload=KVWorkload.for_sizes(sizes, SHAPE))
    assert outcome == Unavailable("absent", "not installed here")


@pytest.mark.parametrize("iters, warmup", [(0, 0), (1, -1)])
def test_bad_counts_are_rejected_before_anything_runs(iters: int, warmup: int) -> None:
    with pytest.raises(ValueError, match=f"iters={iters} warmup={warmup}"):
        ABSENT.run(sizes_for_blocks([1]), iters=iters, warmup=warmup)


def test_sizes_that_do_not_fit_the_workload_are_rejected() -> None:
    workload = KVWorkload(num_pool_blocks=2, shape=SHAPE)
    with pytest.raises(WorkloadError, match="3 blocks"):
        ABSENT.run(sizes_for_blocks([3], SHAPE), iters=1, workload=workload)


def _result(nbytes: int) -> PeerResult:
    return PeerResult(peer="fake", nbytes=nbytes, num_blocks=nbytes // (64 << 10), num_iters=2,
                      gbps_median=1.5, latency_p50_us=3.0, latency_p99_us=4.0, verified=True)


def test_standalone_cli_prints_a_row_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[list[int], int, str]] = []

    def add_flag(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--flavour", default="plain")

    def run(sizes: list[int], iters: int, opts: argparse.Namespace) -> PeerOutcome:
        seen.append((sizes, iters, opts.flavour))
        return [_result(n) for n in sizes]

    code = standalone_main(["--blocks", "1,4", "--iters", "3", "--flavour", "x"], "fake", run,
                           add_flag)
    assert code == 0
    assert seen == [([64 << 10, 256 << 10], 3, "x")]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [str(_result(64 << 10)), str(_result(256 << 10))]


def test_standalone_cli_exits_1_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    def run(sizes: list[int], iters: int, opts: argparse.Namespace) -> PeerOutcome:
        return Unavailable("fake", "no such library")

    assert standalone_main(["--blocks", "1"], "fake", run) == 1
    assert "no such library" in capsys.readouterr().out
