"""The whole suite's time by package, at the end of the run (CI's log keeps it).

One line a package (a folder under ``tests/``, e.g. ``integrations/vllm``): wall
seconds its tests took (setup, call and teardown, so a package's servers count
where they start) and how many tests ran. With ``--durations N`` pytest lists the
slowest tests beside it (``make pytest`` asks for 25).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

_TESTS = Path(__file__).parent
_seconds: defaultdict[str, float] = defaultdict(float)
_counts: defaultdict[str, int] = defaultdict(int)


def _package(nodeid: str) -> str:
    """``tests/a/b/test_x.py::test_y`` -> "a/b" (nodeids are relative to the repository)."""
    folder = Path(nodeid.split("::", 1)[0]).parent
    try:
        return folder.relative_to(_TESTS.name).as_posix()
    except ValueError:
        return folder.as_posix()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    package = _package(report.nodeid)
    _seconds[package] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _counts[package] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    terminalreporter.section("time by package")
    for package, seconds in sorted(_seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(
            f"{seconds:8.1f} s  {_counts[package]:5d} tests  tests/{package.strip('.')}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f} s  in all")
