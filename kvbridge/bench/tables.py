"""Terminal tables of the ``kvbridge bench`` reports, in Markdown so they paste into docs.

Called by ``kvbridge/bench/cli.py`` with the dict a benchmark's ``run()``
returned; :func:`passed` says whether a report met its own checks (verified
bytes, matching answers) — never a speed goal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.bench import serve_capacity
from kvbridge.bench.serve_profile import TIMELINE
from kvbridge.bench.vllm_models import describe

_MIB = 1 << 20


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned Markdown table; floats with 2 decimals (3 below 1), None as ``-``."""
    def cell(value: object) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1 else f"{value:,.2f}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"
              for r in cells]
    return "\n".join(lines)


def size_label(nbytes: int) -> str:
    """``64 KiB``, ``2 MiB``."""
    return f"{nbytes / _MIB:g} MiB" if nbytes >= _MIB else f"{nbytes / 1024:g} KiB"


def transfer_table(report: dict[str, Any]) -> str:
    """Per size: kvbridge GB/s and latency, each peer's GB/s and kvbridge's ratio to it."""
    systems = report["systems"]
    ours = {r["nbytes"]: r for r in systems["kvbridge"]}
    mapping = {m["nbytes"]: m for m in report["workload"]["mapping"]}
    peers = [n for n, rows in systems.items() if n != "kvbridge" and isinstance(rows, list)]
    headers = ["size", "kvb layers x blocks", "kvbridge GB/s", "p50 ms", "p99 ms", "ok"]
    for name in peers:
        headers += [f"{name} GB/s", f"x {name}"]
    rows = []
    for nbytes, mine in sorted(ours.items()):
        m = mapping[nbytes]
        row: list[object] = [size_label(nbytes),
                             f"{m['kvbridge_num_layers']} x {m['kvbridge_num_blocks']}",
                             mine["gbps_median"], mine["latency_p50_us"] / 1e3,
                             mine["latency_p99_us"] / 1e3, "yes" if mine["verified"] else "NO"]
        for name in peers:
            theirs = {r["nbytes"]: r for r in systems[name]}.get(nbytes)
            row += [None, None] if theirs is None else [
                theirs["gbps_median"], mine["gbps_median"] / theirs["gbps_median"]]
        rows.append(row)
    lines = [markdown_table(headers, rows)]
    lines += [f"\n{name}: unavailable: {rows['unavailable']}" for name, rows in systems.items()
              if not isinstance(rows, list)]
    for name, failed in report.get("peer_failures", {}).items():
        lines += [f"\n{name} failed at {size_label(int(n))}: {why}" for n, why in failed.items()]
    one = report.get("latency_1_block")
    if one:
        lines.append(f"\n1-block request ({one['num_layers']} layers, "
                     f"{size_label(one['nbytes'])}): p50 {one['p50_us'] / 1e3:.2f} ms, "
                     f"p99 {one['p99_us'] / 1e3:.2f} ms")
    return "\n".join(lines)


def kernels_table(report: dict[str, Any]) -> str:
    """Per case and block count: GB/s of kvbridge, memcpy, three-pass, and the ratios."""
    headers = ["case", "blocks", "MiB", "kvbridge GB/s", "memcpy GB/s", "3-pass GB/s",
               "x memcpy", "x 3-pass"]
    rows = [[r["case"], r["num_blocks"], r["nbytes"] / _MIB, r["ours_gbps"], r["memcpy_gbps"],
             r["baseline_gbps"], r["vs_memcpy"], r["vs_baseline"]] for r in report["results"]]
    config = report["config"]
    return (markdown_table(headers, rows) + f"\n\n{config['num_layers']} layers, "
            f"{config['num_heads']} heads x {config['head_dim']}, {config['dtype']}, "
            f"{config['device']} ({config['impl']}), {config['threads']} threads, "
            f"clock {config['clock']}, best of {config['reps']}")


def paged_table(report: dict[str, Any]) -> str:
    """One row per figure."""
    rows = [[bench, metric, float(value)] for bench, metrics in report.items()
            if bench != "settings" for metric, value in metrics.items()]
    return markdown_table(["benchmark", "metric", "value"], rows)


