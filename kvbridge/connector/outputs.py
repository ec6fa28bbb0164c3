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
    """

    num_transfers: int = 0
    nbytes: int = 0
    durations_s: list[float] = field(default_factory=list)
    num_failures: int = 0
    num_local_copies: int = 0

    def __post_init__(self) -> None:
        counts = (self.num_transfers, self.nbytes, self.num_failures, self.num_local_copies)
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
        )

    def is_empty(self) -> bool:
        counts = (self.num_transfers, self.nbytes, self.num_failures, self.num_local_copies)
        return not any(counts) and not self.durations_s


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
