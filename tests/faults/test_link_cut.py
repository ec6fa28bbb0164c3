"""The cable between P's host and the switch is cut mid-transfer, then plugged back.

Packets are dropped silently (no reset), so only deadlines can notice: D's read
gives up after ``chunk_timeout_s`` of silence and D recomputes the prompt; P's
send times out and it frees at lease expiry. Once the cable is back, D opens a
new link (new handshake) and transfers work again.
"""

from __future__ import annotations

import pytest

from tests.faults.cluster import delta, prompt_of
from tests.faults.conftest import REQUEST_DEADLINE_S, FaultCluster

pytestmark = pytest.mark.faults

MAX_TOKENS = 8


def test_link_cut_mid_transfer_then_restored(cluster: FaultCluster) -> None:
    prompt = prompt_of(300, "link-cut")
    d_before = cluster.metrics("d")
    pending = cluster.client.complete_async(cluster.proxy_url, prompt, MAX_TOKENS)
    cluster.client.wait_metrics(cluster.d_url, lambda v: v["kvbridge_kv_loads_in_flight"] >= 1,
                                timeout_s=REQUEST_DEADLINE_S, what="D loading")
    cluster.lab.link_down("prefill")
    try:
        # D needs nothing from P to recompute: the answer comes while the cable is out
        answer = pending.result(REQUEST_DEADLINE_S + 10)
    finally:
        cluster.lab.link_up("prefill")
    cluster.assert_right(answer, prompt, MAX_TOKENS)
    d_after = cluster.metrics("d")
    assert delta(d_before, d_after, "kv_loads_failed_total") == 1
    cluster.assert_settled()
    for attempt in range(2):  # later requests work again, each with a real transfer
        cluster.assert_serves(f"after-link-cut-{attempt}")
