"""Per-worker connector output records, merged by ``KVOutputAggregator``.

Each ``ConnectorWorker`` returns one ``WorkerOutput`` per engine step: the
requests whose transfers finished on that worker, transfer stats, KV cache
events and block ids that failed to load. The executor gathers one per worker
and ``kvbridge.connector.aggregator.KVOutputAggregator`` merges them for the
scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvbridge.errors import KVBridgeError


class StatsTypeError(KVBridgeError, TypeError):
    """Two stats objects of different types were asked to merge."""


class MergeableStats(ABC):
    """Transfer statistics of one worker (or several, once aggregated)."""

    __slots__ = ()

    @abstractmethod
    def aggregate(self, other: MergeableStats) -> MergeableStats:
        """Return new stats covering ``self`` and ``other``; neither is modified.

        Raises:
            StatsTypeError: ``other`` is not exactly the type of ``self``.
        """

    @abstractmethod
    def is_empty(self) -> bool:
        """True when the stats record nothing (merging them changes nothing)."""

    def _check_same_type(self, other: MergeableStats) -> None:
        if type(other) is not type(self):
            raise StatsTypeError(
                f"cannot aggregate {type(self).__name__} with {type(other).__name__}"
            )


#: The timeline of reads and grants (``TransferStats.phases_s``), in the order they happen:
#: on P, "publish" (the request finished in the scheduler -> its grant issued by the
#: worker) and "grant_wait" (a read that came before its grant -> the grant there); on D,
#: "queue" (``start_read`` -> the agent's thread began the read; 0 when made on the
#: caller's thread), "grant" (-> the grant confirmed: P's grant board said yes, or P's
#: go, header or first chunk came), "copy" (-> the last byte landed) and "collect" (the
#: outcome -> the engine took it).
PHASES: tuple[str, ...] = ("publish", "grant_wait", "queue", "grant", "copy", "collect")

#: Each phase's histogram name (``<prefix>_<name>_seconds``: vLLM's ``vllm:kvbridge_``,
#: the reference server's ``kvbridge_kv_``) and its help text.
PHASE_METRICS: dict[str, tuple[str, str]] = {
    "publish": ("grant_publish", "P: from a request's end in the scheduler to its grant "
                "issued by the worker"),
    "grant_wait": ("grant_wait", "P: how long a read that came before its grant waited"),
    "queue": ("read_queue", "D: from start_read to the read begun on the agent's thread "
              "(0: made on the caller's thread)"),
    "grant": ("read_grant", "D: from the read begun to its grant confirmed (P's grant board "
              "or P's answer)"),
    "copy": ("read_copy", "D: from the grant confirmed to the last byte landed"),
    "collect": ("read_collect", "D: from the read's outcome to the engine taking it"),
}


@dataclass(slots=True)
class TransferStats(MergeableStats):
    """Counters of KV block transfers.

    Attributes:
        num_transfers: Transfers that completed.
        nbytes: Bytes moved by those transfers.
        durations_s: Duration of each completed transfer, in seconds.
        num_failures: Transfers that failed.
        num_local_copies: Completed transfers the reader copied out of a server
            process on its own host (``kvbridge.transfer.reading.same_host``).
        phases_s: Seconds of each ``PHASES`` step, one entry per read or grant
            (phases absent: none measured).
    """

    num_transfers: int = 0
    nbytes: int = 0
    durations_s: list[float] = field(default_factory=list)
    num_failures: int = 0
    num_local_copies: int = 0
    phases_s: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        counts = (self.num_transfers, self.nbytes, self.num_failures, self.num_local_copies)
        unknown = set(self.phases_s) - set(PHASES)
        if unknown or any(d < 0 for ds in self.phases_s.values() for d in ds):
            raise ValueError(f"phases must be among {PHASES} and non-negative: "
                             f"{ {k: min(v, default=0.0) for k, v in self.phases_s.items()} }")
        if min(counts) < 0 or any(d < 0 for d in self.durations_s):
            raise ValueError(
                f"stats must be non-negative: num_transfers {self.num_transfers}, "
                f"nbytes {self.nbytes}, num_failures {self.num_failures}, "
                f"num_local_copies {self.num_local_copies}, "
                f"min duration {min(self.durations_s, default=0.0)}"
            )

    def aggregate(self, other: MergeableStats) -> TransferStats:
        """Sum counters and concatenate durations (``self``'s first).

        Raises:
            StatsTypeError: ``other`` is not a ``TransferStats`` (subclasses count
                as different types: they carry fields this method would drop).
        """
        self._check_same_type(other)
        assert isinstance(other, TransferStats)
        return TransferStats(
            num_transfers=self.num_transfers + other.num_transfers,
            nbytes=self.nbytes + other.nbytes,
            durations_s=self.durations_s + other.durations_s,
            num_failures=self.num_failures + other.num_failures,
            num_local_copies=self.num_local_copies + other.num_local_copies,
            phases_s={phase: self.phases_s.get(phase, []) + other.phases_s.get(phase, [])
                      for phase in PHASES if phase in self.phases_s or phase in other.phases_s},
        )

    def is_empty(self) -> bool:
        counts = (self.num_transfers, self.nbytes, self.num_failures, self.num_local_copies)
        return (not any(counts) and not self.durations_s
                and not any(self.phases_s.values()))


@dataclass(slots=True)
class KVCacheEventBatch:
    """KV cache events from one or more workers.

    Attributes:
        events: Events in arrival order (hashable, e.g. frozen dataclasses).
        num_workers: Workers whose events are in ``events``; every TP worker
            sees the same blocks, so an event all of them emitted occurs
            ``num_workers`` times.
    """

    events: list[Hashable] = field(default_factory=list)
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")

    def combine(self, other: KVCacheEventBatch) -> KVCacheEventBatch:
        """Return a new batch with both event lists and the summed worker count."""
        return KVCacheEventBatch(self.events + other.events, self.num_workers + other.num_workers)

    def common_events(self) -> list[Hashable]:
        """Distinct events (first-seen order) that occur at least ``num_workers`` times.

        These are the events every reporting worker agrees on, assuming a worker
        does not repeat an event within one batch.
        """
        counts = Counter(self.events)
        return [event for event in counts if counts[event] >= self.num_workers]


@dataclass(slots=True)
class WorkerOutput:
    """What one worker's connector reports for one step (or the merged report).

    Attributes:
        finished_sending: Requests whose blocks this worker finished sending.
        finished_recving: Requests whose blocks this worker finished receiving.
        stats: Transfer stats of the step.
        kv_cache_events: KV cache events of the step.
        invalid_block_ids: Local block ids that failed to load (to recompute).
        expected_finished_count: When set, the number of workers that must
            report a request from now on before it counts as finished.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    stats: MergeableStats | None = None
    kv_cache_events: KVCacheEventBatch | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    expected_finished_count: int | None = None

    def is_empty(self) -> bool:
        """True when the output reports nothing (an announced count is not a report)."""
        stats_empty = self.stats is None or self.stats.is_empty()
        return (
            not self.finished_sending
            and not self.finished_recving
            and stats_empty
            and self.kv_cache_events is None
            and not self.invalid_block_ids
        )
