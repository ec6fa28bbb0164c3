"""kvbridge's transfer stats in vLLM: the stats object its workers report, and its metrics.

Each worker's ``get_kv_connector_stats`` returns a :class:`KVBridgeStats` built
from kvbridge's ``TransferStats`` of the reads that ended since the last step.
vLLM pickles it to the engine core, merges the workers' (``aggregate``), hands it
to the scheduler side (``to_transfer_stats``) and, as a plain dict, to the
API server, where :class:`KVBridgePromMetrics` counts it on ``/metrics``::

    vllm:kvbridge_transfers_total            reads that completed (one per D worker and request)
    vllm:kvbridge_transfer_failures_total    reads that failed (their blocks are recomputed)
    vllm:kvbridge_transfer_bytes_total       KV bytes received
    vllm:kvbridge_local_copies_total         completed reads copied out of P's process (same host)
    vllm:kvbridge_sync_loads_total           reads made before the forward of their request's step
    vllm:kvbridge_sync_loads_late_total      of those, reads the forward stopped waiting for
                                             (sync_load_deadline_s): recomputed
    vllm:kvbridge_transfer_seconds           histogram of read durations
    vllm:kvbridge_<phase>_seconds            histograms of the read timeline, one per phase
                                             (``outputs.PHASES``): P's grant_publish and
                                             grant_wait; D's read_queue, read_grant,
                                             read_copy and read_collect
    vllm:kvbridge_params_refused_total       requests whose kv_transfer_params D refused
                                             (forged, tampered, other prompt, expired)
    vllm:kvbridge_held_bytes                 (gauge, P) KV bytes held for D's readers
    vllm:kvbridge_held_requests              (gauge, P) requests whose blocks are held

The scheduler side adds the last three (``VllmSchedulerSide.take_stats``): vLLM
merges its stats with the workers'. Its ``data`` holds only numbers and a
list of floats: vLLM ships it with msgpack.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvbridge.connector.outputs import PHASE_METRICS, PHASES, TransferStats
from kvbridge.connector.stats import DURATION_BUCKETS_S

__all__ = ["KVBridgePromMetrics", "KVBridgeStats"]

_COUNTS = ("num_transfers", "num_failures", "nbytes", "num_local_copies")
_SCHEDULER_COUNTS = ("num_sync_loads", "num_late_sync_loads", "num_params_refused")
_GAUGES = ("held_bytes", "held_requests")  # only the scheduler side reports these


class KVBridgeStats(KVConnectorStats):
    """vLLM's stats container holding kvbridge's ``TransferStats`` fields in ``data``."""

    @classmethod
    def of(cls, stats: TransferStats, num_sync_loads: int = 0,
           num_late_sync_loads: int = 0) -> KVBridgeStats:
        """The vLLM form of one worker's ``TransferStats`` (and its synchronous loads)."""
        data: dict[str, Any] = {name: getattr(stats, name) for name in _COUNTS}
        data["durations_s"] = list(stats.durations_s)
        data["phases_s"] = {phase: list(values) for phase, values in stats.phases_s.items()}
        data["num_sync_loads"] = num_sync_loads
        data["num_late_sync_loads"] = num_late_sync_loads
        return cls(data=data)

    @classmethod
    def of_scheduler(cls, num_params_refused: int, gauges: dict[str, int] | None
                     ) -> KVBridgeStats:
        """The scheduler side's part: refusals since the last report, and gauges if changed."""
        stats = cls.of(TransferStats())
        stats.data["num_params_refused"] = num_params_refused
        stats.data.update(gauges or {})
        return stats

    @property
    def num_sync_loads(self) -> int:
        """Reads made synchronously (``VllmSettings.sync_load_max_bytes``)."""
        return int(self.data.get("num_sync_loads", 0))

    def to_transfer_stats(self) -> TransferStats:
        """Back to kvbridge's form (missing keys count as zero)."""
        return TransferStats(
            **{name: int(self.data.get(name, 0)) for name in _COUNTS},
            durations_s=[float(d) for d in self.data.get("durations_s", ())],
            phases_s={phase: [float(d) for d in values]
                      for phase, values in dict(self.data.get("phases_s") or {}).items()
                      if phase in PHASES},
        )

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, KVBridgeStats):
            raise TypeError(f"cannot aggregate KVBridgeStats with {type(other).__name__}")
        merged = KVBridgeStats.of(self.to_transfer_stats().aggregate(other.to_transfer_stats()))
        # counts beside the transfer stats (sync loads: the workers'; refusals: the scheduler's)
        for key in _SCHEDULER_COUNTS:
            merged.data[key] = int(self.data.get(key, 0)) + int(other.data.get(key, 0))
        for key in _GAUGES:  # the latest of the one scheduler side's
            for part in (self, other):
                if key in part.data:
                    merged.data[key] = part.data[key]
        return merged

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows."""
        stats = self.to_transfer_stats()
        durations = sorted(stats.durations_s)
        seconds = sum(durations)
        return {
            "transfers": stats.num_transfers,
            "failures": stats.num_failures,
            "MiB": round(stats.nbytes / (1 << 20), 3),
            "local_copies": stats.num_local_copies,
            "sync_loads": self.num_sync_loads,
            "late_sync_loads": int(self.data.get("num_late_sync_loads", 0)),
            "avg_ms": round(1e3 * seconds / len(durations), 3) if durations else 0.0,
            "p50_ms": round(1e3 * durations[len(durations) // 2], 3) if durations else 0.0,
            "GB/s": round(stats.nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
        }

    def is_empty(self) -> bool:
        return (self.to_transfer_stats().is_empty()
                and not any(self.data.get(key) for key in _SCHEDULER_COUNTS)
                and not any(key in self.data for key in _GAUGES))


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """kvbridge's counters and read-time histogram on vLLM's ``/metrics`` (names above)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counters = {
            "num_transfers": ("vllm:kvbridge_transfers", "KV reads that completed"),
            "num_failures": ("vllm:kvbridge_transfer_failures", "KV reads that failed"),
            "nbytes": ("vllm:kvbridge_transfer_bytes", "KV bytes received"),
            "num_local_copies": ("vllm:kvbridge_local_copies",
                                 "completed KV reads copied out of a process on this host"),
            "num_sync_loads": ("vllm:kvbridge_sync_loads",
                               "KV reads made before the forward of their request's step"),
            "num_late_sync_loads": ("vllm:kvbridge_sync_loads_late",
                                    "synchronous KV reads the forward stopped waiting for"),
            "num_params_refused": ("vllm:kvbridge_params_refused",
                                   "requests whose kv_transfer_params were refused (no read)"),
        }
        gauges = {
            "held_bytes": ("vllm:kvbridge_held_bytes", "KV bytes held for remote readers"),
            "held_requests": ("vllm:kvbridge_held_requests",
                              "requests whose blocks are held for remote readers"),
        }
        self._gauges = {
            key: create_metric_per_engine(
                self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                multiprocess_mode="mostrecent"),
                per_engine_labelvalues,
            )
            for key, (name, doc) in gauges.items()
        }
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, (name, doc) in counters.items()
        }
        self._seconds = create_metric_per_engine(
            self._histogram_cls(name="vllm:kvbridge_transfer_seconds",
                                documentation="duration of one KV read (one D worker)",
                                labelnames=labelnames, buckets=list(DURATION_BUCKETS_S)),
            per_engine_labelvalues,
        )

        self._phases = {
            phase: create_metric_per_engine(
                self._histogram_cls(name=f"vllm:kvbridge_{PHASE_METRICS[phase][0]}_seconds",
                                    documentation=PHASE_METRICS[phase][1],
                                    labelnames=labelnames, buckets=list(DURATION_BUCKETS_S)),
                per_engine_labelvalues,
            )
            for phase in PHASES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                metric[engine_idx].inc(value)
        for key, gauge in self._gauges.items():
            if key in transfer_stats_data:
                gauge[engine_idx].set(transfer_stats_data[key])
        for seconds in transfer_stats_data.get("durations_s", ()):
            self._seconds[engine_idx].observe(seconds)
        for phase, values in dict(transfer_stats_data.get("phases_s") or {}).items():
            if phase in self._phases:
                for seconds in values:
                    self._phases[phase][engine_idx].observe(seconds)
