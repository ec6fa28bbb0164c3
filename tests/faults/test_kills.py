"""Processes killed with SIGKILL: a P worker mid-transfer, P before D reads, D mid-read.

A dead P means D recomputes the prompt itself: the client still gets the right
answer, within the deadline, and D gives every block back. A P whose worker died
stops its engine: it says so on ``/health`` and the proxy answers later requests
with a clear error instead of hanging. A D that dies mid-read, after P's first
token: the proxy has the rest of the answer computed again elsewhere (here by P,
the only other engine), so the client still gets the right answer; P frees the
blocks it held for the dead D when the lease runs out.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.faults.cluster import Answer, delta, prompt_of
from tests.faults.conftest import (
    REQUEST_DEADLINE_S,
    SETTLE_S,
    TRANSFER_PORT,
    FaultCluster,
    PConfig,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.faults

MAX_TOKENS = 8


def _loading(values: dict[str, float]) -> bool:
    return values["kvbridge_kv_loads_in_flight"] >= 1


def _assert_clear_error(answer: Answer, *words: str) -> None:
    assert answer.elapsed_s < REQUEST_DEADLINE_S, answer
    assert answer.status >= 500 and answer.error, (answer.status, answer.text[:500])
    assert all(word in answer.error for word in words), answer.error


def _wait_unhealthy(cluster: FaultCluster, url: str) -> dict[str, object]:
    response = wait_until(lambda: cluster.client.get(f"{url}/health"), REQUEST_DEADLINE_S,
                          interval_s=0.1, until=lambda r: r.status_code == 503,
                          message=f"{url}/health to say 503",
                          describe=lambda r: f"{r.status_code} {r.text}")
    body: dict[str, object] = response.json()
    return body


@pytest.mark.p_config(PConfig(tp=2))
def test_kill_p_worker_mid_transfer(cluster: FaultCluster) -> None:
    prompt = prompt_of(300, "kill-p-worker")
    d_before = cluster.metrics("d")
    pending = cluster.client.complete_async(cluster.proxy_url, prompt, MAX_TOKENS)
    cluster.client.wait_metrics(cluster.d_url, _loading, timeout_s=REQUEST_DEADLINE_S,
                                what="D loading")
    assert cluster.p is not None
    worker = cluster.p.pid_listening_on(TRANSFER_PORT + 1)  # TP rank 1's agent
    assert worker in cluster.p.child_pids()
    os.kill(worker, signal.SIGKILL)

    answer = pending.result(REQUEST_DEADLINE_S + 10)
    cluster.assert_right(answer, prompt, MAX_TOKENS)  # recomputed on D
    d_after = cluster.metrics("d")
    assert delta(d_before, d_after, "kv_loads_failed_total") == 1
    cluster.assert_settled(p=False)
    # P's engine lost a worker: it stops, says so, and the proxy reports it
    health = _wait_unhealthy(cluster, cluster.p_url)
    assert health["status"] != "ok", health
    refused = cluster.client.complete(cluster.proxy_url, prompt_of(50, "p-dead"), MAX_TOKENS)
    _assert_clear_error(refused, "prefill")


def test_kill_p_after_prefill_before_d_reads(cluster: FaultCluster) -> None:
    prompt = prompt_of(300, "kill-p-early")
    # what the proxy does first: prefill on P, keep the KV for a remote decode
    prefilled = cluster.client.complete(cluster.p_url, prompt, 1,
                                        kv_transfer_params={"do_remote_decode": True})
    assert prefilled.status == 200 and prefilled.body is not None, prefilled.text
    params = prefilled.body["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"], params
    assert cluster.p is not None
    cluster.p.kill()  # the whole P host service: server and workers

    d_before = cluster.metrics("d")
    answer = cluster.client.complete(cluster.d_url, prompt, MAX_TOKENS,
                                     kv_transfer_params=params)
    cluster.assert_right(answer, prompt, MAX_TOKENS)  # recomputed on D
    d_after = cluster.metrics("d")
    assert delta(d_before, d_after, "kv_loads_failed_total") == 1
    assert answer.body is not None and answer.body["kvbridge"]["num_remote_tokens"] == 0
    cluster.assert_settled(p=False)
    refused = cluster.client.complete(cluster.proxy_url, prompt_of(50, "p-gone"), MAX_TOKENS)
    _assert_clear_error(refused, "prefill")


def test_kill_d_mid_read_p_frees_at_lease_expiry(cluster: FaultCluster) -> None:
    prompt = prompt_of(300, "kill-d")
    p_before = cluster.metrics("p")
    pending = cluster.client.complete_async(cluster.proxy_url, prompt, MAX_TOKENS)
    cluster.client.wait_metrics(cluster.d_url, _loading, timeout_s=REQUEST_DEADLINE_S,
                                what="D loading")
    held = cluster.metrics("p")["kvbridge_cache_blocks_held_for_transfer"]
    assert held > 0
    assert cluster.d is not None
    cluster.d.kill()

    # the proxy's first-token flow asks again without the params (serving/recovery.py)
    cluster.assert_right(pending.result(REQUEST_DEADLINE_S + 10), prompt, MAX_TOKENS)
    # no reader will ever report: P lets go when the (renewed) lease runs out
    values = cluster.client.wait_all_blocks_free(cluster.p_url, timeout_s=SETTLE_S)
    assert (values["kvbridge_kv_grants_released_total"]
            == p_before["kvbridge_kv_grants_released_total"] + 1)
