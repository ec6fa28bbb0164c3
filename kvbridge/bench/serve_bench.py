"""``kvbridge bench serve``: goodput and latency under load (vllm bench serve), P/D vs colocated.

Called by ``kvbridge/bench/cli.py``. For each configuration in turn
(``kvbridge/bench/serve_configs.py``: colocated replicas behind vllm-router;
kvbridge's P and D behind vllm-router and behind ``kvbridge proxy``;
NixlConnector's behind vllm-router) it starts the servers and the front end,
runs vLLM's own load generator once per sweep point
(``kvbridge/bench/serve_client.py``), and stops them all before the next one.

Sweep, per workload (random prompts of ``input_len`` tokens, answers of
``output_len``, EOS ignored, greedy)::

    rate points:        Poisson arrivals at r req/s, no cap on requests in flight
    concurrency points: every request sent at once, at most c in flight

Rate points are fractions of the workload's capacity on this host
(``Workload.load_fractions``; ``serve_capacity.py`` says what capacity is,
why, and which configuration it is measured on, once per run, before the
first sweep; colocated runs first when it is among the configurations), or
fixed rates (``Workload.rates``: ``--rates``, ``--quick``).

Each point's prompts come from its own seed, the same in every
configuration: the configurations see the same requests, and no point
repeats another's prompts (P's prefix cache would answer them). Before the
sweep, 4 requests of the first workload warm each configuration up (not
reported); between points the benchmark waits until no server has a request
running or waiting. Each point also gets a profile (``serve_profile.py``): per
server its CPU use and vLLM's queue, prefill and decode time per request.
Goodput is vLLM's ``request_goodput``: requests per second that met both the
TTFT and the TPOT SLO of the workload; ``slo_attainment`` is their share.

A configuration whose tool is missing (vllm-router, nixl) is reported as
skipped with the install command; one that fails keeps the points measured
before the failure and the error.

With a :class:`Deployment` (``--url``) nothing is started: each front end
that is already running is a configuration, swept the same way
(:func:`run_deployment`), and the report says so (``settings["deployment"]``).

With ``netns`` (``--netns``) every configuration's servers run on two network
namespace hosts built once for the run, and talk UCX over TCP
(``kvbridge/bench/serve_netns.py``); the report's ``network`` says which
(``"netns-tcp"`` or ``"loopback"``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kvbridge.bench import serve_capacity, serve_configs, serve_netns, serve_profile
from kvbridge.bench.peers.placement import LOOPBACK, Placement, netns_placement
from kvbridge.bench.serve_client import ClientError, Point, parse_result, run_point
from kvbridge.bench.vllm_models import BENCH_MODEL, BLOCK_SIZES, MODEL_LABELS, build_model
from kvbridge.bench.vllm_servers import ServerError, scrape, start_all, total

Progress = Callable[[str, int, int], None]

_BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class Workload:
    """Prompt and answer lengths, the sweep, and the goodput SLOs of one workload.

    ``rates`` are fixed req/s; ``load_fractions`` rate points at those shares of the
    capacity, measured at ``capacity_concurrency`` (``serve_capacity.py``).
    """

    input_len: int
    output_len: int
    rates: tuple[float, ...]
    concurrency: tuple[int, ...]
    num_prompts: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    load_fractions: tuple[float, ...] = ()
    capacity_concurrency: int = 16


WORKLOADS = {
    "short": Workload(256, 64, rates=(), concurrency=(1, 4, 16), num_prompts=40,
                      slo_ttft_ms=1000.0, slo_tpot_ms=100.0,
                      load_fractions=serve_capacity.DEFAULT_LOAD_FRACTIONS,
                      capacity_concurrency=16),
    "long": Workload(2048, 128, rates=(), concurrency=(1, 2, 8), num_prompts=20,
                     slo_ttft_ms=2500.0, slo_tpot_ms=100.0,
                     load_fractions=serve_capacity.DEFAULT_LOAD_FRACTIONS,
                     capacity_concurrency=8),
}
QUICK: dict[str, Any] = {"workloads": ("short",), "rates": (2.0,), "load_fractions": (),
                         "concurrency": (4,), "num_prompts": 8, "point_timeout_s": 300.0}
FULL: dict[str, Any] = {"workloads": ("short", "long"), "point_timeout_s": 900.0}


def parse_workload(text: str) -> tuple[str, Workload]:
    """``short``, ``long``, or ``IN/OUT`` (token counts; short's sweep and SLOs).

    Raises:
        ValueError: neither a known name nor two positive integers.
    """
    if text in WORKLOADS:
        return text, WORKLOADS[text]
    try:
        input_len, output_len = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"workload {text!r}: expected {' or '.join(WORKLOADS)} or IN/OUT "
                         f"token counts such as 512/32") from None
    if input_len < 1 or output_len < 2:  # TPOT needs a second token
        raise ValueError(f"workload {text!r}: needs >= 1 input and >= 2 output tokens")
    return text, replace(WORKLOADS["short"], input_len=input_len, output_len=output_len)


def plan_points(workloads: dict[str, Workload], repeats: int) -> list[tuple[str, str, Point]]:
    """(workload name, sweep kind, point) in run order; each point gets its own seed.
    A load fraction is a rate point without a rate until ``serve_capacity.place_rates``."""
    points: list[tuple[str, str, Point]] = []
    for _ in range(repeats):
        for name, w in workloads.items():
            sweep: list[tuple[str, float | None, int | None, float | None]] = [
                ("rate", r, None, None) for r in w.rates]
            sweep += [("rate", None, None, f) for f in w.load_fractions]
            sweep += [("concurrency", None, c, None) for c in w.concurrency]
            for kind, rate, concurrency, fraction in sweep:
                seed = 1000 + len(points)
                points.append((name, kind, Point(
                    w.input_len, w.output_len, max(w.num_prompts, 2 * (concurrency or 1)),
                    rate, concurrency, w.slo_ttft_ms, w.slo_tpot_ms, seed, fraction)))
    return points


def wait_idle(server_urls: Sequence[str], timeout_s: float = 120.0) -> None:
    """Block until no vLLM server (its ``/metrics``) has a request running or waiting.

    Raises:
        ServerError: still busy after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {url: sum(total(scrape(url), name) for name in _BUSY) for url in server_urls}
        if not any(busy.values()):
            return
        if time.monotonic() > deadline:
            raise ServerError(f"requests still running or waiting {timeout_s:.0f} s after "
                              f"the point ended: {busy}")
        time.sleep(0.5)


@dataclass(frozen=True)
class Target:
    """What one configuration's points are sent to.

    Args:
        name: The configuration's name in the report; file names start with ``stem``.
        url: The OpenAI-compatible front end (``/v1/completions``).
        model: The model name requests carry; ``tokenizer`` builds the prompts.
        server_urls: vLLM servers whose ``/metrics`` tell when a point has drained
            (none: the next point starts when ``vllm bench serve`` returns) and give
            the profile its phases.
        server_names: Their names in the profile (default: their URLs).
        groups: (name, process group id) of the processes whose CPU the profile counts.
    """

    name: str
    url: str
    model: str | Path
    tokenizer: str | Path | None = None
    server_urls: tuple[str, ...] = ()
    server_names: tuple[str, ...] = ()
    groups: tuple[tuple[str, int], ...] = ()

    def snapshot(self) -> serve_profile.Snapshot:
        names = self.server_names or self.server_urls
        return serve_profile.snapshot(dict(zip(names, self.server_urls, strict=True)),
                                      dict(self.groups))

    @property
    def stem(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name).strip("_")


def _warm_up(target: Target, first: Point, out: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """A few requests of the first workload before the sweep, not reported with it: the
    first requests of a server (and P/D's first read, which connects) take longer.
    Its own seed: the sweep's prompts stay new to the servers."""
    point = replace(first, num_prompts=4, rate=None, concurrency=2, seed=1, load_fraction=None)
    raw = run_point(point, target.url, target.model,
                    out / "serve-results" / f"{target.stem}-warmup.json",
                    out / "serve-logs" / f"client-{target.stem}-warmup.log",
                    plan["point_timeout_s"], target.tokenizer)
    return {k: raw[k] for k in ("completed", "failed", "duration")}


def _sweep(target: Target, points: list[tuple[str, str, Point]], out: Path,
           plan: dict[str, Any], tick: Callable[[str], None], result: dict[str, Any],
           probe: serve_capacity.CapacityProbe | None = None) -> int:
    """Warm ``target`` up, measure what ``probe`` still lacks against it and place the
    load fractions, then run every point against it, appending rows to
    ``result["points"]``; the number of points done (also when one raises)."""
    result["warmup"] = _warm_up(target, points[0][2], out, plan)
    wait_idle(target.server_urls)
    points = (serve_capacity.place_rates(points, {}) if probe is None else probe.place(
        points, target.name, functools.partial(_measure_capacity, target, out, plan)))
    for workload, kind, point in points:
        label = (f"{target.stem}-{workload}-{kind}-{point.rate or point.concurrency:g}"
                 f"-s{point.seed}")
        row: dict[str, Any] = {"workload": workload, "sweep": kind, "rate": point.rate,
                               "load_fraction": point.load_fraction,
                               "concurrency": point.concurrency, "seed": point.seed,
                               "input_len": point.input_len, "output_len": point.output_len,
                               "loadavg": os.getloadavg()[0]}
        result_path = out / "serve-results" / f"{label}.json"
        # the profile: vLLM's phases of every request of the point; CPU from the
        # client's timed part (its start-up left out, unless its log never says)
        window = [target.snapshot()]
        raw = run_point(point, target.url, target.model, result_path,
                        out / "serve-logs" / f"client-{label}.log", plan["point_timeout_s"],
                        target.tokenizer,
                        on_main_run=functools.partial(_restart_cpu, window, target))
        row.update(parse_result(raw, point.output_len), result_file=str(result_path))
        result["points"].append(row)
        tick(label)
        wait_idle(target.server_urls)
        row["profile"] = serve_profile.usage(window[0], target.snapshot())
    return len(points)


def _restart_cpu(window: list[serve_profile.Snapshot], target: Target) -> None:
    window[0] = serve_profile.restart_cpu(window[0], dict(target.groups))


def _measure_capacity(target: Target, out: Path, plan: dict[str, Any], workload: str,
                      point: Point) -> tuple[dict[str, Any], Path]:
    """Run a capacity measurement (``serve_capacity.CapacityProbe``) against ``target``,
    then wait for idle servers; its saved JSON and where it is."""
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{target.stem}-{workload}-capacity-"
                   f"c{point.concurrency}-s{point.seed}")
    result_path = out / "serve-results" / f"{label}.json"
    raw = run_point(point, target.url, target.model, result_path,
                    out / "serve-logs" / f"client-{label}.log", plan["point_timeout_s"],
                    target.tokenizer)
    wait_idle(target.server_urls)
    return raw, result_path


def run_deployment(target: Target, points: list[tuple[str, str, Point]], out: Path,
                   plan: dict[str, Any], tick: Callable[[str], None],
                   probe: serve_capacity.CapacityProbe | None = None) -> dict[str, Any]:
    """Run every point against a front end that is already running (nothing is started
    or stopped); its report, as :func:`run_config`'s."""
    result: dict[str, Any] = {"url": target.url, "points": [],
                              "loadavg_start": os.getloadavg()}
    try:
        _sweep(target, points, out, plan, tick, result, probe)
    except (ServerError, ClientError, httpx.HTTPError, ValueError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    for _ in points[len(result["points"]):]:
        tick(f"{target.name} stopped")
    result["loadavg_end"] = os.getloadavg()
    return result


def run_config(name: str, points: list[tuple[str, str, Point]], model: Path, out: Path,
               plan: dict[str, Any], tick: Callable[[str], None],
               placement: Placement = LOOPBACK,
               probe: serve_capacity.CapacityProbe | None = None) -> dict[str, Any]:
    """Start configuration ``name`` (its servers placed as ``placement``), run every
    point against its front end (load fractions placed by ``probe``), stop it."""
    missing = serve_configs.missing_tool(name)
    if missing:
        for _ in points:
            tick(f"{name} skipped")
        return {"skipped": missing}
    log_dir = out / "serve-logs"
    servers = serve_netns.place(serve_configs.servers(
        name, model, log_dir, plan["cores"] == "split", plan["block_size"]), placement)
    front: serve_configs.FrontEnd | None = None
    result: dict[str, Any] = {"points": [], "loadavg_start": os.getloadavg(),
                              "logs": [str(s.log_path) for s in servers]}
    try:
        start_all(servers)
        front = serve_configs.front_end(name, servers, log_dir)
        result["logs"].append(str(front.log_path))
        front.start()
        groups = [(s.name, s.pid) for s in servers] + [("front", front.pid)]
        target = Target(name, front.url, model, server_urls=tuple(s.url for s in servers),
                        server_names=tuple(s.name for s in servers),
                        groups=tuple((n, pid) for n, pid in groups if pid is not None))
        _sweep(target, points, out, plan, tick, result, probe)
    except (ServerError, ClientError, httpx.HTTPError, ValueError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if front is not None:
            front.stop()
        for server in servers:
            server.stop()
        for _ in points[len(result["points"]):]:
            tick(f"{name} stopped")
    result["loadavg_end"] = os.getloadavg()
    return result


@dataclass(frozen=True)
class Deployment:
    """Front ends that are already running (``kvbridge bench serve --url``): measured as
    they are; nothing is started, placed or stopped.

    Args:
        urls: OpenAI-compatible front ends (a vllm-router, ``kvbridge proxy``, one
            vLLM server), each a configuration of the report, run one after another.
        tokenizer: What builds the prompts; default: the model name.
        server_urls: vLLM servers behind them whose ``/metrics`` tell when a point
            has drained (optional).
    """

    urls: tuple[str, ...]
    tokenizer: str | None = None
    server_urls: tuple[str, ...] = ()


def _check_choices(configs: list[str] | None, model: str | None, cores: str | None,
                   deployment: Deployment | None) -> list[str]:
    """The configurations to run (names, or URLs of a deployment).

    Raises:
        ValueError: as :func:`run`.
    """
    if deployment is not None:
        if configs or cores:
            raise ValueError("--url measures running front ends: --configs and --cores "
                             "(which start servers) do not apply")
        if not model:
            raise ValueError("--url needs --model: the model name the front end serves")
        if not deployment.urls or any(not u.startswith(("http://", "https://"))
                                      for u in deployment.urls):
            raise ValueError(f"--url {list(deployment.urls)}: expected http(s)://HOST:PORT")
        return list(deployment.urls)
    configs = configs or list(serve_configs.CONFIGS)
    for name in configs:
        serve_configs.missing_tool(name)  # raises ValueError on an unknown name
    if cores not in (None, "split", "shared"):
        raise ValueError(f"cores {cores!r}: expected 'split' or 'shared'")
    if cores in (None, "split") and len(os.sched_getaffinity(0)) < 2:
        raise ValueError("cores 'split' needs 2 cores")
    return configs


def run(quick: bool, configs: list[str] | None = None, workloads: list[str] | None = None,
        rates: list[float] | None = None, concurrency: list[int] | None = None,
        num_prompts: int | None = None, repeats: int = 1, slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None, model: str | None = None, out: str = "bench-out",
        cores: str | None = None, point_timeout_s: float | None = None,
        progress: Progress | None = None,
        deployment: Deployment | None = None, netns: bool = False,
        load_fractions: list[float] | None = None,
        capacities: dict[str, float] | None = None) -> dict[str, Any]:
    """Run every configuration in ``configs`` (or every front end of ``deployment``)
    over the sweep; the report.

    Args:
        quick: The short workload at one rate and one concurrency, 8 prompts each.
        configs: Names from ``serve_configs.CONFIGS``, run in that order (default: all).
        workloads: ``short``, ``long`` or ``IN/OUT`` (default: short and long; quick: short).
        rates: Fixed Poisson rates (req/s) for every workload, instead of each one's
            load fractions (no capacity measured); an empty list: no rate points.
        concurrency: Concurrency points, as ``rates``.
        num_prompts: Requests per point (at least twice the concurrency).
        repeats: Times the whole sweep runs (each with new prompts).
        slo_ttft_ms, slo_tpot_ms: Goodput SLOs for every workload.
        model: Model folder; default: ``kvbridge bench vllm``'s dense random Llama.
            With ``deployment``: the model name its front ends serve (required).
        out: Raw ``vllm bench serve`` JSON goes to ``<out>/serve-results``, logs to
            ``<out>/serve-logs``.
        cores: "split" (default: a server per core, as ``kvbridge bench vllm``) or
            "shared".
        point_timeout_s: Longest one point may run.
        deployment: Measure these running front ends instead of starting ``configs``.
        netns: Run every configuration's servers on two network namespace hosts
            (``serve_netns.py``), built now and removed before this returns.
        load_fractions: Rate points at these shares of each workload's capacity
            (``serve_capacity.py``), instead of ``rates`` or quick's fixed rate.
        capacities: Req/s by workload name: not measured (``--capacity``).

    Raises:
        ValueError: an unknown configuration or workload, no point to run, repeats
            < 1, "split" on < 2 cores; with ``deployment``: ``configs`` or ``cores``
            given, no ``model``, a URL that is not http(s), ``netns``; ``rates`` and
            ``load_fractions`` both given; ``serve_capacity.LoadFractionError``,
            ``serve_capacity.CapacityError`` (a capacity for a workload without
            load fractions).
        NetnsUnavailableError: ``netns`` and the hosts cannot be built.
    """
    if rates is not None and load_fractions is not None:
        raise ValueError("--rates and --load-fractions both place the rate points: "
                         "give one")
    if netns and deployment is not None:
        raise ValueError(serve_netns.WITH_URL)
    configs = _check_choices(configs, model, cores, deployment)
    cores = cores or "split"
    if repeats < 1:
        raise ValueError(f"repeats {repeats}: expected at least 1")
    base = QUICK if quick else FULL
    chosen = dict(parse_workload(w) for w in (workloads or base["workloads"]))
    rate_points: dict[str, Any] = (
        {"rates": tuple(rates), "load_fractions": ()} if rates is not None else
        {"rates": (), "load_fractions": serve_capacity.check_load_fractions(load_fractions)}
        if load_fractions is not None else
        {k: base[k] for k in ("rates", "load_fractions") if k in base})
    overrides: dict[str, Any] = {
        **rate_points,
        "concurrency": tuple(concurrency) if concurrency is not None
        else base.get("concurrency"),
        "num_prompts": num_prompts or base.get("num_prompts"),
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms}
    chosen = {name: replace(w, **{k: v for k, v in overrides.items() if v is not None})
              for name, w in chosen.items()}
    points = plan_points(chosen, repeats)
    if not points:
        raise ValueError("nothing to run: every workload has no rate and no concurrency point")
    plan: dict[str, Any] = {"point_timeout_s": point_timeout_s or base["point_timeout_s"]}
    progress = progress or (lambda _label, _done, _total: None)
    ticks: list[str] = []
    num_steps = len(points) * len(configs)

    def tick(label: str) -> None:
        ticks.append(label)
        progress(label, len(ticks), num_steps)

    probe = serve_capacity.CapacityProbe(
        chosen, capacities or {}, lambda line: progress(line, len(ticks), num_steps))
    if probe.needs_measurement and deployment is None and "colocated" in configs:
        configs = ["colocated", *(c for c in configs if c != "colocated")]  # the reference

    common = {"repeats": repeats, "workloads": {name: asdict(w) for name, w in chosen.items()}}
    if deployment is not None:
        assert model is not None  # _check_choices
        results = {url: run_deployment(Target(url, url, model, deployment.tokenizer,
                                              deployment.server_urls),
                                       points, Path(out), plan, tick, probe)
                   for url in configs}
        settings = {**plan, **common, "capacity": probe.record(), "configs": configs,
                    "model": model,
                    "tokenizer": deployment.tokenizer or model,
                    "server_urls": list(deployment.server_urls), "deployment": True}
        return {"settings": settings, "configs": results}
    plan.update(cores=cores, block_size=BLOCK_SIZES["dense"])
    hosts = netns_placement(join_caller=True) if netns else contextlib.nullcontext(LOOPBACK)
    with tempfile.TemporaryDirectory(prefix="kvb-bench-serve-") as tmp, hosts as placement:
        model_dir = Path(model) if model else build_model(Path(tmp) / "model", "dense")
        results = {name: run_config(name, points, model_dir, Path(out), plan, tick, placement,
                                    probe)
                   for name in configs}
        where = {"network": placement.network,  # hosts (if any) are gone after this block
                 "placement": {**placement.describe(), "roles": serve_netns.roles(placement)}}
    settings = {**plan, **common, "capacity": probe.record(), "configs": configs,
                "model": model or f"{MODEL_LABELS['dense']} (built)",
                "model_shape": BENCH_MODEL if not model else None}
    return {**where, "settings": settings, "configs": results}
