"""A short run of ``benchmarks/soak.py``: mixed P/D load, client aborts, P killed once.

The soak driver starts P, D, a colocated reference and the proxy as real
processes, loads them for ``DURATION_S`` seconds and prints a JSON summary.
Every request must land in a bucket, no answer may differ from the colocated
one, no request may outlive the proxy's deadline, and after settling no engine
may hold a block. Longer runs: ``python -m benchmarks.soak --duration 300``
(figures in ``docs/reliability.md``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
DURATION_S = 35
DEADLINE_S = 30


@pytest.mark.timeout(450)  # the run's own 400 s, not the suite's 300 s default
def test_short_soak_has_no_wrong_answer_and_no_leak(tmp_path: Path) -> None:
    summary_path = tmp_path / "soak.json"
    argv = [sys.executable, "-m", "benchmarks.soak", "--duration", str(DURATION_S),
            "--kill-at", "0.35", "--down-s", "1", "--timeout", str(DEADLINE_S),
            "--settle-s", "40", "--seed", "7", "--log-dir", str(tmp_path / "logs"),
            "--json", str(summary_path)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert summary_path.exists(), done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    print(json.dumps(summary, indent=2))
    assert summary["wrong"] == 0, summary["wrong_examples"]
    assert summary["leaked_total"] == 0, summary
    assert summary["right"] > 0 and summary["aborted"] > 0, summary
    assert summary["sent"] == (summary["right"] + summary["clean_error"] + summary["aborted"]
                               + summary["wrong"])
    assert summary["max_latency_s"] <= DEADLINE_S + 5
    assert summary["p_restarts"] == 1 and "serving again" in done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