def e2e_table(report: dict[str, Any]) -> str:
    """Per prompt length and mode: medians of TTFT, decode rate, prefill and transfer."""
    headers = ["prompt tokens", "mode", "TTFT ms", "decode tok/s", "P prefill ms",
               "transfer ms", "MiB moved", "requests"]
    rows = [[r["prompt_tokens"], "P/D" if r["mode"] == "pd" else r["mode"], r["ttft_ms"],
             r["decode_tokens_per_s"], r["prefill_ms"], r["transfer_ms"],
             None if r["transfer_nbytes"] is None else r["transfer_nbytes"] / _MIB,
             r["num_requests"]] for r in report["rows"]]
    settings = report["settings"]
    return (markdown_table(headers, rows) + f"\n\nmodel {settings['model']}, "
            f"{settings['max_tokens']} output tokens, median of {settings['repeats']}; P/D "
            f"answers equal colocated: {'yes' if report['all_match'] else 'NO'}")


def _idle_by_role(procs: list[dict[str, Any]]) -> list[object]:
    """One server's idle CPU: % per process role, thread count, its busiest thread."""
    roles = {"api_server": 0.0, "engine core": 0.0, "worker": 0.0, "other": 0.0}
    busiest = ("-", 0.0)
    for p in procs:
        role = "api_server" if p["process"] == "api_server" else \
            "engine core" if p["process"].startswith("VLLM::EngineCor") else \
            "worker" if p["process"].startswith("VLLM::Worker") else "other"
        roles[role] += p["cpu_percent"]
        for thread, percent in p["busiest_threads"].items():
            if percent > busiest[1]:
                busiest = (f"{thread} {percent:g}%", percent)
    return [*roles.values(), sum(p["num_threads"] for p in procs), busiest[0]]


def vllm_table(report: dict[str, Any]) -> str:
    """TTFT per length and configuration with its parts, idle CPU per process, errors."""
    configs = report["configs"]
    colocated = {r["prompt_tokens"]: r["ttft_ms"] for r in configs.get("colocated", {})
                 .get("rows", [])}
    headers = ["prompt tokens", "config", "TTFT ms", "x colocated", "P ms", "D ms",
               "load ms/read", "reads", "MiB/req", "KV tokens/req", "B/KV token",
               "D server TTFT ms",
               "classic flow"]
    rows = []
    for name, result in configs.items():
        for r in result["rows"]:
            base = colocated.get(r["prompt_tokens"])
            rows.append([r["prompt_tokens"], name, r["ttft_ms"],
                         None if base is None else r["ttft_ms"] / base,
                         r.get("prefill_ms"), r.get("decode_ms"), r.get("load_ms"),
                         None if "num_reads" not in r else int(r["num_reads"]),
                         r.get("mib_per_request"), r.get("loaded_tokens_per_request"),
                         r.get("bytes_per_loaded_token"),
                         r.get("d_server_ttft_ms", r.get("colocated_server_ttft_ms")),
                         r.get("num_classic")])
    rows.sort(key=lambda row: (row[0], list(configs).index(row[1])))
    lines = [markdown_table(headers, rows)]
    idle = [[name, server, *_idle_by_role(procs)] for name, result in configs.items()
            for server, procs in result["idle_cpu"].items()]
    if idle:
        idle_s = report["settings"]["idle_s"]
        lines += [f"\nidle CPU over {idle_s:g} s after the traffic (% of one core; "
                  "threads: all processes of the server):",
                  markdown_table(["config", "server", "API server %", "engine core %",
                                  "worker %", "other %", "threads", "busiest thread"], idle)]
    settings = report["settings"]
    lines.append(f"\nmodel {settings['model']}: {describe(settings['shape'])}; median of "
                 f"{settings['requests']} requests per length; cores "
                 f"{settings.get('cores', 'shared')}")
    lines += [f"\n{name} FAILED: {result['error']}" for name, result in configs.items()
              if "error" in result]
    return "\n".join(lines)


def _load(point: dict[str, Any]) -> str:
    """``2/s`` (a fixed rate), ``0.7x (1.2/s)`` (a share of capacity) or ``c=4``."""
    if point["sweep"] != "rate":
        return f"c={point['concurrency']}"
    fraction = point.get("load_fraction")  # reports from before capacities: none
    return f"{point['rate']:g}/s" if fraction is None else f"{fraction:g}x ({point['rate']:g}/s)"


def _load_key(label: str) -> tuple[bool, float]:
    """Sorts :func:`_load` labels: rates (by req/s) before concurrency points."""
    if label.startswith("c="):
        return True, float(label[2:])
    return False, float(label.rpartition("(")[2].rstrip("/s)"))


def serve_goodput_rate(points: list[dict[str, Any]], attainment: float = 0.9) -> float | None:
    """DistServe's goodput: the highest swept rate at which every run met both SLOs
    for at least ``attainment`` of its completed requests (None: no rate did)."""
    by_rate: dict[float, list[float]] = {}
    for p in points:
        if p["sweep"] == "rate":
            by_rate.setdefault(p["rate"], []).append(p["slo_attainment"])
    good = [rate for rate, shares in by_rate.items() if min(shares) >= attainment]
    return max(good, default=None)


