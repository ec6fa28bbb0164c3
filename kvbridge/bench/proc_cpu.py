"""CPU time per process and thread of a process group, from /proc (Linux).

Called by ``kvbridge/bench/vllm_bench.py`` for the idle-CPU figures
(:func:`idle_cpu`: two :func:`cpu_snapshot` calls some seconds apart, then
:func:`cpu_use`). Thread names are the kernel's (``comm``): a Python thread
started without a native name carries its process's, so kvbridge's
transfer-agent thread shows as ``VLLM::Worker`` (``py-spy dump`` names them).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvbridge.bench.vllm_servers import group_pids, stat_fields

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _comm(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


CpuSnapshot = dict[tuple[int, int], tuple[str, str, float]]
"""(pid, tid) -> (process name, thread name, CPU seconds user + system)."""


def cpu_snapshot(pgid: int) -> CpuSnapshot:
    """Every thread of every process of group ``pgid`` with its CPU time so far."""
    snapshot: CpuSnapshot = {}
    for pid in group_pids(pgid):
        process = _comm(Path(f"/proc/{pid}/comm"))
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            fields = stat_fields(task / "stat")
            if fields is None:
                continue
            seconds = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime
            snapshot[pid, int(task.name)] = (process, _comm(task / "comm"), seconds)
    return snapshot


def cpu_use(before: CpuSnapshot, after: CpuSnapshot, seconds: float,
            leader: int) -> list[dict[str, object]]:
    """Per process, CPU % of one core between two snapshots and its three busiest threads.

    Threads that started or ended between the snapshots count from zero / not at all.
    ``leader`` (the API server) is named "api_server"; others by their ``comm``
    (vLLM names its engine core ``VLLM::EngineCore``, workers ``VLLM::Worker...``).
    """
    threads: dict[int, list[tuple[str, float]]] = {}
    names: dict[int, str] = {}
    for (pid, tid), (process, thread, cpu_s) in after.items():
        cpu_used_s = cpu_s - before.get((pid, tid), (process, thread, 0.0))[2]
        threads.setdefault(pid, []).append((f"{thread}[{tid}]", cpu_used_s))
        names[pid] = "api_server" if pid == leader else process
    rows: list[dict[str, object]] = []
    for pid, per_thread in sorted(threads.items()):
        busiest = sorted(per_thread, key=lambda t: -t[1])[:3]
        rows.append({
            "process": names[pid], "pid": pid,
            "cpu_percent": round(100 * sum(u for _, u in per_thread) / seconds, 2),
            "num_threads": len(per_thread),
            "busiest_threads": {name: round(100 * u / seconds, 2) for name, u in busiest
                                if u > 0},
        })
    return rows


def idle_cpu(groups: dict[str, int], seconds: float,
             settle_s: float = 3.0) -> dict[str, list[dict[str, object]]]:
    """Per named process group (its leader's pid), ``cpu_use`` over ``seconds``.

    Waits ``settle_s`` first, so that the work just finished (stats sent after
    a request, OpenMP threads spinning at a barrier) does not count.
    """
    time.sleep(settle_s)
    before = {name: cpu_snapshot(pgid) for name, pgid in groups.items()}
    started = time.monotonic()
    time.sleep(seconds)
    after = {name: cpu_snapshot(pgid) for name, pgid in groups.items()}
    elapsed = time.monotonic() - started
    return {name: cpu_use(before[name], after[name], elapsed, pgid)
            for name, pgid in groups.items()}
