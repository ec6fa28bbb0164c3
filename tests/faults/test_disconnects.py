"""Clients that hang up: mid-stream on D, while D loads, and while P still prefills.

Each test checks that the engines give every block back (free == total, nothing
held, within the lease plus slack), that what the client did see was right, and
that the next request is answered right with a real transfer.
"""

from __future__ import annotations

import threading

import pytest

from tests.faults.cluster import delta, prompt_of
from tests.faults.conftest import REQUEST_DEADLINE_S, FaultCluster

pytestmark = pytest.mark.faults


def test_client_disconnects_mid_stream_on_d(cluster: FaultCluster) -> None:
    prompt = prompt_of(200, "stream-drop")
    aborted_before = cluster.metrics("d")["kvbridge_requests_aborted_total"]
    events = cluster.client.stream_then_drop(cluster.proxy_url, prompt, max_tokens=400,
                                             num_events=3)
    seen = [t for event in events for t in event["choices"][0]["token_ids"]]
    # greedy: the first tokens of a long answer are the answer to a short request
    assert seen == cluster.reference.tokens(prompt, len(seen)), events
    cluster.assert_settled()
    values = cluster.metrics("d")
    assert values["kvbridge_requests_aborted_total"] == aborted_before + 1
    assert values["kvbridge_generation_tokens_total"] > 0
    cluster.assert_serves("after-stream-drop")


def test_client_disconnects_while_d_loads(cluster: FaultCluster) -> None:
    prompt = prompt_of(300, "load-drop")
    d_before = cluster.metrics("d")
    drop = threading.Event()
    outcome = cluster.client.post_then_drop(cluster.proxy_url, prompt, 8, drop)
    try:
        cluster.client.wait_metrics(cluster.d_url, lambda v: v["kvbridge_kv_loads_in_flight"] >= 1,
                                    timeout_s=REQUEST_DEADLINE_S, what="D loading")
    finally:
        drop.set()
    assert outcome.result(REQUEST_DEADLINE_S) == "dropped"
    # D keeps the blocks until its workers let go of the read, then frees them;
    # P frees once D reports (or at lease expiry).
    cluster.assert_settled()
    d_after = cluster.metrics("d")
    assert delta(d_before, d_after, "requests_aborted_total") == 1
    assert delta(d_before, d_after, "kv_loads_started_total") == 1
    assert delta(d_before, d_after, "generation_tokens_total") == 0
    cluster.assert_serves("after-load-drop")


def test_abort_on_p_before_prefill_ends(cluster: FaultCluster) -> None:
    # 900 tokens at 64 per step: P prefills over a dozen steps
    prompt = prompt_of(900, "prefill-drop")
    p_before, d_before = cluster.metrics("p"), cluster.metrics("d")
    drop = threading.Event()
    outcome = cluster.client.post_then_drop(cluster.proxy_url, prompt, 8, drop)
    try:
        cluster.client.wait_metrics(cluster.p_url, lambda v: v["kvbridge_requests_running"] >= 1,
                                    timeout_s=REQUEST_DEADLINE_S, what="P prefilling")
    finally:
        drop.set()
    assert outcome.result(REQUEST_DEADLINE_S) == "dropped"
    cluster.assert_settled()
    p_after, d_after = cluster.metrics("p"), cluster.metrics("d")
    assert delta(p_before, p_after, "requests_aborted_total") == 1
    # aborted before its prefill ended: no grant, nothing reached D
    assert delta(p_before, p_after, "kv_grants_issued_total") == 0
    assert delta(d_before, d_after, "prompt_tokens_total") == 0
    assert delta(d_before, d_after, "kv_loads_started_total") == 0
    cluster.assert_serves("after-prefill-drop")