def _sort_by_point(rows: list[list[Any]], order: list[str]) -> None:
    """Rows that start (workload, load, config): by workload, rates before concurrency,
    load, then configuration in run order."""
    rows.sort(key=lambda r: (r[0], _load_key(str(r[1])), order.index(str(r[2]))))


def serve_profile_table(report: dict[str, Any]) -> str:
    """Per configuration and sweep point (mean over repeats), each process's CPU use,
    vLLM's per-request queue, prefill and decode time and D's mean KV read
    (``kvbridge/bench/serve_profile.py``)."""
    headers = ["workload", "load", "config", "processes", "CPU % of a core",
               "queue ms", "prefill ms", "decode ms", "KV read ms"]
    rows: list[list[Any]] = []
    for name, workload, load, profiles in _profiles_by_point(report):
        procs = list(profiles[0])

        def cells(key: str, procs: list[str] = procs,
                  profiles: list[dict[str, Any]] = profiles) -> str:
            means = []
            for proc in procs:
                values = [pr[proc][key] for pr in profiles
                          if pr.get(proc, {}).get(key) is not None]
                if key in profiles[0][proc]:
                    means.append(f"{sum(values) / len(values):,.0f}" if values else "-")
            return " / ".join(means) or "-"  # e.g. CPU of a --url deployment: not known

        rows.append([workload, load, name, " / ".join(procs), cells("cpu_percent"),
                     cells("queue_ms"), cells("prefill_ms"), cells("decode_ms"),
                     cells("read_ms")])
    _sort_by_point(rows, list(report["configs"]))
    timeline = serve_timeline_table(report)
    return "\n".join([markdown_table(headers, rows), *timeline, "",
                      "queue: waiting to be scheduled; "
                      "prefill: scheduled to first token; decode: first to last token "
                      "(vLLM's means per request); KV read: the connector's mean read "
                      "(part of D's queue); CPU: each process group's, from the "
                      "client's timed part to idle servers"])


def serve_timeline_table(report: dict[str, Any]) -> list[str]:
    """kvbridge's read timeline per configuration and point (mean over repeats, ms; lines
    to print, none when no point has one): ``serve_profile.TIMELINE``, P's phases from P's
    server and D's from D's."""
    headers = ["workload", "load", "config", "P: publish", "P: grant wait", "D: queue",
               "D: grant", "D: copy", "D: collect", "D: read (all)"]
    rows: list[list[Any]] = []
    for name, workload, load, profiles in _profiles_by_point(report):
        cells = []
        for key in (*TIMELINE, "read_ms"):
            values = [row[key] for pr in profiles for row in pr.values()
                      if row.get(key) is not None]
            cells.append(f"{sum(values) / len(values):,.2f}" if values else "-")
        if any(cell != "-" for cell in cells[:-1]):
            rows.append([workload, load, name, *cells])
    if not rows:
        return []
    _sort_by_point(rows, list(report["configs"]))
    return ["", "kvbridge's read timeline (means, ms; serve_profile.TIMELINE):",
            markdown_table(headers, rows)]


def _profiles_by_point(report: dict[str, Any]
                       ) -> list[tuple[str, str, str, list[dict[str, Any]]]]:
    """(configuration, workload, load, the profiles of its repeats) per point measured."""
    points = []
    for name, result in report["configs"].items():
        by_point: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for p in result.get("points", []):
            if "profile" in p:
                by_point.setdefault((p["workload"], _load(p)), []).append(p["profile"])
        points += [(name, workload, load, profiles)
                   for (workload, load), profiles in by_point.items()]
    return points


def _serve_network(report: dict[str, Any]) -> str:
    """``loopback``, or ``netns-tcp`` and who ran where (``kvbridge/bench/serve_netns.py``)."""
    network = str(report.get("network", "loopback"))  # reports from before --netns: loopback
    if network == "loopback":
        return network
    placement = report["placement"]
    roles = ", ".join(f"{who} {ip}" for who, ip in placement["roles"].items())
    env = " ".join(f"{k}={v}" for k, v in placement["child_env"].items())
    return f"{network} ({roles}; {env})"


