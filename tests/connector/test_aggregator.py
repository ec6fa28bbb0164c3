"""Tests for kvbridge.connector.aggregator and the output records it merges."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.aggregator import AggregationError, KVOutputAggregator
from kvbridge.connector.outputs import (
    KVCacheEventBatch,
    MergeableStats,
    StatsTypeError,
    TransferStats,
    WorkerOutput,
)
from kvbridge.errors import ConfigError


def sending(*req_ids: str, count: int | None = None) -> WorkerOutput:
    return WorkerOutput(finished_sending=set(req_ids), expected_finished_count=count)


def recving(*req_ids: str) -> WorkerOutput:
    return WorkerOutput(finished_recving=set(req_ids))


def finished_sending(result: WorkerOutput | None) -> set[str]:
    assert result is not None
    return result.finished_sending or set()


@dataclass(slots=True)
class OtherStats(MergeableStats):
    num_hits: int = 0

    def aggregate(self, other: MergeableStats) -> OtherStats:
        self._check_same_type(other)
        assert isinstance(other, OtherStats)
        return OtherStats(self.num_hits + other.num_hits)

    def is_empty(self) -> bool:
        return self.num_hits == 0


# -- finished counting --------------------------------------------------------------


def test_finished_only_after_all_workers_reported() -> None:
    agg = KVOutputAggregator(3)
    assert finished_sending(agg.aggregate([sending("a"), None, sending("a", "b")])) == set()
    assert agg.pending_sending() == {"a", "b"}
    assert finished_sending(agg.aggregate([sending(), sending("a"), None])) == {"a"}
    assert agg.pending_sending() == {"b"}


def test_out_of_order_arrivals_across_steps() -> None:
    agg = KVOutputAggregator(2)
    steps = [
        [recving("r2"), recving("r1")],  # each worker finished a different request first
        [recving(), recving()],
        [recving("r1"), recving("r2")],
    ]
    results = [agg.aggregate(step) for step in steps]
    assert [r.finished_recving if r else None for r in results] == [None, None, {"r1", "r2"}]
    assert agg.pending_recving() == frozenset()


def test_sending_and_recving_are_counted_separately() -> None:
    agg = KVOutputAggregator(2)
    agg.aggregate([sending("x"), recving("x")])
    assert agg.pending_sending() == {"x"} and agg.pending_recving() == {"x"}
    result = agg.aggregate([recving("x"), sending("x")])
    assert result is not None
    assert result.finished_sending == {"x"} and result.finished_recving == {"x"}


def test_duplicate_report_from_same_worker_counts_once() -> None:
    agg = KVOutputAggregator(2)
    assert finished_sending(agg.aggregate([sending("a"), None])) == set()
    assert finished_sending(agg.aggregate([sending("a"), None])) == set()  # again, worker 0
    assert agg.pending_sending() == {"a"}
    assert finished_sending(agg.aggregate([sending(), sending("a")])) == {"a"}
    # Finished requests are forgotten: a late report starts a new round.
    assert finished_sending(agg.aggregate([sending("a"), None])) == set()
    assert agg.pending_sending() == {"a"}


def test_duplicate_in_the_completing_step_does_not_open_new_round() -> None:
    agg = KVOutputAggregator(2)
    agg.aggregate([sending("a"), None])
    # Worker 1 completes "a" while worker 0 re-reports it in the same step; in
    # either worker order the request finishes once and leaves nothing pending.
    assert finished_sending(agg.aggregate([sending("a"), sending("a")])) == {"a"}
    assert agg.pending_sending() == frozenset()


def test_discard_drops_partial_reports() -> None:
    agg = KVOutputAggregator(2)
    agg.aggregate([sending("a"), recving("a")])
    assert agg.discard("a") is True
    assert agg.pending_sending() == frozenset() and agg.pending_recving() == frozenset()
    assert agg.discard("a") is False
    assert finished_sending(agg.aggregate([sending(), sending("a")])) == set()


def test_expected_count_changes_mid_stream() -> None:
    agg = KVOutputAggregator.from_world_size(4)
    assert agg.expected_finished_count == 4
    agg.aggregate([sending("old"), None, None, None])
    # A worker announces that only 2 workers report from now on.
    result = agg.aggregate([sending("new", count=2), sending("new"), None, None])
    assert finished_sending(result) == {"new"}
    assert result is not None and result.expected_finished_count == 2
    assert agg.expected_finished_count == 2
    # "old" was first seen under the count 4 and keeps it.
    assert (
        finished_sending(agg.aggregate([sending(), sending("old"), sending("old"), None])) == set()
    )
    assert finished_sending(agg.aggregate([sending(), None, None, sending("old")])) == {"old"}
    # The new count persists without being announced again.
    assert finished_sending(agg.aggregate([sending(), None, sending("z"), sending("z")])) == {"z"}


def test_expected_count_from_connector() -> None:
    agg = KVOutputAggregator.from_world_size(4, connector_finished_count=1)
    assert finished_sending(agg.aggregate([sending(), None, sending("a"), None])) == {"a"}


def test_announced_counts_must_agree_and_fit() -> None:
    agg = KVOutputAggregator(2)
    agg.aggregate([sending("a"), None])
    with pytest.raises(AggregationError, match=r"different expected counts: \{0: 1, 1: 2\}"):
        agg.aggregate([sending("a", count=1), sending("a", count=2)])
    with pytest.raises(AggregationError, match=r"count 3 outside \[1, 2 workers\]"):
        agg.aggregate([sending("a", count=3), sending("a")])
    with pytest.raises(AggregationError, match=r"count 0 outside"):
        agg.aggregate([sending("a", count=0), None])
    # Nothing above was counted.
    assert agg.pending_sending() == {"a"} and agg.expected_finished_count == 2
    with pytest.raises(AggregationError, match=r"count 2 outside \[1, 1 workers\]"):
        agg.aggregate([sending("a")])


@pytest.mark.parametrize(("world_size", "count"), [(0, None), (2, 0), (-1, 1)])
def test_bad_constructor_values(world_size: int, count: int | None) -> None:
    with pytest.raises(ConfigError):
        KVOutputAggregator.from_world_size(world_size, count)


def test_missing_output_at_output_rank_yields_none_and_counts_nothing() -> None:
    agg = KVOutputAggregator(2)
    assert agg.aggregate([None, sending("a")], output_rank=0) is None
    assert agg.pending_sending() == frozenset()
    result = agg.aggregate([None, sending("a")], output_rank=1)
    assert result is not None and agg.pending_sending() == {"a"}
    with pytest.raises(AggregationError, match=r"output_rank 2 outside \[0, 2\)"):
        agg.aggregate([sending(), sending()], output_rank=2)
    with pytest.raises(AggregationError, match=r"output_rank 0 outside \[0, 0\)"):
        agg.aggregate([])


def test_empty_output_is_not_none() -> None:
    agg = KVOutputAggregator(1)
    result = agg.aggregate([WorkerOutput()])
    assert result == WorkerOutput(invalid_block_ids=set(), expected_finished_count=1)
    assert result.is_empty()


# -- stats, events, invalid blocks -------------------------------------------------------


def test_stats_are_merged_without_touching_inputs() -> None:
    agg = KVOutputAggregator(3)
    a = TransferStats(num_transfers=2, nbytes=100, durations_s=[0.5, 0.25])
    b = TransferStats(num_transfers=1, nbytes=30, durations_s=[1.0], num_failures=1)
    outputs = [
        WorkerOutput(stats=a),
        None,
        WorkerOutput(stats=b),
    ]
    result = agg.aggregate(outputs)
    assert result is not None
    assert result.stats == TransferStats(3, 130, [0.5, 0.25, 1.0], 1)
    assert a == TransferStats(2, 100, [0.5, 0.25], 0)


def test_empty_stats_become_none() -> None:
    agg = KVOutputAggregator(2)
    outputs = [WorkerOutput(stats=TransferStats()) for _ in range(2)]
    result = agg.aggregate(outputs)
    assert result is not None and result.stats is None


def test_mixed_stats_types_raise_and_count_nothing() -> None:
    agg = KVOutputAggregator(2)
    outputs = [
        WorkerOutput(finished_sending={"a"}, stats=TransferStats(1, 8)),
        WorkerOutput(finished_sending={"a"}, stats=OtherStats(3)),
    ]
    with pytest.raises(StatsTypeError, match="TransferStats and OtherStats"):
        agg.aggregate(outputs)
    assert agg.pending_sending() == frozenset()
    with pytest.raises(StatsTypeError, match="cannot aggregate TransferStats with OtherStats"):
        TransferStats().aggregate(OtherStats())
    assert isinstance(StatsTypeError("x"), TypeError)


def test_negative_stats_rejected() -> None:
    with pytest.raises(ValueError, match="nbytes -1"):
        TransferStats(nbytes=-1)
    with pytest.raises(ValueError, match="min duration -0.5"):
        TransferStats(durations_s=[1.0, -0.5])


def test_events_combined_and_counted_per_worker() -> None:
    agg = KVOutputAggregator(3)
    outputs = [
        WorkerOutput(kv_cache_events=KVCacheEventBatch(["stored:1", "stored:2"])),
        WorkerOutput(kv_cache_events=KVCacheEventBatch(["stored:1"])),
        WorkerOutput(),
    ]
    result = agg.aggregate(outputs)
    assert result is not None and result.kv_cache_events is not None
    assert result.kv_cache_events.events == ["stored:1", "stored:2", "stored:1"]
    assert result.kv_cache_events.num_workers == 2
    assert result.kv_cache_events.common_events() == ["stored:1"]
    assert outputs[0].kv_cache_events == KVCacheEventBatch(["stored:1", "stored:2"])
    none = agg.aggregate([WorkerOutput(), None, None])
    assert none is not None and none.kv_cache_events is None


def test_event_batch_rejects_zero_workers() -> None:
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        KVCacheEventBatch([], 0)


def test_invalid_block_ids_are_unioned() -> None:
    agg = KVOutputAggregator(3)
    outputs = [
        WorkerOutput(invalid_block_ids={1, 2}),
        WorkerOutput(invalid_block_ids={2, 7}),
        None,
    ]
    result = agg.aggregate(outputs)
    assert result is not None and result.invalid_block_ids == {1, 2, 7}
    assert not result.is_empty()
    assert outputs[0] is not None and outputs[0].invalid_block_ids == {1, 2}


# -- property: random interleavings --------------------------------------------------------


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[int, list[list[set[str]]]]:
    """Per step, per worker, the requests that worker reports; each (worker, request)
    pair appears once, plus optional duplicate re-reports before the request finishes."""
    num_workers = draw(st.integers(1, 4))
    req_ids = [f"req-{i}" for i in range(draw(st.integers(1, 6)))]
    reports = [(w, r) for w in range(num_workers) for r in req_ids]
    order = draw(st.permutations(reports))
    steps = [draw(st.integers(0, 7)) for _ in order]
    num_steps = max(steps) + 1
    plan: list[list[set[str]]] = [[set() for _ in range(num_workers)] for _ in range(num_steps)]
    last_step = {
        r: max(s for (_, rr), s in zip(order, steps, strict=True) if rr == r) for r in req_ids
    }
    for (worker, req_id), step in zip(order, steps, strict=True):
        plan[step][worker].add(req_id)
        if draw(st.booleans()):  # re-report, no later than the request's last first report
            plan[draw(st.integers(step, last_step[req_id]))][worker].add(req_id)
    return num_workers, plan


@settings(max_examples=150, deadline=None)
@given(case=interleavings())
def test_each_request_finishes_once_after_all_workers(
    case: tuple[int, list[list[set[str]]]],
) -> None:
    num_workers, plan = case
    agg = KVOutputAggregator.from_world_size(num_workers)
    reported: dict[str, set[int]] = {}
    finished_at: dict[str, int] = {}
    for step, per_worker in enumerate(plan):
        outputs = [sending(*ids) if ids else None for ids in per_worker]
        outputs[0] = outputs[0] or WorkerOutput()
        for worker, ids in enumerate(per_worker):
            for req_id in ids:
                reported.setdefault(req_id, set()).add(worker)
        for req_id in finished_sending(agg.aggregate(outputs)):
            assert req_id not in finished_at, f"{req_id} finished twice"
            assert reported[req_id] == set(range(num_workers))
            finished_at[req_id] = step
        # A request with every worker's report in must be finished by now.
        done = {r for r, workers in reported.items() if len(workers) == num_workers}
        assert done == set(finished_at)
    assert set(finished_at) == set(reported)
    assert agg.pending_sending() == frozenset()
