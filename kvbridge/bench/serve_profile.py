"""Where each process's time went during one ``kvbridge bench serve`` point.

Called by ``kvbridge/bench/serve_bench.py`` around every point: :func:`snapshot`
before the client starts, :func:`restart_cpu` when ``vllm bench serve`` starts
its timed part (after its start-up: loading the tokenizer, building the
prompts), :func:`snapshot` after the point (once the servers are idle again,
so that every request of the point is counted), then :func:`usage`. Per vLLM
server it gives

- ``cpu_percent``: CPU time of its whole process group (API server, engine
  core, workers, kvbridge's transfer agent) from the timed part's start to
  idle servers, in % of one core over that time; with ``--cores split`` each
  server has one core, so near 100 means that core was never idle;
- ``requests``: the requests it finished;
- ``queue_ms``, ``prefill_ms``, ``decode_ms``: vLLM's own per-request means
  (``vllm:request_{queue,prefill,decode}_time_seconds``): waiting to be
  scheduled, scheduled to first token, first to last token;
- ``read_ms``: the connector's mean KV read (one per D worker and request:
  ``vllm:kvbridge_transfer_seconds`` or NixlConnector's
  ``vllm:nixl_xfer_time_seconds``), part of D's queue time (a request waits
  unscheduled while its KV is read); None where nothing was read;
- kvbridge's read timeline (``TIMELINE``, the means of its histograms): on P
  ``grant_publish_ms`` (a request's end in the scheduler to its grant issued)
  and ``grant_wait_ms`` (a read that came before its grant, waiting for it); on
  D ``read_queue_ms`` (until the agent's thread began the read),
  ``read_grant_ms`` (until P's grant board or P's answer confirmed the grant),
  ``read_copy_ms`` (until the last byte) and ``read_collect_ms`` (until the
  engine took the outcome); None where nothing of it happened.

and for the front end (router or proxy) its CPU. Against a running deployment
(``--url``, ``--server-url``) only the phases are known. This is the profile behind a
lost comparison: e.g. a P whose core is busy all the time and whose queue
time makes up most of TTFT has too little compute for its prefills.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from kvbridge.bench.proc_cpu import cpu_snapshot
from kvbridge.bench.vllm_servers import scrape, total

_PHASES = {"queue_ms": ("vllm:request_queue_time_seconds",),
           "prefill_ms": ("vllm:request_prefill_time_seconds",),
           "decode_ms": ("vllm:request_decode_time_seconds",),
           # a D's KV reads, by whichever connector it runs (None where it read nothing)
           "read_ms": ("vllm:kvbridge_transfer_seconds", "vllm:nixl_xfer_time_seconds"),
           # kvbridge's read timeline (``connector/outputs.PHASES``): P's grants, D's reads
           **{f"{name}_ms": (f"vllm:kvbridge_{name}_seconds",) for name in (
               "grant_publish", "grant_wait", "read_queue", "read_grant", "read_copy",
               "read_collect")}}
#: The timeline's phases in the order they happen (each a key of ``usage``'s rows).
TIMELINE = ("grant_publish_ms", "grant_wait_ms", "read_queue_ms", "read_grant_ms",
            "read_copy_ms", "read_collect_ms")


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live threads of process group ``pgid`` so far."""
    return sum(cpu_s for _, _, cpu_s in cpu_snapshot(pgid).values())


@dataclass(frozen=True)
class Snapshot:
    """CPU seconds per process group and vLLM's phase sums and counts per server."""

    cpu_s: dict[str, float]
    phases: dict[str, dict[str, tuple[float, float]]]  # server -> phase -> (sum s, count)
    taken: float  # time.monotonic() when taken


def snapshot(servers: dict[str, str], groups: dict[str, int]) -> Snapshot:
    """Now's counters: vLLM's phases of ``servers`` (name -> URL) and the CPU seconds of
    process ``groups`` (name -> process group id)."""
    phases = {}
    for name, url in servers.items():
        samples = scrape(url)
        phases[name] = {
            phase: (sum(total(samples, f"{metric}_sum") for metric in metrics),
                    sum(total(samples, f"{metric}_count") for metric in metrics))
            for phase, metrics in _PHASES.items()}
    cpu_s = {name: group_cpu_s(pgid) for name, pgid in groups.items()}
    return Snapshot(cpu_s, phases, time.monotonic())


def restart_cpu(counters: Snapshot, groups: dict[str, int]) -> Snapshot:
    """``counters`` with its CPU seconds (and time) read now, its phases kept: requests
    that end from now on are counted from the earlier snapshot, CPU from now (only
    /proc is read: no request can end while it is taken)."""
    cpu_s = {name: group_cpu_s(pgid) for name, pgid in groups.items()}
    return replace(counters, cpu_s=cpu_s, taken=time.monotonic())


def usage(before: Snapshot, after: Snapshot) -> dict[str, dict[str, Any]]:
    """Per server and process group: CPU used between the snapshots in % of one core
    over the time between them, requests finished, and the mean of each phase in ms
    (None where no request finished). A deployment's servers (``--url``) have phases
    only."""
    wall_s = max(after.taken - before.taken, 1e-9)
    result: dict[str, dict[str, Any]] = {}
    for name in {**after.phases, **after.cpu_s}:  # servers first, then the front end
        row: dict[str, Any] = {}
        if name in after.cpu_s:
            row["cpu_percent"] = round(
                100 * (after.cpu_s[name] - before.cpu_s.get(name, 0.0)) / wall_s, 1)
        if name in after.phases:
            for phase, (sum_s, count) in after.phases[name].items():
                old_sum, old_count = before.phases[name][phase]
                done = count - old_count
                row[phase] = round(1000 * (sum_s - old_sum) / done, 3) if done else None
                if phase == "queue_ms":  # every request finished has each phase once
                    row["requests"] = int(done)
        result[name] = row
    return result
