"""``scripts/gpu_probe.sh`` / ``benchmarks.gpu_probe`` without a GPU (issue #41, item 4).

The probe's numbers need a GPU (docs/benchmarks.md, "GPU"); here its CPU dry run,
run once for the module: every line there, in the order the issue asks (UCX's own
numbers, then the reads most wanted first, then the host-staged read), each with
positive numbers and verified bytes, or a well-formed ``skipped``; the guard that
turns a failure, a hung measurement or a spent deadline into a line and goes on;
bad arguments refused with exit 2; the trace summary and UCX's log lines read as
they are written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_probe
from benchmarks.chunk_traces import TraceTail
from benchmarks.gpu_check import GpuCheckError
from benchmarks.probe_ucx import ucx_lines
from kvbridge.transfer.agent_config import AgentConfig

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_probe.sh"
#: the dry run's reads: 1 and 2 MiB, 2 MiB first for the first variants
FIRST = ["baseline", "loop-launch", "thread-launch"]
ALL = ["baseline", "chunk8m", "window8", "frag-host", "loop-launch", "thread-launch",
       "get-zcopy-ipc"]
EXPECTED = (
    [("environment",)]
    + [("ucx_perftest", test, 2, zcopy, False) for test in ("ucp_get", "tag_bw")
       for zcopy in (False, True)]
    + [("ucx_perftest", "ucp_get", 2, zcopy, True) for zcopy in (False, True)]
    + [("kvbridge-read", variant, 2) for variant in FIRST]
    + [("kvbridge-read", variant, mib) for variant in ALL for mib in (1, 2)
       if (variant, mib) not in {(v, 2) for v in FIRST}]
    + [("host-staged", 2)]
)


def script(*args: str) -> subprocess.CompletedProcess[str]:
    # As from a fresh shell on the device: without the UCX_ variables ``import ucxx``
    # left in this process's environment (another test imported it), which would hide
    # what ucxx sets from the probe's environment line.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("UCX_")},
           "PY": sys.executable, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def identity(line: dict[str, Any]) -> tuple[Any, ...]:
    match line["measure"]:
        case "ucx_perftest":
            return (line["measure"], line["test"], line["mib"], line["get_zcopy_ipc"],
                    line["error_handling"])
        case "kvbridge-read":
            return (line["measure"], line["variant"], line["mib"])
        case "host-staged":
            return (line["measure"], line["mib"])
    return (line["measure"],)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("probe")
    result = script("--cpu-dry-run", "--out", str(out))
    lines = [json.loads(raw) for raw in (out / "gpu_probe.jsonl").read_text().splitlines()]
    return result, lines, out


def test_dry_run_writes_every_line_in_order(dry_run: Any) -> None:
    result, lines, out = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [identity(line) for line in lines] == EXPECTED
    assert not [line for line in lines if "error" in line]
    assert "gpu_probe:" in result.stdout and "host-staged 2 MiB" in result.stdout
    assert (out / "gpu_probe.log").stat().st_size > 0  # the children's output


def test_ucx_perftest_lines_carry_kvbridge_environment_and_protocols(dry_run: Any) -> None:
    _, lines, _ = dry_run
    environment = lines[0]
    assert environment["ucxx_env"]["UCX_RNDV_FRAG_MEM_TYPE"] == "cuda"
    assert environment["ucxx_env"]["UCX_RNDV_THRESH"] == "8192"
    perftests = [line for line in lines if line["measure"] == "ucx_perftest"]
    assert [line["error_handling"] for line in perftests] == [False] * 4 + [True] * 2
    for line in perftests:
        assert line["gbps"] > 0 and line["iters"] >= 20 and line["memory"] == "host"
        env = line["env"]
        assert env["UCX_PROTO_INFO"] == "used" and env["UCX_TLS"] == environment["kvbridge_tls"]
        assert {k: env[k] for k in environment["ucxx_env"]} == environment["ucxx_env"]
        assert ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in env) == line["get_zcopy_ipc"]
        assert line["proto"] and all(row.startswith("|") for row in line["proto"])
        assert isinstance(line["ucx_warnings"], list)


def test_reads_are_verified_with_their_variant_and_trace(dry_run: Any) -> None:
    _, lines, _ = dry_run
    knob = "staged_launch" in AgentConfig.__struct_fields__
    for line in lines:
        if line["measure"] in ("environment", "ucx_perftest"):
            continue
        if line["measure"] == "host-staged":
            assert line["gbps"] > 0 and line["verified"] and line["host_verified"]
            assert line["staged_ms"] >= line["host_read_p50_ms"] > 0
            continue
        if not knob and line["variant"].endswith("-launch"):
            assert line["skipped"] == "no staged_launch knob" and "gbps" not in line
            continue
        assert line["verified"] is True and line["gbps"] > 0
        assert 0 < line["p50_ms"] <= line["p99_ms"] and line["iters"] == 3
        variant = gpu_probe.VARIANTS[gpu_probe.VARIANT_NAMES.index(line["variant"])]
        assert line["config"] == {"direct_reads": False, **variant.options}
        assert line["env"] == dict(variant.env)
        for side in line.get("trace", {}).values():  # where the agents wrote one
            assert side["num_chunks"] > 0 and side["total_ms"] >= 0
            assert side["gaps_ms"] and min(side["gaps_ms"].values()) >= 0


class _Scripted(gpu_probe.Probe):
    """A probe whose measurements are given: no processes."""

    def __init__(self, opts: gpu_probe.Options, outcomes: dict[str, Any]) -> None:
        super().__init__(opts, lambda text: None)
        self._outcomes = outcomes

    def _environment(self) -> dict[str, Any]:
        return {"measure": "environment"}

    def _measure(self, item: gpu_probe.Item) -> dict[str, Any]:
        outcome = self._outcomes[item.test]
        if isinstance(outcome, Exception):
            raise outcome
        if outcome == "hang":
            time.sleep(5)
        return {"gbps": 1.0}


def _scripted_run(tmp_path: Path, deadline_s: float, cap_s: float, outcomes: dict[str, Any],
                  monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    monkeypatch.setattr(gpu_probe, "_CAP_S", {"ucx_perftest": cap_s})
    monkeypatch.setattr(gpu_probe, "_MIN_START_S", 0.1)
    opts = gpu_probe.parse_args(["--cpu-dry-run", "--out", str(tmp_path),
                                 "--deadline-s", str(deadline_s)])
    items = [gpu_probe.Item("ucx_perftest", 1, test=name) for name in outcomes]
    with open(tmp_path / "lines.jsonl", "w") as lines:
        _Scripted(opts, outcomes).run(items, lines)
    return [json.loads(raw) for raw in (tmp_path / "lines.jsonl").read_text().splitlines()]


def test_a_failure_or_a_hang_is_a_line_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _scripted_run(tmp_path, 60, 0.3, {"boom": RuntimeError("no GPU here"),
                                              "hang": "hang", "fine": "ok"}, monkeypatch)
    assert [line.get("test") for line in lines] == [None, "boom", "hang", "fine"]
    assert lines[1]["error"] == "RuntimeError: no GPU here"
    assert lines[2]["error"].startswith("ProbeTimeoutError: no result within")
    assert lines[3]["gbps"] == 1.0 and "error" not in lines[3]


def test_measurements_past_the_deadline_are_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the hang runs into the run's deadline (not its own, longer one): none is left
    lines = _scripted_run(tmp_path, 0.5, 60, {"hang": "hang", "late": "ok"}, monkeypatch)
    assert "ProbeTimeoutError" in lines[1]["error"]
    assert lines[2]["skipped"].startswith("past the deadline") and "gbps" not in lines[2]


@pytest.mark.parametrize(("args", "message"), [
    (["--variants", "baseline,turbo"], "unknown variants ['turbo']"),
    (["--sizes-mib", "1,x"], "--sizes-mib: '1,x' is not a comma-separated list of whole MiB"),
    (["--sizes-mib", "0"], "--sizes-mib: '0' is not"),
    (["--perftest-sizes-mib", "1.5"], "--perftest-sizes-mib: '1.5' is not"),
    (["--focus-mib", "3"], "--focus-mib 3 is not one of --sizes-mib [1, 2]"),
    (["--deadline-s", "0"], "--deadline-s must be > 0"),
])
def test_bad_arguments_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(GpuCheckError) as caught:
        gpu_probe.parse_args(["--cpu-dry-run", *args])
    assert message in str(caught.value)


def test_bad_arguments_exit_2_with_the_reason(tmp_path: Path) -> None:
    result = script("--cpu-dry-run", "--variants", "turbo", "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert "gpu_probe: unknown variants ['turbo']; choose from baseline" in result.stderr
    assert not (tmp_path / "o").exists()


def test_trace_summary_reads_only_new_lines_whatever_their_keys(tmp_path: Path) -> None:
    old = {"side": "server", "launch": "loop", "stamps_ns": {"credit": 0, "sent": 9_000_000}}
    (tmp_path / "chunks-11.jsonl").write_text(json.dumps(old) + "\n")
    tail = TraceTail(tmp_path)
    tail.mark()
    assert tail.summary() == {}
    with open(tmp_path / "chunks-11.jsonl", "a") as file:  # nanoseconds, nested
        for sent in (1_000_000, 3_000_000):
            file.write(json.dumps({"side": "server", "launch": "loop", "chunk": 0,
                                   "stamps_ns": {"credit": 0, "packed": 500_000,
                                                 "sent": sent}}) + "\n")
        file.write('{"side": "server", "stamps_ns": {"cre')  # being written
    # seconds at the top level, the side from the file's name; out of order keys
    (tmp_path / "reader-12.jsonl").write_text(json.dumps(
        {"chunk": 0, "unpacked": 2.004, "posted": 2.0, "arrived": 2.003}) + "\n")
    summary = tail.summary()
    assert summary["server"]["num_chunks"] == 2 and summary["server"]["launch"] == ["loop"]
    assert summary["server"]["gaps_ms"] == pytest.approx({"credit->packed": 0.5,
                                                          "packed->sent": 1.5})
    assert summary["server"]["total_ms"] == pytest.approx(2.0)
    assert summary["reader"]["gaps_ms"] == pytest.approx({"posted->arrived": 3.0,
                                                          "arrived->unpacked": 1.0})


def test_ucx_log_lines_are_told_from_the_tools_own() -> None:
    output = (
        "iterations,50.0_percentile_lat,avg_lat\n"
        "[1795.1] [vm:1 :0]  parser.c:2355 UCX  WARN  unused environment variable: X\n"
        "  32,1.0,1.0\n"
        "| API:          protocol layer      |\n"
        "[1795.2] [vm:1 :0]   +------+------+\n"
        "[1795.2] [vm:1 :0]   | perftest intra-node cfg#0 | tagged message from cuda |\n"
        "[1795.3] [vm:2 :0]   | perftest intra-node cfg#0 | tagged message from cuda |\n"
        "[1795.3] [vm:2 :0]   | 0  0..inf | zero-copy | cuda_ipc/cuda |\n"
    )
    proto, warnings = ucx_lines(output)
    assert proto == ["| perftest intra-node cfg#0 | tagged message from cuda |",
                     "| 0  0..inf | zero-copy | cuda_ipc/cuda |"]
    assert warnings == ["parser.c:2355 UCX  WARN  unused environment variable: X"]
