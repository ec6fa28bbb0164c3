"""Smoke tests of ``kvbridge bench``: files written, tables, size mapping, data checks.

No speed is asserted anywhere (numbers depend on the machine); these check that
the command runs end to end, that what it writes is complete, and that the
transfer benchmark's verification would catch a wrong block.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvbridge.bench import tables as bench_tables
from kvbridge.bench.cli import ProgressBar, build_parser
from kvbridge.bench.plots import save_plot
from kvbridge.bench.transfer_agents import CopyYardstick, _num_wrong, _words, pattern
from kvbridge.bench.transfer_bench import PIECE_NBYTES, SizePoint, run
from kvbridge.cli.main import main as kvbridge_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_paged_quick_writes_json_and_png(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert kvbridge_main(["bench", "paged", "--quick", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "paged.json").read_text())
    assert record["benchmark"] == "paged" and record["quick"] is True
    assert record["machine"]["nproc"] >= 1 and len(record["machine"]["loadavg_end"]) == 3
    steps = record["result"]["scheduler_step_256x4k_full"]
    assert steps["allocate_us_per_step_mean"] > 0
    assert (tmp_path / "paged.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr()
    assert "allocate_us_per_step_mean" in out.out  # the table
    assert "[paged 5/5]" in out.err  # plain progress lines: stderr is not a TTY here


@pytest.mark.integration  # two agent processes on loopback
def test_bench_transfer_one_size_verifies(tmp_path: Path) -> None:
    code = kvbridge_main(["bench", "transfer", "--quick", "--pieces", "1", "--peers", "",
                          "--no-plot", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "transfer.json").read_text())["result"]
    (row,) = result["systems"]["kvbridge"]
    assert row["verified"] and row["nbytes"] == PIECE_NBYTES and row["num_iters"] == 50
    assert not (tmp_path / "transfer.png").exists()


@pytest.mark.integration  # two agent processes on loopback
def test_copy_yardstick_runs_beside_kvbridge_and_verifies(tmp_path: Path) -> None:
    code = kvbridge_main(["bench", "transfer", "--quick", "--pieces", "16", "--peers",
                          "kvbridge_copy", "--no-plot", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "transfer.json").read_text())["result"]
    (row,) = result["systems"]["kvbridge_copy"]
    assert row["verified"] and row["nbytes"] == 16 * PIECE_NBYTES
    assert "bare process_vm_readv" in row["note"]
    assert result["ratios"]["kvbridge_copy"][str(16 * PIECE_NBYTES)] > 0


def test_copy_yardstick_copies_the_named_blocks_only() -> None:
    # The server's side is this process: its "remote" caches hold the pattern.
    num_layers, num_pool_blocks = 2, 6
    shape = (2, num_pool_blocks, 16, 8, 128)
    theirs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(num_layers)]
    for layer, cache in enumerate(theirs):
        _words(cache)[:] = pattern(layer, np.arange(num_pool_blocks))
    ours = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(num_layers)]
    copies = CopyYardstick(ours)
    remote_ids, local_ids = [4, 1], [0, 3]
    seconds = copies.timed(remote_ids, local_ids, os.getpid(),
                           [cache.data_ptr() for cache in theirs])
    assert isinstance(seconds, float) and seconds > 0
    assert _num_wrong(ours, np.array(remote_ids), np.array(local_ids)) == 0
    failed = copies.timed(remote_ids, local_ids, os.getpid(), [8, 8])  # unmapped: EFAULT
    assert isinstance(failed, str) and "process_vm_readv" in failed


@pytest.mark.integration  # a serving agent process and a reading agent here
def test_read_floor_times_the_read_and_its_parts_and_verifies() -> None:
    from benchmarks.read_floor import run as read_floor

    (row,) = read_floor([2], num_blocks=1, iters=10, rounds=1)  # raises on wrong bytes
    assert row["layers"] == 2 and row["nbytes"] == 2 * PIECE_NBYTES
    assert row["read_us"] > 0 and row["bare_us"] > 0 and row["copy_us"] > 0


def test_unknown_peer_is_rejected_before_running() -> None:
    with pytest.raises(ValueError, match="unknown peers"):
        run(quick=True, peers=["no-such-engine"])


@pytest.mark.parametrize(("pieces", "layers", "blocks"),
                         [(1, 1, 1), (16, 16, 1), (32, 32, 1), (64, 32, 2), (4096, 32, 128)])
def test_size_mapping_keeps_bytes_and_pieces(pieces: int, layers: int, blocks: int) -> None:
    point = SizePoint.of(pieces)
    assert (point.num_layers, point.num_blocks) == (layers, blocks)
    assert point.nbytes == layers * blocks * PIECE_NBYTES == pieces * PIECE_NBYTES


@pytest.mark.parametrize("pieces", [0, -3, 48])
def test_size_mapping_rejects_unmappable_sizes(pieces: int) -> None:
    with pytest.raises(ValueError, match=str(pieces)):
        SizePoint.of(pieces)


def test_verification_catches_wrong_and_stray_blocks() -> None:
    num_layers, num_pool_blocks = 2, 6
    caches = [torch.zeros((2, num_pool_blocks, 16, 8, 128), dtype=torch.bfloat16)
              for _ in range(num_layers)]
    remote_ids, local_ids = np.array([4, 1]), np.array([0, 3])
    for layer, cache in enumerate(caches):
        _words(cache)[:, local_ids] = pattern(layer, remote_ids)
    assert _num_wrong(caches, remote_ids, local_ids) == 0
    _words(caches[1])[1, 3, 7] ^= np.uint64(1)  # one bit of V of local block 3 in layer 1
    assert _num_wrong(caches, remote_ids, local_ids) == 1
    _words(caches[0])[0, 5, 0] = np.uint64(9)  # a block the request never named
    assert _num_wrong(caches, remote_ids, local_ids) == 2


def _transfer_report() -> dict[str, Any]:
    def row(peer: str, nbytes: int, gbps: float) -> dict[str, Any]:
        return {"peer": peer, "nbytes": nbytes, "num_blocks": nbytes // PIECE_NBYTES,
                "num_iters": 5, "gbps_median": gbps, "latency_p50_us": 100.0,
                "latency_p99_us": 200.0, "verified": True, "note": ""}

    sizes = [PIECE_NBYTES, 32 * PIECE_NBYTES]
    return {
        "workload": {"mapping": [{"nbytes": n, "kvbridge_num_layers": 1 if n == sizes[0] else 32,
                                  "kvbridge_num_blocks": 1} for n in sizes]},
        "systems": {"kvbridge": [row("kvbridge", n, 2.0) for n in sizes],
                    "nixl": [row("nixl", n, 4.0) for n in sizes],
                    "mooncake": {"peer": "mooncake", "unavailable": "libibverbs missing"}},
        "latency_1_block": {"num_layers": 32, "nbytes": sizes[1], "p50_us": 100.0,
                            "p99_us": 200.0},
    }


def test_transfer_table_shows_ratio_and_unavailable_peer() -> None:
    table = bench_tables.transfer_table(_transfer_report())
    assert "x nixl" in table and table.splitlines()[2].endswith(" 0.500 |")  # 2 vs 4 GB/s
    assert "mooncake: unavailable: libibverbs missing" in table
    assert "p50 0.10 ms" in table


def test_transfer_plot_is_a_png(tmp_path: Path) -> None:
    save_plot("transfer", _transfer_report(), tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC


def test_unverified_bytes_fail_the_run() -> None:
    report = _transfer_report()
    assert bench_tables.passed("transfer", report)
    report["systems"]["nixl"][1]["verified"] = False
    assert not bench_tables.passed("transfer", report)


def test_markdown_table_aligns_and_formats() -> None:
    table = bench_tables.markdown_table(["a", "bb"], [[1.23456, None], ["x", 0.5]])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert "1.23" in table and "0.500" in table and "-" in lines[2]


def test_progress_prints_plain_lines_when_not_a_tty() -> None:
    stream = io.StringIO()
    progress = ProgressBar("demo", stream)
    progress("first", 1, 2)
    progress("second", 2, 2)
    progress.close()
    assert [line.split(" (")[0] for line in stream.getvalue().splitlines()] == [
        "[demo 1/2] first", "[demo 2/2] second"]


@pytest.mark.parametrize("bad", ["0,1", "a", ""])
def test_bad_size_lists_are_rejected(bad: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["transfer", "--pieces", bad])
