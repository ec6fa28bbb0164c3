"""``kvbridge bench serve``'s rate points as fractions of what this host serves.

Called by ``kvbridge/bench/serve_bench.py`` (one :class:`CapacityProbe` per run)
and ``kvbridge/bench/cli.py`` (``--load-fractions``, ``--capacity``). A fixed
rate is a different regime on every host: 1 req/s of 2048-token prompts is
within what the 2-core VM of docs/benchmarks.md serves, and ten times what a
CPU with AVX2 only serves (a 2048-token prefill there takes 11.5 s, not 0.9 s),
where every configuration's goodput is 0 and the sweep says nothing. So each
workload's rate points are fractions of its capacity, measured on the host::

    capacity C (req/s) = vLLM's request_throughput (completed / duration) of
                         2c requests at concurrency c, the reference configuration
    --load-fractions 0.3,0.5,0.7,0.9  ->  Poisson rates 0.3C 0.5C 0.7C 0.9C
                                          (3 significant digits: they name files)

**Capacity is the throughput at saturation, not replicas / latency at
concurrency 1.** vLLM batches: a server decodes many requests in one step, so
what two servers sustain is well above two requests at a time. On the 2-core VM
(issue #30's runs) colocated took 0.78 s per short request at concurrency 1,
so 2 replicas / 0.78 s = 2.6 req/s; yet it kept 100% within SLO at 6 req/s and
did 8.2 req/s at concurrency 16. Fractions of 2.6 req/s would load no
configuration, and the sweep would again say nothing, from below. Throughput
at saturation counts batching where the host has it (short answers on fast
cores) and comes down to the prefill rate where it has not (slow cores, long
prompts): 0.7x is then the same regime on both. ``c`` is the workload's
heaviest concurrency point (short 16, long 8), 2c requests are two waves of it.

**The reference is colocated** (when it is among ``--configs``; otherwise the
first configuration, with ``--url`` the first URL): the baseline P/D has to
beat, so 0.7x is a load colocated's two servers carry, and every configuration
gets the same absolute rates at it. It is measured once per run and workload,
after the warm-up of the first configuration that reaches its sweep (one that
is skipped or fails first leaves it to the next), with seed 500 + the
workload's index (the warm-up has 1, sweep points 1000 and up), and every
repeat reuses it. ``--capacity WORKLOAD=REQ_PER_S`` gives it instead.
Explicit ``--rates`` and ``--quick`` keep fixed rates and measure nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from kvbridge.bench.serve_client import Point

DEFAULT_LOAD_FRACTIONS = (0.3, 0.5, 0.7, 0.9)
MAX_LOAD_FRACTION = 2.0  # beyond, a percentage typed as 70 more likely than a wish
CAPACITY_SEED = 500  # + the workload's index: below the sweep's 1000 and up

Planned = tuple[str, str, Point]  # (workload, sweep kind, point), as serve_bench plans them
Measure = Callable[[str, Point], tuple[dict[str, Any], Path]]


class LoadFractionError(ValueError):
    """A load fraction that is not a number in (0, ``MAX_LOAD_FRACTION``], or a repeat."""


class CapacityError(ValueError):
    """A capacity that cannot be used: a bad ``--capacity``, a measurement with failed
    requests, or a rate point whose workload has none."""


class Workload(Protocol):
    """What the probe reads of ``serve_bench.Workload`` (a frozen dataclass)."""

    @property
    def input_len(self) -> int: ...
    @property
    def output_len(self) -> int: ...
    @property
    def load_fractions(self) -> tuple[float, ...]: ...
    @property
    def capacity_concurrency(self) -> int: ...
    @property
    def slo_ttft_ms(self) -> float: ...
    @property
    def slo_tpot_ms(self) -> float: ...


def check_load_fractions(values: Sequence[float]) -> tuple[float, ...]:
    """``values`` as a tuple, if each is in (0, ``MAX_LOAD_FRACTION``] and none repeats.

    Raises:
        LoadFractionError: with the values at fault.
    """
    bad = [v for v in values if not 0 < v <= MAX_LOAD_FRACTION]  # NaN is bad too
    if bad:
        raise LoadFractionError(f"load fractions {bad}: expected shares of capacity in "
                                f"(0, {MAX_LOAD_FRACTION:g}], e.g. 0.3,0.5,0.7,0.9")
    repeated = sorted({v for v in values if list(values).count(v) > 1})
    if repeated:
        raise LoadFractionError(f"load fractions {repeated} given more than once")
    return tuple(values)


def parse_load_fractions(text: str) -> tuple[float, ...]:
    """``0.3,0.5,0.7,0.9``; ``''``: no rate points.

    Raises:
        LoadFractionError: not comma-separated numbers, or as :func:`check_load_fractions`.
    """
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LoadFractionError(f"load fractions {text!r}: expected comma-separated "
                                f"numbers such as 0.3,0.5,0.7,0.9") from None
    return check_load_fractions(values)


def parse_capacity(text: str) -> tuple[str, float]:
    """``WORKLOAD=REQ_PER_S`` (e.g. ``long=0.9``, ``512/32=3``): (workload, req/s).

    Raises:
        CapacityError: no ``=``, or not a positive finite number after it.
    """
    name, sep, value = text.rpartition("=")
    try:
        req_per_s = float(value)
    except ValueError:
        req_per_s = math.nan
    if not sep or not name or not 0 < req_per_s < math.inf:
        raise CapacityError(f"capacity {text!r}: expected WORKLOAD=REQ_PER_S with a "
                            f"positive rate, e.g. short=6.5")
    return name, req_per_s


@dataclass(frozen=True)
class Capacity:
    """One workload's capacity, and where it came from.

    Args:
        workload: Its name in the run.
        req_per_s: The capacity.
        how: ``measured``, or ``given`` (``--capacity``; no other field set).
        config: The configuration (or URL) measured.
        concurrency, num_prompts, seed: The measurement's ``vllm bench serve`` run.
        completed, duration_s: What it did; ``req_per_s`` is their ratio.
        mean_e2el_ms, mean_ttft_ms, mean_tpot_ms: Its requests' latencies.
        result_file: Its saved JSON.
    """

    workload: str
    req_per_s: float
    how: str
    config: str | None = None
    concurrency: int | None = None
    num_prompts: int | None = None
    seed: int | None = None
    completed: int | None = None
    duration_s: float | None = None
    mean_e2el_ms: float | None = None
    mean_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    result_file: str | None = None


def capacity_from_result(workload: str, raw: dict[str, Any], config: str, point: Point,
                         result_file: Path) -> Capacity:
    """The capacity a measurement's saved ``vllm bench serve`` JSON shows.

    Raises:
        CapacityError: a request failed (the servers did not serve the load: no
            capacity to place points by), or none completed.
    """
    if raw["failed"] or not raw["completed"] or raw["request_throughput"] <= 0:
        raise CapacityError(f"capacity of {workload} on {config}: {raw['completed']} "
                            f"completed, {raw['failed']} failed of {point.num_prompts} "
                            f"requests at concurrency {point.concurrency} ({result_file})")
    return Capacity(workload, raw["request_throughput"], "measured", config,
                    point.concurrency, point.num_prompts, point.seed, raw["completed"],
                    raw["duration"], raw.get("mean_e2el_ms"), raw.get("mean_ttft_ms"),
                    raw.get("mean_tpot_ms"), str(result_file))


def rate_at(fraction: float, req_per_s: float) -> float:
    """``fraction`` of ``req_per_s``, to 3 significant digits."""
    return float(f"{fraction * req_per_s:.3g}")


def place_rates(points: Sequence[Planned], capacities: Mapping[str, float]) -> list[Planned]:
    """``points`` with every load-fraction point at its rate (a new list; the others
    as they are).

    Raises:
        CapacityError: a load-fraction point of a workload not in ``capacities``.
    """
    placed = []
    for workload, kind, point in points:
        if point.load_fraction is not None:
            if workload not in capacities:
                raise CapacityError(f"rate point {point.load_fraction:g}x of {workload}: "
                                    f"no capacity measured or given for {workload}")
            point = replace(point, rate=rate_at(point.load_fraction,
                                                capacities[workload]))
        placed.append((workload, kind, point))
    return placed


class CapacityProbe:
    """The capacity of each workload of one run: given, or measured once, against the
    first configuration that asks (:meth:`place`). Owned by ``serve_bench.run``; the
    configurations run one after another (not thread-safe).

    Args:
        workloads: The run's workloads by name; those with ``load_fractions`` need
            a capacity.
        given: Capacities that are not measured (``--capacity``), req/s by workload.
        announce: Called with a line for each capacity measured (the progress bar).

    Raises:
        CapacityError: ``given`` names a workload not in ``workloads`` or one without
            load fractions.
    """

    def __init__(self, workloads: Mapping[str, Workload], given: Mapping[str, float],
                 announce: Callable[[str], None] = lambda _line: None) -> None:
        self._fractions = {n: w.load_fractions for n, w in workloads.items() if w.load_fractions}
        for name in given:
            if name not in self._fractions:
                why = ("not among the run's workloads" if name not in workloads else
                       "its rate points are fixed (--rates or --quick)")
                raise CapacityError(f"--capacity {name}: {why}; workloads with load "
                                    f"fractions: {list(self._fractions) or 'none'}")
        self._capacities = {n: Capacity(n, given[n], "given") for n in given}
        self._to_measure = {
            name: Point(w.input_len, w.output_len, 2 * w.capacity_concurrency, None,
                        w.capacity_concurrency, w.slo_ttft_ms, w.slo_tpot_ms,
                        CAPACITY_SEED + i)
            for i, (name, w) in enumerate(workloads.items())
            if w.load_fractions and name not in given}
        self._announce = announce

    @property
    def needs_measurement(self) -> bool:
        """Whether a workload's capacity is still to be measured."""
        return any(name not in self._capacities for name in self._to_measure)

    def place(self, points: Sequence[Planned], config: str, measure: Measure) -> list[Planned]:
        """Measure each capacity not known yet with ``measure(workload, point)`` (against
        ``config``: it returns the saved JSON and its path), then :func:`place_rates`.

        Raises:
            CapacityError: as :func:`capacity_from_result`; capacities measured
                before it are kept, the rest is left to the next caller.
            Whatever ``measure`` raises, likewise.
        """
        for name, point in self._to_measure.items():
            if name not in self._capacities:
                raw, result_file = measure(name, point)
                self._capacities[name] = capacity_from_result(name, raw, config, point,
                                                              result_file)
                self._announce(f"capacity of {name}: "
                               f"{describe(self.record()[name], rates=False)}")
        return place_rates(points, {n: c.req_per_s for n, c in self._capacities.items()})

    def record(self) -> dict[str, dict[str, Any]]:
        """Each known capacity (``serve.json``'s ``settings["capacity"]``), with its
        load fractions and the rates they came to."""
        return {name: {**asdict(c), "load_fractions": list(self._fractions[name]),
                       "rates": [rate_at(f, c.req_per_s) for f in self._fractions[name]]}
                for name, c in self._capacities.items()}


def describe(record: dict[str, Any], rates: bool = True) -> str:
    """One line of a :meth:`CapacityProbe.record` entry, for the table."""
    if record["how"] == "given":
        text = f"{record['req_per_s']:.3g} req/s, given (--capacity)"
    else:
        text = (f"{record['req_per_s']:.3g} req/s, {record['config']}'s throughput at "
                f"concurrency {record['concurrency']} ({record['completed']} requests in "
                f"{record['duration_s']:.1f} s, mean e2e latency "
                f"{record['mean_e2el_ms'] or 0:,.0f} ms)")
    if rates and record["load_fractions"]:
        text += "; rate points " + ", ".join(
            f"{f:g}x = {r:g}/s" for f, r in zip(record["load_fractions"], record["rates"],
                                                 strict=True))
    return text
