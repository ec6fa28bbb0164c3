"""Connector statistics for logs and Prometheus, kept by the scheduler side.

``ConnectorScheduler`` folds every step's aggregated ``TransferStats`` (from the
workers) into one ``ConnectorStats`` and adds what only it knows: grants handed
out, blocks held for remote readers, loads in flight, local hits that made a
transfer unnecessary. ``get_stats()`` returns a snapshot; the engine's HTTP
server (``kvbridge/reference/metrics.py``) exposes ``snapshot.metric_families("kvbridge")``
on ``/metrics``. ``to_prometheus`` renders the same families as text (logs, tests).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvbridge.connector.outputs import PHASE_METRICS

__all__ = ["DURATION_BUCKETS_S", "ConnectorStats", "histogram_family"]

# Upper bounds of the transfer-time histogram, seconds (Prometheus "le" labels).
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass(slots=True)
class ConnectorStats:
    """Counters since the connector started, plus gauges of the current state.

    Attributes:
        num_transfers: worker reads that completed (one per D worker and request).
        num_failures: worker reads that failed.
        nbytes: KV bytes received by this engine's workers.
        num_local_copies: of the completed reads, those copied out of a server
            process on this host (same-host copies) rather than through UCX.
        duration_bucket_counts: transfers per ``DURATION_BUCKETS_S`` bucket
            (non-cumulative; the last entry counts durations above every bound).
        duration_sum_s: total transfer time, seconds.
        num_loads_started: requests whose load was sent to the workers.
        num_loads_failed: requests whose load failed on some worker.
        num_local_hits_skipped: remote prefills not read because the local
            prefix cache already held the tokens.
        num_params_refused: requests whose ``kv_transfer_params`` were refused
            (forged, tampered, for another prompt, expired): no read planned.
        num_grants_issued: finished prefills held for remote readers.
        num_grants_released: held prefills whose blocks were given back.
        num_holds_evicted: holds released before their reader came, to make room
            under the cap of blocks held for readers.
        num_held_blocks: blocks held for remote readers now (gauge).
        num_held_requests: requests holding them (gauge).
        num_loads_in_flight: loads sent to workers and not finished (gauge).
        phase_bucket_counts: per timeline phase (``outputs.PHASES``), counts per
            ``DURATION_BUCKETS_S`` bucket as ``duration_bucket_counts``.
        phase_sum_s: per timeline phase, the seconds in all.
    """

    num_transfers: int = 0
    num_failures: int = 0
    nbytes: int = 0
    num_local_copies: int = 0
    duration_bucket_counts: list[int] = field(
        default_factory=lambda: [0] * (len(DURATION_BUCKETS_S) + 1)
    )
    duration_sum_s: float = 0.0
    num_loads_started: int = 0
    num_loads_failed: int = 0
    num_local_hits_skipped: int = 0
    num_params_refused: int = 0
    num_grants_issued: int = 0
    num_grants_released: int = 0
    num_holds_evicted: int = 0
    num_held_blocks: int = 0
    num_held_requests: int = 0
    num_loads_in_flight: int = 0
    phase_bucket_counts: dict[str, list[int]] = field(default_factory=dict)
    phase_sum_s: dict[str, float] = field(default_factory=dict)

    def record_phases(self, phases_s: dict[str, list[float]]) -> None:
        """Add the reads' and grants' timeline (``TransferStats.phases_s``)."""
        for phase, values in phases_s.items():
            counts = self.phase_bucket_counts.setdefault(
                phase, [0] * (len(DURATION_BUCKETS_S) + 1))
            for seconds in values:
                counts[bisect.bisect_left(DURATION_BUCKETS_S, seconds)] += 1
            self.phase_sum_s[phase] = self.phase_sum_s.get(phase, 0.0) + sum(values)

    def record_durations(self, durations_s: list[float]) -> None:
        """Add transfer durations to the histogram."""
        for duration in durations_s:
            self.duration_bucket_counts[bisect.bisect_left(DURATION_BUCKETS_S, duration)] += 1
            self.duration_sum_s += duration

    @property
    def num_durations(self) -> int:
        """Durations recorded in the histogram."""
        return sum(self.duration_bucket_counts)

    def copy(self) -> ConnectorStats:
        """An independent snapshot."""
        snapshot = ConnectorStats(**{name: getattr(self, name) for name in _FIELDS})
        snapshot.duration_bucket_counts = list(self.duration_bucket_counts)
        snapshot.phase_bucket_counts = {k: list(v) for k, v in self.phase_bucket_counts.items()}
        snapshot.phase_sum_s = dict(self.phase_sum_s)
        return snapshot

    def metric_families(self, prefix: str = "kvbridge") -> list[Metric]:
        """These stats as Prometheus metric families (for a ``prometheus_client`` collector).

        Args:
            prefix: metric name prefix, e.g. ``"kvbridge"`` ->
                ``kvbridge_kv_transfers_total``.

        Returns:
            Counters, gauges and the ``kv_transfer_seconds`` histogram; counters
            carry no ``_created`` sample.
        """

        def counter(name: str, help_text: str, value: float) -> Metric:
            return CounterMetricFamily(f"{prefix}_{name}", help_text, value=value)

        def gauge(name: str, help_text: str, value: float) -> Metric:
            return GaugeMetricFamily(f"{prefix}_{name}", help_text, value=value)

        return [
            counter("kv_transfers_total", "KV reads completed by workers.", self.num_transfers),
            counter("kv_transfer_failures_total", "KV reads failed on workers.",
                    self.num_failures),
            counter("kv_transfer_bytes_total", "KV bytes received.", self.nbytes),
            counter("kv_transfer_local_copies_total",
                    "KV reads copied from a server process on this host.",
                    self.num_local_copies),
            counter("kv_loads_started_total", "Requests sent to workers to load.",
                    self.num_loads_started),
            counter("kv_loads_failed_total", "Requests whose load failed.",
                    self.num_loads_failed),
            counter("kv_local_hits_skipped_total",
                    "Remote prefills not read thanks to local prefix hits.",
                    self.num_local_hits_skipped),
            counter("kv_params_refused_total",
                    "Requests whose kv_transfer_params were refused (no read planned).",
                    self.num_params_refused),
            counter("kv_grants_issued_total", "Prefills held for remote readers.",
                    self.num_grants_issued),
            counter("kv_grants_released_total", "Held prefills released.",
                    self.num_grants_released),
            counter("kv_holds_evicted_total",
                    "Holds released before their reader came (cap of held blocks).",
                    self.num_holds_evicted),
            gauge("kv_held_blocks", "Blocks held for remote readers.", self.num_held_blocks),
            gauge("kv_held_requests", "Requests holding blocks for remote readers.",
                  self.num_held_requests),
            gauge("kv_loads_in_flight", "Loads in flight.", self.num_loads_in_flight),
            histogram_family(f"{prefix}_kv_transfer_seconds", "Duration of KV reads.",
                             DURATION_BUCKETS_S, self.duration_bucket_counts,
                             self.duration_sum_s),
            *(histogram_family(f"{prefix}_kv_{PHASE_METRICS[phase][0]}_seconds",
                               PHASE_METRICS[phase][1], DURATION_BUCKETS_S, counts,
                               self.phase_sum_s[phase])
              for phase, counts in sorted(self.phase_bucket_counts.items())
              if phase in PHASE_METRICS),
        ]

    def to_prometheus(self, prefix: str = "kvbridge") -> str:
        """Prometheus text exposition (version 0.0.4) of :meth:`metric_families`.

        Returns:
            The text, one ``# HELP`` / ``# TYPE`` pair per metric, ending in a newline.
        """
        return generate_latest(_Families(self.metric_families(prefix))).decode()


def histogram_family(name: str, help_text: str, bounds: Sequence[float],
                     bucket_counts: Sequence[int], sum_value: float) -> Metric:
    """A Prometheus histogram family from per-bucket counts (no ``prometheus_client`` state).

    Args:
        name: Full metric name (``_bucket``, ``_sum`` and ``_count`` are appended).
        help_text: The ``# HELP`` text.
        bounds: Increasing upper bounds (the ``le`` labels; ``1.0`` shows as ``1``).
        bucket_counts: Non-cumulative counts, ``len(bounds) + 1`` of them (the last
            counts observations above every bound).
        sum_value: Sum of all observations.
    """
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for bound, count in zip(bounds, bucket_counts, strict=False):
        cumulative += count
        buckets.append((_le(bound), cumulative))
    buckets.append(("+Inf", sum(bucket_counts)))
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=sum_value)


class _Families:
    """A ``prometheus_client`` collector of families built beforehand."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


_FIELDS = tuple(name for name in ConnectorStats.__slots__
                if name not in ("duration_bucket_counts", "phase_bucket_counts", "phase_sum_s"))


def _le(bound: float) -> str:
    """An ``le`` label as kvbridge has always written it: ``0.25``, ``1``, ``10``."""
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))
