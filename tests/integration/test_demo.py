"""``kvbridge demo``: the real command end to end, its checker, and its clean-up.

The integration tests run ``python -m kvbridge.cli demo --quick`` as a
subprocess (the code behind ``make demo``) with a marker in its environment;
every process it starts inherits the marker, so ``/proc`` tells whether any of
them outlived the demo. The checker tests feed ``kvbridge.cli.demo.report`` a real
colocated answer and an altered copy of it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import IO

import pytest

from kvbridge.cli.demo.procs import (
    PORT_SPAN_ENV,
    ChildProcess,
    DemoError,
    port_span,
    reserve_ports,
    stop_children,
    wait_ready,
)
from kvbridge.cli.demo.report import (
    DemoPrompt,
    RequestResult,
    TransferDelta,
    build_workload,
    exit_code,
    first_mismatch,
    render_summary,
    render_table,
)
from kvbridge.cli.demo.run import run_reference

DEMO_TIMEOUT_S = 240
_ROW = re.compile(r"^\s*(\d+)\s+(short|long|prefix|repeat|concurrent)\s+(\d+)\s+(\d+)\s+(\d+)"
                  r"\s+(yes|NO)\s")


def _marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker`` (zombies have none)."""
    needle = f"KVBRIDGE_DEMO_TEST={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if needle in environ.split(b"\0"):
                pids.append(int(entry.name))
    return pids


