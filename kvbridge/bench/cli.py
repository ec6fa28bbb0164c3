"""``kvbridge bench {transfer,kernels,paged,e2e,vllm,serve,sglang,all}``: run and show benchmarks.

``kvbridge/cli/bench.py`` hands the arguments after ``bench`` to :func:`main`
(installed kvbridge and source checkout alike). Each subcommand runs
one benchmark module's ``run()`` with a progress bar (tqdm on a terminal, plain
lines otherwise), then prints a table and writes ``<out>/<name>.json`` (the
result plus the machine it ran on) and ``<out>/<name>.png``. See
``docs/benchmarks.md`` for what each number means. ``all`` runs every one but
``vllm`` and ``serve``, which need vLLM installed (``make setup-vllm``) and
several minutes (``serve``: tens of minutes).

``transfer --netns`` runs every system between two network-namespace hosts
over TCP (``kvbridge/bench/peers/placement.py``) and writes ``transfer_netns.json``
/ ``.png``, so that it does not overwrite the loopback run's files. It needs
root and ``ip``; without them it says so and exits with 2 before anything runs.
``serve --netns`` likewise runs P and D (and colocated's replicas) on two such
hosts (``kvbridge/bench/serve_netns.py``) and writes ``serve_netns.*``; with
``--url`` (nothing started, nothing to place) it is refused the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvbridge.bench import tables as bench_tables
from kvbridge.bench.peers.placement import NetnsUnavailableError, check_netns
from kvbridge.bench.plots import PlotUnavailable, save_plot
from kvbridge.bench.serve_capacity import (
    CapacityError,
    LoadFractionError,
    parse_capacity,
    parse_load_fractions,
)
from kvbridge.bench.vllm_models import MODEL_KINDS

BENCHMARKS = ("paged", "kernels", "transfer", "e2e")  # what ``all`` runs
DEFAULT_PEERS = "ucx_perftest,ucx_perftest_get,nixl,mooncake,kvbridge_copy"
DEFAULT_CONNECTORS = "colocated,kvbridge,kvbridge-classic,nixl"


class ProgressBar:
    """``progress(label, done, total)`` callback: a tqdm bar on a TTY, else plain lines.

    Args:
        name: Shown before each line / as the bar's description.
        stream: Where progress goes (stderr by default, so tables stay clean).
    """

    def __init__(self, name: str, stream: IO[str] | None = None) -> None:
        self.name = name
        self.stream = stream or sys.stderr
        self._started = time.monotonic()
        self._bar: Any = None
        self._use_tqdm = self.stream.isatty()
        if self._use_tqdm:
            try:
                import tqdm  # noqa: F401  (the bench extra)
            except ImportError:
                self._use_tqdm = False

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self._use_tqdm:
            elapsed_s = time.monotonic() - self._started
            print(f"[{self.name} {done}/{total}] {label} ({elapsed_s:.0f} s)",
                  file=self.stream, flush=True)
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self.name, file=self.stream, unit="step")
        self._bar.set_postfix_str(label, refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        """Finish the bar (no-op for plain lines). Idempotent."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def machine_info() -> dict[str, Any]:
    """Cores, memory, CPU model, load average, versions: what limits every number."""
    info: dict[str, Any] = {"nproc": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    try:
        meminfo = Path("/proc/meminfo").read_text().split()
        info["mem_total_gib"] = round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1)
        cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("model name")]
        info["cpu_model"] = cpu[0].split(":", 1)[1].strip() if cpu else "unknown"
        # what vLLM's CPU build decides from (fp8 KV, kernels, bf16 speed)
        flags = next((line.split(":", 1)[1].split() for line in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
        info["cpu_simd"] = sorted(f for f in flags if f.startswith(("avx", "amx")))
    except (OSError, ValueError):
        pass  # not Linux: leave the fields out
    info["loadavg_start"] = os.getloadavg()
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def _run(name: str, args: argparse.Namespace, progress: ProgressBar) -> dict[str, Any]:
    """Run benchmark ``name``'s module with the parsed options."""
    if name == "paged":
        from kvbridge.bench import paged_bench

        return paged_bench.run(args.quick, progress=progress)
    if name == "kernels":
        from kvbridge.bench import kernel_bench

        return dict(kernel_bench.run(args.quick, args.blocks, args.reps, args.clock, progress))
    if name == "transfer":
        from kvbridge.bench import transfer_bench

        peers = [p for p in args.peers.split(",") if p]
        return transfer_bench.run(args.quick, peers, args.pieces, args.peer_iters, progress,
                                  netns=getattr(args, "netns", False))
    if name == "vllm":
        from kvbridge.bench import vllm_bench

        return vllm_bench.run(args.quick, args.lengths, args.requests,
                              [c for c in args.connectors.split(",") if c], args.model,
                              args.out, args.kvbridge_extra, args.cores, progress,
                              args.model_kind)
    if name == "sglang":
        from kvbridge.bench import sglang_bench

        backends = [b for b in (args.backends or "").split(",") if b] or None
        return sglang_bench.run(args.quick, args.lengths, args.requests, backends,
                                args.sglang_python, progress)
    if name == "serve":
        from kvbridge.bench import serve_bench

        deployment = None if not args.url else serve_bench.Deployment(
            tuple(args.url), args.tokenizer, tuple(args.server_url or ()))
        configs = None if args.configs is None else [c for c in args.configs.split(",") if c]
        return serve_bench.run(args.quick, configs, args.workloads, args.rates,
                               args.concurrency, args.num_prompts, args.repeats,
                               args.slo_ttft_ms, args.slo_tpot_ms, args.model, args.out,
                               args.cores, args.point_timeout_s, progress, deployment,
                               netns=args.netns, load_fractions=args.load_fractions,
                               capacities=dict(args.capacity or ()))
    from kvbridge.bench import e2e_bench

    return e2e_bench.run(args.quick, args.lengths, args.max_tokens, args.repeats,
                         progress=progress)


def run_benchmark(name: str, args: argparse.Namespace) -> int:
    """Run one benchmark; print its table, write its JSON and PNG under ``args.out``.

    Returns:
        0, or 1 when the result failed its own checks (unverified bytes,
        mismatching answers).
    """
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_netns" if getattr(args, "netns", False) else name
    machine = machine_info()
    progress = ProgressBar(name)
    started = time.monotonic()
    try:
        result = _run(name, args, progress)
    finally:
        progress.close()
    machine["loadavg_end"] = os.getloadavg()
    record = {"benchmark": name, "quick": args.quick, "argv": sys.argv,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "duration_s": round(time.monotonic() - started, 1), "machine": machine,
              "result": result}
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"\n== kvbridge bench {name}  (load average {machine['loadavg_start'][0]:.2f} -> "
          f"{machine['loadavg_end'][0]:.2f} on {machine['nproc']} cores)")
    if result.get("network") == "netns-tcp":
        hosts = result["placement"]
        print(f"two netns hosts over TCP (UCX_TLS=tcp): serving side on {hosts['serve_ip']}, "
              f"reading side on {hosts['read_ip']}")
    print(bench_tables.TABLES[name](result))
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        try:
            save_plot(name, result, out / f"{stem}.png")
            print(f"wrote {out / f'{stem}.png'}")
        except PlotUnavailable as exc:
            print(f"no plot: {exc}")
        except KeyError:
            pass  # a benchmark without a plot
    return 0 if bench_tables.passed(name, result) else 1


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    """Comma-separated positive numbers; '' is the empty list (no such points)."""
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _int_list_or_none(text: str) -> list[int]:
    """As ``_int_list``, but '' is the empty list (no such points)."""
    return _int_list(text) if text.strip(",") else []


def _workload(text: str) -> str:
    from kvbridge.bench.serve_bench import parse_workload

    try:
        parse_workload(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _load_fractions(text: str) -> list[float]:
    try:
        return list(parse_load_fractions(text))
    except LoadFractionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _capacity(text: str) -> tuple[str, float]:
    try:
        return parse_capacity(text)
    except CapacityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``kvbridge bench`` parser (one subcommand per benchmark, plus ``all``)."""
    parser = argparse.ArgumentParser(prog="kvbridge bench", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    common.add_argument("--out", default="bench-out", help="directory for JSON and PNG files")
    common.add_argument("--no-plot", action="store_true", help="skip the PNG")
    sub = parser.add_subparsers(dest="which", required=True)
    helps = {"paged": "paged KV manager: allocate/free, prefix hits, hashing, scheduler step",
             "kernels": "pack/unpack GB/s against memcpy and the three-pass fix",
             "transfer": "TransferAgent GB/s and latency beside NIXL, Mooncake, ucx_perftest",
             "e2e": "TTFT and decode tokens/s, P/D against colocated",
             "vllm": "TTFT and KV load time of P/D in vLLM: kvbridge, NixlConnector, colocated",
             "serve": "goodput and latency under load (vllm bench serve): P/D behind "
                      "vllm-router and kvbridge proxy vs colocated, or front ends "
                      "already running (--url)",
             "sglang": "TTFT of SGLang P/D per transfer backend (kvbridge, mooncake over "
                       "TCP, nixl) beside a single SGLang server (needs .venv-sglang)",
             "all": "every benchmark above but vllm, serve and sglang, one after another"}
    subs = {name: sub.add_parser(name, parents=[common], help=text)
            for name, text in helps.items()}
    for name in ("transfer", "all"):
        subs[name].add_argument("--peers", default=DEFAULT_PEERS,
                                help=f"comma list of peers ('' for none; default {DEFAULT_PEERS})")
        subs[name].add_argument("--pieces", type=_int_list, default=None,
                                help="request sizes in 64 KiB pieces, e.g. 1,16,32,1024")
        subs[name].add_argument("--peer-iters", type=int, default=None,
                                help="timed requests per size for the peers")
    subs["transfer"].add_argument(
        "--netns", action="store_true",
        help="every system between two network-namespace hosts over TCP (UCX_TLS=tcp), "
             "built and removed by the run; needs root and ip; writes transfer_netns.*")
    for name in ("kernels", "all"):
        subs[name].add_argument("--blocks", type=_int_list, default=None,
                                help="block counts, e.g. 64,256,1024")
        subs[name].add_argument("--reps", type=int, default=3, help="timed runs (best kept)")
        subs[name].add_argument("--clock", choices=["wall", "thread"], default="wall")
    for name in ("e2e", "all"):
        subs[name].add_argument("--lengths", type=_int_list, default=None,
                                help="prompt lengths in tokens (default 64,512,1536)")
        subs[name].add_argument("--max-tokens", type=int, default=None)
        subs[name].add_argument("--repeats", type=int, default=None)
    vllm = subs["vllm"]
    vllm.add_argument("--lengths", type=_int_list, default=None,
                      help="prompt lengths in tokens (default 64,256,512,1024,1500)")
    vllm.add_argument("--requests", type=int, default=None,
                      help="timed requests per length (default 10, --quick 2)")
    vllm.add_argument("--connectors", default=DEFAULT_CONNECTORS,
                      help=f"configurations, run one at a time (default {DEFAULT_CONNECTORS})")
    vllm.add_argument("--model", default=None,
                      help="model folder (default: a random Llama, hidden 512, 8 layers, "
                           "built into a temp dir)")
    vllm.add_argument("--model-kind", choices=list(MODEL_KINDS), default="dense",
                      help="model built when --model is not given: dense (Llama, default), "
                           "mla (DeepSeek-V2), moe (Qwen3-MoE), swa (Gemma 3: sliding "
                           "window), linear (Qwen3-Next: linear attention; first-token "
                           "flow only)")
    vllm.add_argument("--cores", choices=["split", "shared"], default="split",
                      help="split (default): P and colocated on core 0, D on core 1, one "
                           "thread each; shared: every server on every core")
    vllm.add_argument("--kvbridge-extra", type=_json_object, default=None,
                      help="kv_connector_extra_config of kvbridge's P and D, "
                           "e.g. '{\"idle_wait_s\": 0.005}'")
    _add_serve_options(subs["serve"])
    sglang = subs["sglang"]
    sglang.add_argument("--lengths", type=_int_list, default=None,
                        help="prompt lengths in words (default 64,512,1500; --quick 64,512)")
    sglang.add_argument("--requests", type=int, default=None,
                        help="timed requests per point (default 10, --quick 3)")
    sglang.add_argument("--backends", default=None,
                        help="comma list of kvbridge, mooncake, nixl (default: all three)")
    sglang.add_argument("--sglang-python", default=None,
                        help="the SGLang venv's python (default $KVBRIDGE_SGLANG_VENV or "
                             ".venv-sglang)")
    return parser


def _add_serve_options(serve: argparse.ArgumentParser) -> None:
    from kvbridge.bench.serve_configs import CONFIGS

    default_configs = ",".join(CONFIGS)
    serve.add_argument("--configs", default=None,
                       help=f"configurations it starts, one at a time (default "
                            f"{default_configs})")
    serve.add_argument("--url", action="append", default=None, metavar="URL",
                       help="instead of starting servers: an OpenAI-compatible front end "
                            "that is already running (vllm-router, kvbridge proxy, a vLLM "
                            "server), e.g. http://router:8000; repeat it to compare several; "
                            "needs --model")
    serve.add_argument("--tokenizer", default=None,
                       help="with --url: the tokenizer that builds the prompts (folder or "
                            "Hugging Face name; default: --model)")
    serve.add_argument("--server-url", action="append", default=None, metavar="URL",
                       help="with --url: a vLLM server behind it whose /metrics tell when "
                            "a point has drained (repeat for each; optional)")
    serve.add_argument("--workloads", type=_workload, nargs="+", default=None,
                       help="short (256 in / 64 out), long (2048 / 128) or IN/OUT "
                            "(default: short long; --quick: short)")
    rate_points = serve.add_mutually_exclusive_group()
    rate_points.add_argument(
        "--load-fractions", type=_load_fractions, default=None,
        help="rate points as shares of each workload's capacity, measured on this host "
             "before the sweep (colocated's request throughput at concurrency 16, long: 8); "
             "'' for none (default 0.3,0.5,0.7,0.9; each in (0, 2])")
    rate_points.add_argument(
        "--rates", type=_float_list, default=None,
        help="fixed Poisson request rates, req/s, for every workload, instead of load "
             "fractions: no capacity measured ('' for none; --quick 2)")
    serve.add_argument("--capacity", type=_capacity, action="append", default=None,
                       metavar="WORKLOAD=REQ_PER_S",
                       help="a workload's capacity, not measured (e.g. long=0.9; repeat "
                            "per workload); its load fractions are placed from it")
    serve.add_argument("--concurrency", type=_int_list_or_none, default=None,
                       help="concurrency points ('' for none; default short 1,4,16, "
                            "long 1,2,8; --quick 4)")
    serve.add_argument("--num-prompts", type=int, default=None,
                       help="requests per point (default short 40, long 20; --quick 8)")
    serve.add_argument("--repeats", type=int, default=1,
                       help="times the whole sweep runs, new prompts each time (default 1)")
    serve.add_argument("--slo-ttft-ms", type=float, default=None,
                       help="goodput SLO on TTFT for every workload (default short 1000, "
                            "long 2500)")
    serve.add_argument("--slo-tpot-ms", type=float, default=None,
                       help="goodput SLO on TPOT for every workload (default 100)")
    serve.add_argument("--model", default=None,
                       help="model folder (default: kvbridge bench vllm's random Llama); "
                            "with --url: the model name the front end serves")
    serve.add_argument("--cores", choices=["split", "shared"], default=None,
                       help="split (default): colocated replica 0 and P on core 0, replica 1 "
                            "and D on core 1; shared: every server on every core")
    serve.add_argument("--netns", action="store_true",
                       help="P (and replica 0) and D (replica 1) on two network-namespace "
                            "hosts, UCX over TCP (UCX_TLS=tcp); front end and client in this "
                            "namespace; built and removed by the run; needs root and ip; "
                            "not with --url; writes serve_netns.*")
    serve.add_argument("--point-timeout-s", type=float, default=None,
                       help="longest one point may run (default 900, --quick 300)")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (the words after ``kvbridge bench``) and run; the exit code."""
    args = build_parser().parse_args(argv)
    # ucxx sets UCX_MEMTYPE_CACHE, which libucx 1.21 no longer knows: one warning
    # per process otherwise. Spawned benchmark processes inherit this.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    names = BENCHMARKS if args.which == "all" else (args.which,)
    try:
        if getattr(args, "netns", False):
            if getattr(args, "url", None):
                from kvbridge.bench.serve_netns import WITH_URL

                print(f"kvbridge bench serve --netns: {WITH_URL}", file=sys.stderr)
                return 2
            check_netns()  # before anything runs; building the hosts may still refuse
        return max(run_benchmark(name, args) for name in names)
    except NetnsUnavailableError as exc:
        print(f"kvbridge bench {args.which} --netns: {exc}", file=sys.stderr)
        return 2
    except (LoadFractionError, CapacityError) as exc:  # serve's options, before it runs
        print(f"kvbridge bench {args.which}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
