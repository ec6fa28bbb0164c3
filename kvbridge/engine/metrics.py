"""Prometheus text exposition for the HTTP server's ``/metrics`` (no client library needed).

``server.py`` owns one :class:`ServerMetrics` (HTTP-level counters and latency
histograms it updates per request) and on every scrape calls
:func:`render_metrics` with a fresh :class:`~kvbridge.engine.engine.EngineStats`
snapshot. The connector's own counters (transfers, bytes, transfer-time
histogram, failures) come from ``ConnectorStats.to_prometheus``; an engine
without a connector exposes them at zero so dashboards see the same names.

Format: text version 0.0.4, one ``# HELP`` and ``# TYPE`` line per family::

    # HELP kvbridge_cache_free_blocks KV cache blocks free for allocation.
    # TYPE kvbridge_cache_free_blocks gauge
    kvbridge_cache_free_blocks 95
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbridge.connector.stats import ConnectorStats
from kvbridge.engine.engine import EngineStats

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS_S",
    "Histogram",
    "MetricsText",
    "ServerMetrics",
    "render_metrics",
]

#: ``Content-Type`` of the exposition.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Upper bounds (seconds) of the TTFT and request-duration histograms.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _labels(labels: Mapping[str, str] | None) -> str:
    if not labels:
        return ""

    def escape(value: str) -> str:  # the exposition format's three escapes
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items())) + "}"


class MetricsText:
    """Builds one exposition; each ``add_*`` call writes one metric family.

    Args:
        prefix: Prepended to every name with ``_`` (``kvbridge`` ->
            ``kvbridge_requests_running``).
    """

    def __init__(self, prefix: str = "kvbridge") -> None:
        self.prefix = prefix
        self._lines: list[str] = []

    def _header(self, name: str, kind: str, help_text: str) -> str:
        full = f"{self.prefix}_{name}" if self.prefix else name
        self._lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        return full

    def add_counter(self, name: str, help_text: str, value: float) -> None:
        """A monotonic total (``name`` should end in ``_total``)."""
        full = self._header(name, "counter", help_text)
        self._lines.append(f"{full} {_number(value)}")

    def add_gauge(self, name: str, help_text: str, value: float) -> None:
        """A value that goes up and down."""
        full = self._header(name, "gauge", help_text)
        self._lines.append(f"{full} {_number(value)}")

    def add_labeled_counter(self, name: str, help_text: str, label: str,
                            values: Mapping[str, float]) -> None:
        """One counter family with a sample per value of ``label``."""
        full = self._header(name, "counter", help_text)
        for key in sorted(values):
            self._lines.append(f"{full}{_labels({label: key})} {_number(values[key])}")

    def add_histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        """Cumulative ``_bucket`` samples, then ``_sum`` and ``_count``."""
        full = self._header(name, "histogram", help_text)
        cumulative = 0
        for bound, count in zip(histogram.bounds, histogram.bucket_counts, strict=False):
            cumulative += count
            self._lines.append(f'{full}_bucket{{le="{_number(bound)}"}} {cumulative}')
        self._lines.append(f'{full}_bucket{{le="+Inf"}} {histogram.count}')
        self._lines.append(f"{full}_sum {_number(histogram.sum)}")
        self._lines.append(f"{full}_count {histogram.count}")

    def add_raw(self, text: str) -> None:
        """Append an exposition rendered elsewhere (whole families only)."""
        self._lines += text.rstrip("\n").splitlines()

    def render(self) -> str:
        """The exposition text, ending in a newline."""
        return "\n".join(self._lines) + "\n"


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


@dataclass(slots=True)
class ServerMetrics:
    """What the HTTP layer counts; owned and updated by the server's request handlers.

    Attributes:
        responses_by_code: Completion responses per HTTP status code.
        num_prompt_tokens: Prompt tokens of finished requests.
        num_generation_tokens: Tokens streamed or returned to clients.
        num_aborted: Requests aborted because the client went away.
        ttft_s: Time to first token, seconds.
        duration_s: Request duration from arrival to its last token, seconds.
    """

    responses_by_code: Counter[str] = field(default_factory=Counter)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_aborted: int = 0
    ttft_s: Histogram = field(default_factory=Histogram)
    duration_s: Histogram = field(default_factory=Histogram)


def render_metrics(stats: EngineStats, server: ServerMetrics, prefix: str = "kvbridge") -> str:
    """The whole ``/metrics`` page.

    Args:
        stats: A fresh engine snapshot.
        server: The server's counters.
        prefix: Metric name prefix.

    Returns:
        Prometheus text exposition (version 0.0.4).
    """
    sched = stats.scheduler
    text = MetricsText(prefix)
    text.add_gauge("cache_free_blocks", "KV cache blocks free for allocation.",
                   sched.num_free_blocks)
    text.add_gauge("cache_total_blocks", "KV cache blocks usable by requests.",
                   sched.num_usable_blocks)
    text.add_gauge("cache_blocks_held_for_transfer",
                   "Blocks of finished requests kept for remote readers.",
                   sched.num_blocks_held_for_transfer)
    text.add_gauge("requests_running", "Requests running.", sched.num_running)
    text.add_gauge("requests_waiting", "Requests waiting to be scheduled.", sched.num_waiting)
    text.add_gauge("requests_waiting_for_remote_kv", "Requests loading KV from a remote prefill.",
                   sched.num_waiting_for_remote_kvs)
    text.add_counter("preemptions_total", "Requests preempted for lack of blocks.",
                     sched.num_preemptions)
    text.add_counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                     sched.prefix_cache_queries)
    text.add_counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                     sched.prefix_cache_hits)
    text.add_gauge("prefix_cache_hit_rate", "Prefix cache hits / queries since start.",
                   sched.prefix_cache_hit_rate)
    text.add_counter("engine_steps_total", "Engine steps run.", stats.num_steps)
    text.add_raw((stats.connector or ConnectorStats()).to_prometheus(prefix))
    text.add_labeled_counter("http_completion_responses_total",
                             "Completion responses by HTTP status code.", "code",
                             server.responses_by_code)
    text.add_counter("prompt_tokens_total", "Prompt tokens of finished requests.",
                     server.num_prompt_tokens)
    text.add_counter("generation_tokens_total", "Tokens generated for clients.",
                     server.num_generation_tokens)
    text.add_counter("requests_aborted_total", "Requests aborted by a client disconnect.",
                     server.num_aborted)
    text.add_histogram("time_to_first_token_seconds", "Time to first token.", server.ttft_s)
    text.add_histogram("request_duration_seconds", "Arrival to last token.", server.duration_s)
    return text.render()
