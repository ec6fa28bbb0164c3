"""Connector statistics for logs and Prometheus, kept by the scheduler side.

``ConnectorScheduler`` folds every step's aggregated ``TransferStats`` (from the
workers) into one ``ConnectorStats`` and adds what only it knows: grants handed
out, blocks held for remote readers, loads in flight, local hits that made a
transfer unnecessary. ``get_stats()`` returns a snapshot; the engine serves
``snapshot.to_prometheus("kvbridge")`` on ``/metrics``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["DURATION_BUCKETS_S", "ConnectorStats"]

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
        num_grants_issued: finished prefills held for remote readers.
        num_grants_released: held prefills whose blocks were given back.
        num_held_blocks: blocks held for remote readers now (gauge).
        num_held_requests: requests holding them (gauge).
        num_loads_in_flight: loads sent to workers and not finished (gauge).
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
    num_grants_issued: int = 0
    num_grants_released: int = 0
    num_held_blocks: int = 0
    num_held_requests: int = 0
    num_loads_in_flight: int = 0

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
        return snapshot

    def to_prometheus(self, prefix: str = "kvbridge") -> str:
        """Prometheus text exposition (version 0.0.4) of these stats.

        Args:
            prefix: metric name prefix, e.g. ``"kvbridge"`` ->
                ``kvbridge_kv_transfers_total``.

        Returns:
            The text, one ``# HELP`` / ``# TYPE`` pair per metric, ending in a newline.
        """
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float) -> None:
            full = f"{prefix}_{name}"
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}",
                          f"{full} {_number(value)}"])

        metric("kv_transfers_total", "counter", "KV reads completed by workers.",
               self.num_transfers)
        metric("kv_transfer_failures_total", "counter", "KV reads failed on workers.",
               self.num_failures)
        metric("kv_transfer_bytes_total", "counter", "KV bytes received.", self.nbytes)
        metric("kv_transfer_local_copies_total", "counter",
               "KV reads copied from a server process on this host.", self.num_local_copies)
        metric("kv_loads_started_total", "counter", "Requests sent to workers to load.",
               self.num_loads_started)
        metric("kv_loads_failed_total", "counter", "Requests whose load failed.",
               self.num_loads_failed)
        metric("kv_local_hits_skipped_total", "counter",
               "Remote prefills not read thanks to local prefix hits.",
               self.num_local_hits_skipped)
        metric("kv_grants_issued_total", "counter", "Prefills held for remote readers.",
               self.num_grants_issued)
        metric("kv_grants_released_total", "counter", "Held prefills released.",
               self.num_grants_released)
        metric("kv_held_blocks", "gauge", "Blocks held for remote readers.",
               self.num_held_blocks)
        metric("kv_held_requests", "gauge", "Requests holding blocks for remote readers.",
               self.num_held_requests)
        metric("kv_loads_in_flight", "gauge", "Loads in flight.", self.num_loads_in_flight)
        full = f"{prefix}_kv_transfer_seconds"
        lines += [f"# HELP {full} Duration of KV reads.", f"# TYPE {full} histogram"]
        cumulative = 0
        for bound, count in zip(DURATION_BUCKETS_S, self.duration_bucket_counts, strict=False):
            cumulative += count
            lines.append(f'{full}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines.append(f'{full}_bucket{{le="+Inf"}} {self.num_durations}')
        lines.append(f"{full}_sum {_number(self.duration_sum_s)}")
        lines.append(f"{full}_count {self.num_durations}")
        return "\n".join(lines) + "\n"


_FIELDS = tuple(name for name in ConnectorStats.__slots__ if name != "duration_bucket_counts")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