def _start_demo(marker: str, *flags: str) -> subprocess.Popen[str]:
    env = {**os.environ, "KVBRIDGE_DEMO_TEST": marker}
    return subprocess.Popen([sys.executable, "-m", "kvbridge.cli", "demo", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _end_demo(proc: subprocess.Popen[str], marker: str) -> list[int]:
    """Make sure the demo and everything it started are gone, even when a test fails
    half-way; returns the pids that outlived the demo (killed here)."""
    if proc.poll() is None:  # give the demo the chance to clean up after itself
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    survivors = _marked_pids(marker)
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return survivors


def _lines(proc: subprocess.Popen[str]) -> IO[str]:
    assert proc.stdout is not None
    return proc.stdout  # not a generator: leaving a loop over it must not close the pipe


@pytest.mark.integration
@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_quick_demo_matches_everything_and_leaves_nothing_running() -> None:
    marker = uuid.uuid4().hex
    proc = _start_demo(marker, "--quick")
    output: list[str] = []
    num_during = 0
    try:
        for line in _lines(proc):
            output.append(line)
            if line.startswith("sending "):  # P, D, proxy and their workers are up
                num_during = len(_marked_pids(marker)) - 1  # minus the demo itself
        code = proc.wait(DEMO_TIMEOUT_S)
    finally:
        survivors = _end_demo(proc, marker)
    text = "".join(output)
    assert code == 0, text
    rows = [m.groups() for m in map(_ROW.match, output) if m]
    assert [int(r[0]) for r in rows] == list(range(1, 7)), text  # --quick: 6 prompts
    assert all(r[5] == "yes" for r in rows), text
    assert "6/6 answers match" in text and "PASS" in text
    assert any(int(r[3]) > 0 for r in rows), "no prefix hit on D"
    assert any(r[1] == "short" and int(r[2]) < 16 for r in rows), "no prompt below one block"
    # P (server + 2 TP workers), D (server + worker), proxy: at least 6 processes
    assert num_during >= 6, text
    assert survivors == []


@pytest.mark.integration
@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_ctrl_c_mid_run_stops_every_process() -> None:
    marker = uuid.uuid4().hex
    proc = _start_demo(marker, "--quick")
    output: list[str] = []
    num_before = 0
    try:
        for line in _lines(proc):
            output.append(line)
            if line.startswith("[1/"):  # the first answer is in: requests are flowing
                num_before = len(_marked_pids(marker)) - 1
                proc.send_signal(signal.SIGINT)
                break
        output += list(_lines(proc))
        code = proc.wait(DEMO_TIMEOUT_S)
    finally:
        survivors = _end_demo(proc, marker)
    text = "".join(output)
    assert num_before >= 6, text
    assert code == 130, text
    assert "interrupted" in text and "PASS" not in text
    assert survivors == []


@pytest.fixture(scope="module")
def real_answer() -> list[int]:
    """A colocated answer computed by the demo's own reference path."""
    [answer] = run_reference("tiny", ["The checker must catch a single wrong token."], 8)
    assert len(answer) == 8
    return answer


def _result(index: int, expected: list[int], got: list[int],
            error: str | None = None) -> RequestResult:
    prompt = DemoPrompt(index, "long", "the prompt")
    delta = TransferDelta(nbytes=1 << 20, duration_s=0.01, num_reads=1, num_failures=0)
    return RequestResult(prompt, expected, got, 45, 0, 44, 0.05, delta, error)


@pytest.mark.parametrize("position", [0, 3, 7])
def test_checker_reports_an_altered_token(real_answer: list[int], position: int) -> None:
    altered = list(real_answer)
    altered[position] = (altered[position] + 1) % 256
    good, bad = _result(0, real_answer, list(real_answer)), _result(1, real_answer, altered)
    assert good.matches and not bad.matches
    assert first_mismatch(real_answer, altered) == position
    assert exit_code([good]) == 0
    assert exit_code([good, bad]) == 1
    table = render_table([good, bad]).splitlines()
    assert re.search(r"\byes\b", table[2]) and re.search(r"\bNO\b", table[3])
    total = TransferDelta(2 << 20, 0.02, 2, 0)
    summary = render_summary([good, bad], None, total, num_p_held=0)
    assert "1/2 answers match" in summary and summary.endswith("FAIL")


def test_checker_rejects_short_answers_and_errors(real_answer: list[int]) -> None:
    assert first_mismatch(real_answer, real_answer[:-1]) == len(real_answer) - 1
    truncated = _result(0, real_answer, real_answer[:-1])
    failed = _result(1, real_answer, [], error="proxy answered 502")
    assert not truncated.matches and not failed.matches
    assert exit_code([truncated]) == 1 and exit_code([failed]) == 1
    assert exit_code([]) == 1  # nothing checked is no success


def test_transfer_delta_from_metrics_readings() -> None:
    before = {"kvbridge_kv_transfer_bytes_total": 1000.0, "kvbridge_kv_transfer_seconds_sum": 0.5,
              "kvbridge_kv_transfer_seconds_count": 3.0, "kvbridge_kv_transfer_failures_total": 0.0}
    after = {**before, "kvbridge_kv_transfer_bytes_total": 1000.0 + 4e6,
             "kvbridge_kv_transfer_seconds_sum": 0.5 + 0.004,
             "kvbridge_kv_transfer_seconds_count": 5.0}
    delta = TransferDelta.between(before, after)
    assert (delta.nbytes, delta.num_reads, delta.num_failures) == (4_000_000, 2, 0)
    assert delta.mean_read_s == pytest.approx(0.002)
    assert delta.gbps == pytest.approx(2.0)  # 4 MB in 2 ms of parallel reads
    assert TransferDelta.between(before, before).gbps is None


@pytest.mark.parametrize("num_prompts", [1, 4, 6, 12, 13])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_workload_mix(num_prompts: int, block_size: int) -> None:
    prompts = build_workload(num_prompts, block_size, quick=False)
    assert [p.index for p in prompts] == list(range(num_prompts))
    assert len({p.text for p in prompts if p.kind != "repeat"}) == \
        sum(p.kind != "repeat" for p in prompts)
    batch = [p for p in prompts if p.concurrent]
    assert len(batch) == (num_prompts // 3 if num_prompts >= 4 else 0)
    if batch:
        assert prompts[-len(batch):] == batch and all(p.kind == "concurrent" for p in batch)
    for p in prompts:
        num_tokens = len(p.text.encode()) + 1  # + BOS
        if p.kind == "short":
            assert num_tokens < block_size
        elif p.kind in ("long", "repeat"):
            assert num_tokens > 4 * block_size
    for later in prompts:  # prefix and repeat prompts share whole blocks with an earlier one
        if later.kind in ("prefix", "repeat"):
            longs = [p for p in prompts[: later.index] if p.kind == "long"]
            shared = os.path.commonprefix([longs[-1].text, later.text])
            assert len(shared) >= 2 * block_size


def test_workload_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_prompts"):
        build_workload(0, 16, quick=True)


def test_reserved_ports_are_free_and_disjoint() -> None:
    bases = reserve_ports([1, 2, 4], seed=7)
    ports = [b + i for b, n in zip(bases, [1, 2, 4], strict=True) for i in range(n)]
    assert len(set(ports)) == 7
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_reserved_ports_keep_to_the_span_named_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PORT_SPAN_ENV, "24000-24200")
    assert port_span() == (24000, 24200)
    bases = reserve_ports([3] * 20, seed=1)
    assert all(24000 <= base <= 24200 - 3 for base in bases), bases
    for bad in ("24000", "24000-24050", "80-9000", "a-b", "30000-20000"):
        monkeypatch.setenv(PORT_SPAN_ENV, bad)
        with pytest.raises(DemoError, match=PORT_SPAN_ENV):
            reserve_ports([1])


def test_a_child_that_dies_early_is_reported_with_its_output() -> None:
    child = ChildProcess("D", ["serve", "--role", "decode", "--port", "0"])
    try:
        with pytest.raises(DemoError, match=r"(?s)D exited with code 2 before it was ready.*"
                                            r"--role decode needs --transfer-port"):
            wait_ready([child], timeout_s=120)
    finally:
        stop_children([child])
    assert child.proc.returncode == 2
