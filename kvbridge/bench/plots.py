"""PNG plots of the ``kvbridge bench`` reports (matplotlib, Agg backend: no display needed).

Called by ``kvbridge/bench/cli.py`` with the dict a benchmark's ``run()``
returned. matplotlib comes with the ``bench`` extra and is imported on first
use; without it :func:`save_plot` raises :class:`PlotUnavailable` and the caller
keeps the JSON and table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

_MIB = 1 << 20
_COLORS = {"kvbridge": "tab:red", "kvbridge_ucx": "tab:orange", "kvbridge_copy": "tab:pink",
           "ucx_perftest": "tab:gray",
           "ucx_perftest_get": "black", "nixl": "tab:blue", "mooncake": "tab:green"}


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (``pip install kvbridge[bench]``)."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable("matplotlib is not installed (pip install 'kvbridge[bench]')") \
            from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size_label(nbytes: float) -> str:
    return f"{nbytes / _MIB:g} MiB" if nbytes >= _MIB else f"{nbytes / 1024:g} KiB"


def plot_transfer(report: dict[str, Any], fig: Any) -> None:
    """GB/s against request size (log x), one line per system that ran."""
    ax = fig.add_subplot(1, 1, 1)
    sizes: list[int] = []
    for name, rows in report["systems"].items():
        if not isinstance(rows, list):
            continue  # unavailable: named in the title instead
        xs = [r["nbytes"] for r in rows]
        sizes = sorted({*sizes, *xs})
        style = {"kvbridge": "-o", "kvbridge_ucx": ":o"}.get(name, "--.")
        ax.plot(xs, [r["gbps_median"] for r in rows], style, label=name,
                color=_COLORS.get(name), linewidth=2.5 if name == "kvbridge" else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # 64 KiB requests and 64 MiB ones differ by 100x and more
    ax.set_xticks(sizes, [_size_label(s) for s in sizes], rotation=30)
    ax.set_xlabel("request size (scattered 64 KiB pieces)")
    ax.set_ylabel("GB/s (median request, log scale)")
    missing = [n for n, rows in report["systems"].items() if not isinstance(rows, list)]
    title = "KV transfer between two processes on loopback"
    ax.set_title(title + (f"\n(unavailable: {', '.join(missing)})" if missing else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def plot_kernels(report: dict[str, Any], fig: Any) -> None:
    """Grouped bars per case: kvbridge, memcpy of the same bytes, three-pass baseline."""
    results = report["results"]
    counts = sorted({r["num_blocks"] for r in results})
    for i, count in enumerate(counts):
        ax = fig.add_subplot(len(counts), 1, i + 1)
        rows = [r for r in results if r["num_blocks"] == count]
        width = 0.27
        for j, (key, label, color) in enumerate((
                ("ours_gbps", "kvbridge", "tab:red"), ("memcpy_gbps", "memcpy", "tab:gray"),
                ("baseline_gbps", "three-pass", "tab:blue"))):
            xs = [k + (j - 1) * width for k in range(len(rows))]
            ax.bar(xs, [r[key] or 0.0 for r in rows], width, label=label, color=color)
        ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=20, ha="right",
                      fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{count} blocks ({rows[0]['nbytes'] / _MIB:.0f} MiB)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)


def plot_paged(report: dict[str, Any], fig: Any) -> None:
    """Left: scheduler-step microseconds. Right: throughputs (log scale)."""
    steps = {k: v for k, v in report.items() if k.startswith("scheduler_step")}
    ax = fig.add_subplot(1, 2, 1)
    labels = [k.removeprefix("scheduler_step_256x4k_") for k in steps]
    for j, (metric, label) in enumerate((("allocate_us_per_step_mean", "allocate_slots"),
                                         ("append_and_hash_us_per_step_mean", "append + hash"))):
        xs = [k + (j - 0.5) * 0.4 for k in range(len(steps))]
        ax.bar(xs, [v[metric] for v in steps.values()], 0.4, label=label)
    ax.set_xticks(range(len(steps)), labels)
    ax.set_ylabel("us per step, 256 requests x 4k tokens (mean)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    ax = fig.add_subplot(1, 2, 2)
    rates = {"allocate+free /s": report["allocate_free_512_tokens"]["ops_per_s"],
             "prefix lookups /s": report["prefix_hit_4096_tokens"]["lookups_per_s"]}
    for key, value in report["block_hashing"].items():
        rates[f"hash {key.removesuffix('_tokens_per_s')} tokens/s"] = value
    ax.barh(list(rates), list(rates.values()), color="tab:red")
    ax.set_xscale("log")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("paged KV manager on the host")


def plot_e2e(report: dict[str, Any], fig: Any) -> None:
    """TTFT and decode tokens/s against prompt length, colocated versus P/D."""
    rows = report["rows"]
    for i, (key, label) in enumerate((("ttft_ms", "TTFT (ms, median)"),
                                      ("decode_tokens_per_s", "decode tokens/s (median)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for mode, color in (("colocated", "tab:gray"), ("pd", "tab:red")):
            mine = [r for r in rows if r["mode"] == mode]
            ax.plot([r["prompt_tokens"] for r in mine], [r[key] for r in mine], "-o",
                    label="P/D" if mode == "pd" else mode, color=color)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"end to end, model {report['settings']['model']}, CPU")


def plot_vllm(report: dict[str, Any], fig: Any) -> None:
    """TTFT and load time against prompt length (log y), idle CPU per server."""
    from matplotlib.ticker import FuncFormatter  # _pyplot() has imported matplotlib

    configs = report["configs"]
    colors = {"colocated": "tab:gray", "kvbridge": "tab:red", "kvbridge-classic": "tab:orange",
              "nixl": "tab:blue"}
    for i, (key, label) in enumerate((("ttft_ms", "TTFT ms (median, log)"),
                                      ("load_ms", "KV load ms per read (mean, log)"))):
        ax = fig.add_subplot(1, 3, i + 1)
        for name, result in configs.items():
            rows = [r for r in result["rows"] if r.get(key) is not None]
            if rows:
                ax.plot([r["prompt_tokens"] for r in rows], [r[key] for r in rows], "-o",
                        label=name, color=colors.get(name))
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))  # not 10^2
        ax.yaxis.set_minor_formatter(FuncFormatter(  # label 2s and 5s only
            lambda v, _pos: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 3, 3)
    bars = {name if server == name else f"{name} {server}": sum(p["cpu_percent"] for p in procs)
            for name, result in configs.items() for server, procs in result["idle_cpu"].items()}
    ax.barh(list(bars), list(bars.values()),
            color=[colors.get(label.split()[0]) for label in bars])
    ax.set_xlabel("idle CPU, % of one core (all processes)")
    ax.grid(True, axis="x", alpha=0.3)
    failed = [name for name, result in configs.items() if "error" in result]
    settings = report["settings"]
    fig.suptitle(f"vLLM P/D, {settings['model']}, CPU, cores {settings.get('cores', 'shared')}"
                 + (f" (failed: {', '.join(failed)})" if failed else ""))


_SERVE_COLORS = {"colocated": "tab:gray", "kvbridge-router": "tab:red",
                 "kvbridge-proxy": "tab:orange", "nixl-router": "tab:blue"}


def plot_serve(report: dict[str, Any], fig: Any) -> None:
    """Per workload (a row of three): goodput, TTFT p99 and TPOT p99 against the Poisson
    rate, one line per configuration (repeats: their median, the range as error bars)."""
    import statistics

    workloads = report["settings"]["workloads"]
    for i, (workload, w) in enumerate(workloads.items()):
        for j, (key, label) in enumerate((("request_goodput", "goodput req/s"),
                                          ("p99_ttft_ms", "TTFT p99 ms (log)"),
                                          ("p99_tpot_ms", "TPOT p99 ms (log)"))):
            ax = fig.add_subplot(len(workloads), 3, 3 * i + j + 1)
            for name, result in report["configs"].items():
                by_rate: dict[float, list[float]] = {}
                for p in result.get("points", []):
                    if p["workload"] == workload and p["sweep"] == "rate":
                        by_rate.setdefault(p["rate"], []).append(p[key] or 0.0)
                if not by_rate:
                    continue
                rates = sorted(by_rate)
                mid = [statistics.median(by_rate[r]) for r in rates]
                spread = [[m - min(by_rate[r]) for r, m in zip(rates, mid, strict=True)],
                          [max(by_rate[r]) - m for r, m in zip(rates, mid, strict=True)]]
                ax.errorbar(rates, mid, yerr=spread, fmt="-o", capsize=3, label=name,
                            color=_SERVE_COLORS.get(name))
            if key == "request_goodput":  # rates placed from capacity are in the points
                top = max((p["rate"] for result in report["configs"].values()
                           for p in result.get("points", [])
                           if p["workload"] == workload and p["sweep"] == "rate"), default=1)
                ax.plot([0, top], [0, top], ":", color="black", linewidth=0.8,
                        label="offered rate")
            else:
                from matplotlib.ticker import FuncFormatter  # _pyplot() has imported it

                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
                ax.yaxis.set_minor_formatter(FuncFormatter(  # label 2s and 5s only
                    lambda v, _pos: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
                ax.tick_params(axis="y", which="minor", labelsize=7)
                slo = w["slo_ttft_ms"] if "ttft" in key else w["slo_tpot_ms"]
                ax.axhline(slo, linestyle="--", color="black", linewidth=0.8, label="SLO")
            ax.set_xlabel("request rate, req/s (Poisson)")
            ax.set_ylabel(label)
            ax.set_title(f"{workload}: {w['input_len']} in / {w['output_len']} out",
                         fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.legend(fontsize=7)
    skipped = [n for n, r in report["configs"].items() if "skipped" in r]
    failed = [n for n, r in report["configs"].items() if "error" in r]
    notes = (f" (skipped: {', '.join(skipped)})" if skipped else "") + \
        (f" (failed: {', '.join(failed)})" if failed else "")
    settings = report["settings"]
    where = ("running front ends" if settings.get("deployment")
             else f"CPU, cores {settings['cores']}, {report.get('network', 'loopback')}")
    fig.suptitle(f"vllm bench serve, {settings['model']}, {where}{notes}", fontsize=10)


PLOTTERS: dict[str, tuple[Callable[[dict[str, Any], Any], None], tuple[float, float]]] = {
    "transfer": (plot_transfer, (8.0, 5.0)),
    "kernels": (plot_kernels, (9.0, 7.0)),
    "paged": (plot_paged, (11.0, 4.5)),
    "e2e": (plot_e2e, (10.0, 4.0)),
    "vllm": (plot_vllm, (13.0, 4.0)),
    "serve": (plot_serve, (13.0, 7.0)),
}


def save_plot(name: str, report: dict[str, Any], path: Path) -> None:
    """Draw benchmark ``name``'s report into ``path`` (PNG).

    Raises:
        KeyError: no plot for ``name``.
        PlotUnavailable: matplotlib is missing.
    """
    plotter, size = PLOTTERS[name]
    plt = _pyplot()
    fig = plt.figure(figsize=size, dpi=90)
    try:
        plotter(report, fig)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
