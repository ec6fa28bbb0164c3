"""Terminal tables of the ``kvbridge bench`` reports, in Markdown so they paste into docs.

Called by ``benchmarks/bench_cli.py`` with the dict a benchmark's ``run()``
returned; :func:`passed` says whether a report met its own checks (verified
bytes, matching answers) — never a speed goal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
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


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "transfer": transfer_table, "kernels": kernels_table, "paged": paged_table,
    "e2e": e2e_table,
}


def passed(name: str, report: dict[str, Any]) -> bool:
    """Whether ``report`` met its correctness checks (not speed goals)."""
    if name == "transfer":
        return all(r["verified"] for r in report["systems"]["kvbridge"]) and all(
            r["verified"] for rows in report["systems"].values() if isinstance(rows, list)
            for r in rows if r["peer"] in ("nixl", "mooncake"))
    if name == "e2e":
        return bool(report["all_match"])
    return True
