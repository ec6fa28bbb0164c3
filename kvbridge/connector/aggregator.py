"""Merge the per-worker connector outputs of one step into one for the scheduler.

The executor calls ``KVOutputAggregator.aggregate`` once per engine step with
the ``WorkerOutput`` of every worker (index = worker rank). Each worker
reports a request as finished sending or receiving when *its* share of the
transfer is done; the scheduler may only act (free P's blocks, schedule D's
request) once the expected number of workers has reported. The aggregator keeps
that count across steps, so reports may arrive in any step and any order.

Duplicate reports: a request counts the *distinct worker ranks* that reported
it, so a worker that reports the same request again (in a later step, before
the others caught up, or in the step that completes it) does not count twice.
Once a request is reported finished its state is dropped: a report of the same
id in a *later* step starts a new round (request ids may be reused, e.g. by a
retried request). ``discard`` drops the partial state of an aborted request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvbridge.connector.outputs import (
    KVCacheEventBatch,
    MergeableStats,
    StatsTypeError,
    WorkerOutput,
)
from kvbridge.errors import ConfigError, KVBridgeError


class AggregationError(KVBridgeError, ValueError):
    """The outputs handed to ``aggregate`` are inconsistent; nothing was counted."""


@dataclass(slots=True)
class _Pending:
    num_expected: int
    worker_ranks: set[int] = field(default_factory=set)


class _FinishTracker:
    """Distinct reporting workers per request, for one direction (send or recv)."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)

    def discard(self, req_id: str) -> bool:
        return self._pending.pop(req_id, None) is not None

    def report_step(
        self, reports: Iterable[tuple[int, Iterable[str]]], num_expected: int
    ) -> set[str]:
        """Count one step's ``(worker_rank, req_ids)`` reports; return the finished ids."""
        # Gather the whole step first so that the order of workers in the step
        # does not matter: a duplicate in the step that completes a request must
        # not open a new round for it.
        ranks_by_req: dict[str, set[int]] = {}
        for worker_rank, req_ids in reports:
            for req_id in req_ids:
                ranks_by_req.setdefault(req_id, set()).add(worker_rank)
        finished: set[str] = set()
        for req_id, ranks in ranks_by_req.items():
            # The count is fixed when a request is first seen: a later
            # announcement applies to new requests only.
            entry = self._pending.setdefault(req_id, _Pending(num_expected))
            entry.worker_ranks |= ranks
            if len(entry.worker_ranks) >= entry.num_expected:
                finished.add(req_id)
                del self._pending[req_id]
        return finished


class KVOutputAggregator:
    """Counts finished reports across workers and merges stats, events and failures.

    Owned by the executor; not thread-safe.
    """

    def __init__(self, expected_finished_count: int) -> None:
        """Start with no pending requests.

        Args:
            expected_finished_count: Workers that must report a request before
                it counts as finished.

        Raises:
            ConfigError: ``expected_finished_count`` < 1.
        """
        if expected_finished_count < 1:
            raise ConfigError(
                f"expected_finished_count must be >= 1, got {expected_finished_count}"
            )
        self._expected_finished_count = expected_finished_count
        self._sending = _FinishTracker()
        self._recving = _FinishTracker()

    @classmethod
    def from_world_size(
        cls, world_size: int, connector_finished_count: int | None = None
    ) -> KVOutputAggregator:
        """Expect the connector's count when it names one, else every worker.

        Raises:
            ConfigError: ``world_size`` < 1 or a connector count < 1.
        """
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        count = world_size if connector_finished_count is None else connector_finished_count
        return cls(count)

    @property
    def expected_finished_count(self) -> int:
        """Count applied to requests first reported from now on."""
        return self._expected_finished_count

    def pending_sending(self) -> frozenset[str]:
        """Requests some, but not yet enough, workers reported finished sending."""
        return self._sending.pending()

    def pending_recving(self) -> frozenset[str]:
        """Requests some, but not yet enough, workers reported finished receiving."""
        return self._recving.pending()

    def discard(self, req_id: str) -> bool:
        """Forget the partial reports of an aborted request, in both directions.

        Returns:
            True if the request had pending reports.
        """
        had_sending = self._sending.discard(req_id)
        had_recving = self._recving.discard(req_id)
        return had_sending or had_recving

    def aggregate(
        self, outputs: Sequence[WorkerOutput | None], output_rank: int = 0
    ) -> WorkerOutput | None:
        """Merge one step's outputs; the worker rank of an output is its index.

        A ``None`` entry is a worker without connector output this step.

        Args:
            outputs: One entry per worker, in rank order.
            output_rank: The worker whose output the scheduler consumes.

        Returns:
            A new output: requests that reached their expected count in this
            call, merged stats (``None`` when empty), combined events, the
            union of invalid block ids and the current expected count. ``None``
            when ``outputs[output_rank]`` is ``None``: the step then has no
            result for the scheduler and is ignored as a whole (nothing counted).

        Raises:
            AggregationError: no outputs, ``output_rank`` out of range, workers
                announcing different or non-positive counts, or a count larger
                than the number of workers (it could never be reached).
            StatsTypeError: workers report stats of different types.
            Both leave the aggregator unchanged; the inputs are never modified.
        """
        if not 0 <= output_rank < len(outputs):
            raise AggregationError(f"output_rank {output_rank} outside [0, {len(outputs)})")
        if outputs[output_rank] is None:
            return None
        present = [(rank, out) for rank, out in enumerate(outputs) if out is not None]
        expected = self._announced_count(present, len(outputs))
        stats = _merge_stats(out.stats for _, out in present)
        events = _combine_events(out.kv_cache_events for _, out in present)

        # Validation is over: from here on state changes.
        self._expected_finished_count = expected
        finished_sending = self._sending.report_step(
            ((rank, out.finished_sending or ()) for rank, out in present), expected
        )
        finished_recving = self._recving.report_step(
            ((rank, out.finished_recving or ()) for rank, out in present), expected
        )
        invalid_block_ids: set[int] = set()
        for _, out in present:
            invalid_block_ids |= out.invalid_block_ids
        return WorkerOutput(
            finished_sending=finished_sending or None,
            finished_recving=finished_recving or None,
            stats=None if stats is None or stats.is_empty() else stats,
            kv_cache_events=events,
            invalid_block_ids=invalid_block_ids,
            expected_finished_count=expected,
        )

    def _announced_count(
        self, present: Sequence[tuple[int, WorkerOutput]], num_workers: int
    ) -> int:
        announced = {
            rank: out.expected_finished_count
            for rank, out in present
            if out.expected_finished_count is not None
        }
        counts = set(announced.values())
        if len(counts) > 1:
            raise AggregationError(f"workers announce different expected counts: {announced}")
        expected = counts.pop() if counts else self._expected_finished_count
        if not 1 <= expected <= num_workers:
            raise AggregationError(
                f"expected finished count {expected} outside [1, {num_workers} workers]"
            )
        return expected


def _merge_stats(all_stats: Iterable[MergeableStats | None]) -> MergeableStats | None:
    merged: MergeableStats | None = None
    for stats in all_stats:
        if stats is None:
            continue
        if merged is None:
            merged = stats
        elif type(stats) is not type(merged):
            raise StatsTypeError(
                f"workers report {type(merged).__name__} and {type(stats).__name__}"
            )
        else:
            merged = merged.aggregate(stats)
    return merged


def _combine_events(batches: Iterable[KVCacheEventBatch | None]) -> KVCacheEventBatch | None:
    combined: KVCacheEventBatch | None = None
    for batch in batches:
        if batch is not None:
            combined = batch if combined is None else combined.combine(batch)
    return combined
