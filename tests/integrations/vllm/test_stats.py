"""``KVBridgeStats``: the workers' and the scheduler side's parts merged as vLLM merges them.

``kvbridge.integrations.vllm.stats`` imports vLLM: imported in the test, so that
collection works without vLLM (``conftest.py`` skips or fails the test then).
"""

from __future__ import annotations

from kvbridge.connector.outputs import TransferStats


def test_scheduler_counts_and_gauges_survive_aggregation() -> None:
    from kvbridge.integrations.vllm.stats import KVBridgeStats

    worker = KVBridgeStats.of(TransferStats(num_transfers=2, nbytes=10, durations_s=[0.1]), 1, 1)
    scheduler = KVBridgeStats.of_scheduler(3, {"held_bytes": 100, "held_requests": 2})
    merged = worker.aggregate(scheduler).aggregate(worker)
    assert isinstance(merged, KVBridgeStats)
    assert {key: merged.data[key] for key in ("num_transfers", "num_sync_loads",
                                              "num_late_sync_loads", "num_params_refused",
                                              "held_bytes", "held_requests")} == {
        "num_transfers": 4, "num_sync_loads": 2, "num_late_sync_loads": 2,
        "num_params_refused": 3, "held_bytes": 100, "held_requests": 2}
    # nothing new: empty; gauges back to zero are news
    assert KVBridgeStats.of_scheduler(0, None).is_empty()
    assert not KVBridgeStats.of_scheduler(0, {"held_bytes": 0, "held_requests": 0}).is_empty()
