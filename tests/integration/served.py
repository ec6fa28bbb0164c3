"""``kvbridge serve`` and ``kvbridge proxy`` as child processes, and their ``/metrics``.

Started with ``python -m kvbridge.cli`` (the same code as the ``kvbridge``
command): :func:`spawn` starts one, :func:`wait_ready` waits for its ready line
(``kvbridge serve|proxy ready on http://...``) and returns a :class:`Served`,
stopped with SIGTERM (killed if it does not exit in time). Used by
``test_serve_http.py`` and ``tests/faults/test_http_bad_input.py``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import pytest

from tests.waiting import WaitTimeout, wait_until

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 40.0

#: A started process, the lines of its stdout, its stderr file (what ``spawn`` returns).
Pending = tuple[subprocess.Popen[str], queue.Queue[str], Path]


@dataclass
class Served:
    """A started ``serve`` or ``proxy`` process and its base URL."""

    proc: subprocess.Popen[str]
    url: str
    stderr_path: Path

    def stop_quietly(self) -> None:
        """``stop`` for cleanup after a failure: never raises."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.stop()

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
                raise
        return self.proc.returncode


def _pump_lines(stream: IO[str], lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def spawn(tmp: Path, name: str, *args: str) -> Pending:
    """Start ``python -m kvbridge.cli *args``; its stderr goes to ``tmp/<name>.stderr``."""
    stderr_path = tmp / f"{name}.stderr"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", *args],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=_pump_lines, args=(proc.stdout, lines), daemon=True).start()
    return proc, lines, stderr_path


def wait_ready(proc: subprocess.Popen[str], lines: queue.Queue[str], stderr: Path) -> Served:
    """The process once it printed its ready line; fails the test (and stops it) if it
    exits first or takes longer than :data:`READY_TIMEOUT_S`."""

    def ready_url() -> str | None:  # None: not yet; "": exited without a ready line
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            return "" if proc.poll() is not None else None
        match = re.match(r"kvbridge (serve|proxy) ready on (http://\S+)$", line.strip())
        return match.group(2) if match else None

    with contextlib.suppress(WaitTimeout):
        url = wait_until(ready_url, READY_TIMEOUT_S, interval_s=0.0,
                         until=lambda url: url is not None, message="the ready line")
        if url:
            return Served(proc, url, stderr)
    Served(proc, "", stderr).stop_quietly()
    pytest.fail(f"no ready line (exit {proc.returncode}):\n{stderr.read_text()[-3000:]}")


def wait_all_ready(pending: list[Pending]) -> list[Served]:
    """``wait_ready`` for each of ``pending``; if one fails, all of them are stopped.

    A fixture that fails while starting must not leave servers (and their TP
    workers) running for the rest of the session.
    """
    served: list[Served] = []
    try:
        for item in pending:
            served.append(wait_ready(*item))
    except BaseException:
        for proc, _, stderr in pending:
            Served(proc, "", stderr).stop_quietly()
        raise
    return served


def metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of ``url``'s ``/metrics``, by name."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) (\S+)$", text, re.M)}


def wait_metrics(url: str, want: dict[str, float], timeout_s: float = 30.0) -> dict[str, float]:
    """Poll ``/metrics`` until every named value equals ``want`` (fails after ``timeout_s``)."""
    return wait_until(lambda: metrics(url), timeout_s, interval_s=0.1,
                      until=lambda values: all(values.get(k) == v for k, v in want.items()),
                      message=f"{want} at {url}/metrics",
                      describe=lambda values: {k: values.get(k) for k in want})