def serve_table(report: dict[str, Any]) -> str:
    """Per configuration, workload and sweep point: counts, throughput, goodput, latency
    percentiles (one row per repeat); then each configuration's goodput rate, skips, errors."""
    headers = ["workload", "load", "config", "ok/short/failed", "req/s", "out tok/s",
               "goodput req/s", "SLO met", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
               "ITL p50", "ITL p99", "load avg"]
    configs = report["configs"]
    rows = []
    for name, result in configs.items():
        for p in result.get("points", []):
            short = "?" if p.get("num_short") is None else p["num_short"]
            rows.append([p["workload"], _load(p), name,
                         f"{p['completed']}/{short}/{p['failed']}",
                         p["request_throughput"], p["output_throughput"],
                         p["request_goodput"], f"{100 * p['slo_attainment']:.0f}%",
                         p["p50_ttft_ms"], p["p99_ttft_ms"], p["p50_tpot_ms"],
                         p["p99_tpot_ms"], p["p50_itl_ms"], p["p99_itl_ms"], p["loadavg"]])
    _sort_by_point(rows, list(configs))
    settings = report["settings"]
    lines = [markdown_table(headers, rows), "", "times in ms; load: Poisson rate (0.7x: "
             "that share of the workload's capacity) or concurrency; ok: completed (vllm "
             "bench serve: a first token came), of which short: fewer tokens than asked; "
             "SLO met: share of completed requests within both SLOs"]
    for name, w in settings["workloads"].items():
        lines.append(f"- workload {name}: {w['input_len']} in / {w['output_len']} out, "
                     f"{w['num_prompts']} prompts per point, SLO TTFT {w['slo_ttft_ms']:g} ms "
                     f"and TPOT {w['slo_tpot_ms']:g} ms")
        capacity = settings.get("capacity", {}).get(name)
        if capacity is not None:
            lines.append(f"  - capacity: {serve_capacity.describe(capacity)}")
        elif w.get("load_fractions"):
            lines.append("  - capacity: not measured (no configuration reached its sweep)")
        for config, result in configs.items():
            points = [p for p in result.get("points", []) if p["workload"] == name]
            if points:
                rate = serve_goodput_rate(points)
                fraction = next((p.get("load_fraction") for p in points
                                 if p["sweep"] == "rate" and p["rate"] == rate), None)
                best = ("none" if rate is None else f"{rate:g} req/s" if fraction is None
                        else f"{fraction:g}x capacity ({rate:g} req/s)")
                lines.append(f"  - {config}: highest rate with >= 90% within SLO: {best}")
    where = ("running front ends (--url)" if settings.get("deployment")
             else f"cores {settings['cores']}; network {_serve_network(report)}")
    lines.append(f"\nmodel {settings['model']}; {where}; {settings['repeats']} repeat(s)")
    for name, result in configs.items():
        for p in result.get("points", []):
            if p.get("first_error"):
                error = " ".join(p["first_error"].split())[-300:]
                lines.append(f"\n{name} {p['workload']} {_load(p)}, first error: {error}")
        if "skipped" in result:
            lines.append(f"\n{name} SKIPPED: {result['skipped']}")
        if "error" in result:
            lines.append(f"\n{name} FAILED after {len(result['points'])} point(s): "
                         f"{result['error']}")
    if any("profile" in p for result in configs.values() for p in result.get("points", [])):
        lines += ["\nwhere the time went:", serve_profile_table(report)]
    return "\n".join(lines)


def sglang_table(report: dict[str, Any]) -> str:
    from kvbridge.bench import sglang_bench

    return sglang_bench.table(report)


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "transfer": transfer_table, "kernels": kernels_table, "paged": paged_table,
    "e2e": e2e_table, "vllm": vllm_table, "serve": serve_table, "sglang": sglang_table,
}


def passed(name: str, report: dict[str, Any]) -> bool:
    """Whether ``report`` met its correctness checks (not speed goals)."""
    if name == "transfer":
        return all(r["verified"] for r in report["systems"]["kvbridge"]) and all(
            r["verified"] for rows in report["systems"].values() if isinstance(rows, list)
            for r in rows if r["peer"] in ("nixl", "mooncake"))
    if name == "e2e":
        return bool(report["all_match"])
    if name == "sglang":
        from kvbridge.bench import sglang_bench

        return sglang_bench.passed(report)
    if name == "serve":  # kvbridge's configurations (or the deployment's front ends) ran
        # every point, every answer whole
        ours = report["settings"].get("deployment")
        return all("error" not in result and not any(
            p["failed"] or p.get("num_short") or p["missing_output_tokens"] > 0
            for p in result["points"])
                   for config, result in report["configs"].items()
                   if (ours or config.startswith("kvbridge")) and "skipped" not in result)
    if name == "vllm":  # kvbridge's D loaded KV for every length, without a failed read
        ours = report["configs"].get("kvbridge")
        return ours is None or ("error" not in ours and all(
            r["loaded_tokens_per_request"] > 0 and not r["num_failures"] for r in ours["rows"]))
    return True
