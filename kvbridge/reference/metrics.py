"""``/metrics`` of the reference engine's server: Prometheus text through
``prometheus_client``.

``server.py`` owns one :class:`ServerMetrics`: the HTTP-level counters and
latency histograms its handlers update per request, plus a ``CollectorRegistry``
of its own (never the process-wide one: tests run several servers in one
process). On every scrape the server hands :meth:`ServerMetrics.exposition` a
fresh :class:`~kvbridge.reference.engine.engine.EngineStats` snapshot.

Every figure is counted where it happens (scheduler, connector, request
handlers) and only exposed here, so the families are built from those counts
at scrape time: ``ServerMetrics`` is the registry's collector
(``prometheus_client``'s custom-collector pattern; no ``_created`` samples).
The connector's families come from ``ConnectorStats.metric_families``; an engine
without a connector exposes them at zero so dashboards see the same names.

Format: text version 0.0.4, one ``# HELP`` and ``# TYPE`` line per family::

    # HELP kvbridge_cache_free_blocks KV cache blocks free for allocation.
    # TYPE kvbridge_cache_free_blocks gauge
    kvbridge_cache_free_blocks 95.0

Importing this module loads no torch (the engine's stats are only a type here).
The proxy's counters are ``kvbridge/proxy/metrics.py``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kvbridge.connector.stats import ConnectorStats, histogram_family

if TYPE_CHECKING:
    from kvbridge.reference.engine.engine import EngineStats

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS_S", "Histogram", "ServerMetrics", "engine_families"]

#: ``Content-Type`` of the exposition.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

#: Upper bounds (seconds) of the TTFT and request-duration histograms.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


@dataclass(slots=True)
class Histogram:
    """Observations counted per bucket (non-cumulative; the last bucket is ``+Inf``).

    Attributes:
        bounds: Increasing upper bounds.
        bucket_counts: ``len(bounds) + 1`` counts.
        sum: Sum of all observations.

    Raises:
        ValueError: bounds not strictly increasing.
    """

    bounds: Sequence[float] = LATENCY_BUCKETS_S
    bucket_counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if any(a >= b for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
            raise ValueError(f"histogram bounds must increase, got {list(self.bounds)}")
        if not self.bucket_counts:
            self.bucket_counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count one observation (``le`` semantics: a value on a bound counts in it)."""
        self.bucket_counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self.bucket_counts)

    def family(self, name: str, help_text: str) -> Metric:
        """This histogram as a Prometheus family named ``name``."""
        return histogram_family(name, help_text, self.bounds, self.bucket_counts, self.sum)


def engine_families(stats: EngineStats, prefix: str = "kvbridge") -> list[Metric]:
    """The engine's figures (cache, queues, prefix cache, steps, connector) as families.

    Args:
        stats: A fresh engine snapshot.
        prefix: Metric name prefix.
    """
    sched = stats.scheduler

    def gauge(name: str, help_text: str, value: float) -> Metric:
        return GaugeMetricFamily(f"{prefix}_{name}", help_text, value=value)

    def counter(name: str, help_text: str, value: float) -> Metric:
        return CounterMetricFamily(f"{prefix}_{name}", help_text, value=value)

    return [
        gauge("cache_free_blocks", "KV cache blocks free for allocation.",
              sched.num_free_blocks),
        gauge("cache_total_blocks", "KV cache blocks usable by requests.",
              sched.num_usable_blocks),
        gauge("cache_blocks_held_for_transfer",
              "Blocks of finished requests kept for remote readers.",
              sched.num_blocks_held_for_transfer),
        gauge("requests_running", "Requests running.", sched.num_running),
        gauge("requests_waiting", "Requests waiting to be scheduled.", sched.num_waiting),
        gauge("requests_waiting_for_remote_kv", "Requests loading KV from a remote prefill.",
              sched.num_waiting_for_remote_kvs),
        counter("preemptions_total", "Requests preempted for lack of blocks.",
                sched.num_preemptions),
        counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                sched.prefix_cache_queries),
        counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                sched.prefix_cache_hits),
        gauge("prefix_cache_hit_rate", "Prefix cache hits / queries since start.",
              sched.prefix_cache_hit_rate),
        counter("engine_steps_total", "Engine steps run.", stats.num_steps),
        *(stats.connector or ConnectorStats()).metric_families(prefix),
    ]


class ServerMetrics:
    """What the HTTP layer counts, and the registry that exposes it with the engine's figures.

    Owned by the server; its request handlers update the counters (one event
    loop: no locking). The object is also its registry's collector.

    Args:
        prefix: Metric name prefix (``kvbridge`` -> ``kvbridge_requests_running``).

    Attributes:
        responses_by_code: Completion responses per HTTP status code.
        num_prompt_tokens: Prompt tokens of finished requests.
        num_generation_tokens: Tokens streamed or returned to clients.
        num_aborted: Requests aborted because the client went away.
        ttft_s: Time to first token, seconds.
        duration_s: Request duration from arrival to its last token, seconds.
        registry: This server's own ``CollectorRegistry``.
    """

    def __init__(self, prefix: str = "kvbridge") -> None:
        self.prefix = prefix
        self.responses_by_code: Counter[str] = Counter()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_aborted = 0
        self.ttft_s = Histogram()
        self.duration_s = Histogram()
        self._engine_stats: EngineStats | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def exposition(self, stats: EngineStats) -> bytes:
        """The whole ``/metrics`` page: ``stats`` (a fresh engine snapshot) and this server's
        counters, as Prometheus text (version 0.0.4)."""
        self._engine_stats = stats
        try:
            return generate_latest(self.registry)
        finally:
            self._engine_stats = None

    def collect(self) -> Iterable[Metric]:
        """The families of one scrape (``prometheus_client`` collector protocol); engine
        families only while :meth:`exposition` runs."""
        stats = self._engine_stats
        families = engine_families(stats, self.prefix) if stats is not None else []
        labeled = CounterMetricFamily(f"{self.prefix}_http_completion_responses_total",
                                      "Completion responses by HTTP status code.",
                                      labels=["code"])
        for code in sorted(self.responses_by_code):
            labeled.add_metric([code], self.responses_by_code[code])
        return [
            *families,
            labeled,
            self._counter("prompt_tokens_total", "Prompt tokens of finished requests.",
                          self.num_prompt_tokens),
            self._counter("generation_tokens_total", "Tokens generated for clients.",
                          self.num_generation_tokens),
            self._counter("requests_aborted_total", "Requests aborted by a client disconnect.",
                          self.num_aborted),
            self.ttft_s.family(f"{self.prefix}_time_to_first_token_seconds",
                               "Time to first token."),
            self.duration_s.family(f"{self.prefix}_request_duration_seconds",
                                   "Arrival to last token."),
        ]

    def _counter(self, name: str, help_text: str, value: float) -> Metric:
        return CounterMetricFamily(f"{self.prefix}_{name}", help_text, value=value)
