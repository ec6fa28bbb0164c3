"""KVBridgeConnector in real vLLM when things go wrong: P dies, a peer lacks the secret.

A D that cannot load a prompt's KV either recomputes it (``kv_load_failure_policy``
"recompute": the answer still equals colocated vLLM) or fails the request
("fail", vLLM's default) — never a wrong token — and its transfer counters show
the load failed rather than happened.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.integrations.vllm.client import complete
from tests.integrations.vllm.pd import (
    BLOCK_SIZE,
    FAILURES,
    LATE_SYNC_LOADS,
    NUM_NEW_TOKENS,
    PARAMS_REFUSED,
    SYNC_LOADS,
    TRANSFERS,
    ZERO_CONFIG,
    counters,
    kv_config,
    mixed_spec,
    pd_complete,
    poll_metrics,
    prefill,
    prompt_ids,
    small_p_spec,
    wait_usage,
    warm_up,
)
from tests.integrations.vllm.servers import ServersForTest, ServerSpec, VllmServer
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(900)]


def spec(model: Path, config: str, instance: str) -> ServerSpec:
    return ServerSpec(model, dtype="bfloat16", block_size=BLOCK_SIZE, kv_transfer_config=config,
                      instance=instance)


def assert_request_fails(d: VllmServer, prompt: list[int], params: dict[str, object]) -> None:
    """D with policy "fail" answers with an error, never with tokens."""
    before = counters(d.base_url)
    try:
        done = complete(d.base_url, prompt, NUM_NEW_TOKENS, kv_transfer_params=params)
    except httpx.HTTPStatusError as exc:
        assert exc.response.status_code >= 400
    else:
        assert done.finish_reason not in ("length", "stop"), done.response
    after = poll_metrics(d.base_url, lambda m: m.get(FAILURES, 0) > before[FAILURES])
    assert after[TRANSFERS] == before[TRANSFERS]


def test_p_killed_after_its_prefill(vllm_servers: ServersForTest, tiny_llama: Path) -> None:
    # D: test_pd.py's mixed server (loads of up to 4 blocks synchronous, larger ones
    # asynchronous: both kinds fail; policy recompute) and its P (the zero config: fail).
    # P: test_pd.py's small P, whose last test this is (it is stopped below); no grant
    # board: a same-host reader must ask P before it copies, so a stopped P stops its
    # reads (with the board, D copies a live grant's blocks without P)
    d_recompute, d_fail, p = vllm_servers.shared_all(
        mixed_spec(tiny_llama), spec(tiny_llama, json.dumps(ZERO_CONFIG), "p"),
        small_p_spec(tiny_llama))
    prompts = [prompt_ids(300, seed=29), prompt_ids(650, seed=30)]  # 3 and 6 blocks
    expected = [complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids for prompt in prompts]
    check_a_stopped_p_stalls_no_forward(p, d_recompute)
    # asked for just before P stops: within their 10 s lease when D reads (a D refuses
    # params whose lease ended: no read, no failure to count)
    params = [prefill(p.base_url, prompt) for prompt in prompts]
    p.kill()  # at once (a graceful stop can take long enough on a loaded machine)
    p.stop()  # what it left behind

    before = counters(d_recompute.base_url)
    for prompt, want, with_params in zip(prompts, expected, params, strict=True):
        done = complete(d_recompute.base_url, prompt, NUM_NEW_TOKENS,
                        kv_transfer_params=with_params)
        assert done.token_ids == want
    after = poll_metrics(d_recompute.base_url,
                         lambda m: m.get(FAILURES, 0) >= before[FAILURES] + 2)
    assert after[TRANSFERS] == before[TRANSFERS]  # recomputed, not loaded
    # the small one too is asynchronous: D's last read from this P failed (cold again)
    assert after[SYNC_LOADS] == before[SYNC_LOADS]
    wait_usage(d_recompute.base_url)

    assert_request_fails(d_fail, prompts[1], params[1])
    wait_usage(d_fail.base_url)
    # the failed D still serves: a request without params answers as colocated
    assert complete(d_fail.base_url, prompts[1], NUM_NEW_TOKENS).token_ids == expected[1]


def check_a_stopped_p_stalls_no_forward(p: VllmServer, d: VllmServer) -> None:
    """A synchronous load from a P that stopped (SIGSTOP: its listener still accepts,
    nothing answers), on a D that recomputes failed loads: the load is late at its
    deadline, its read is cancelled (nothing of it writes the blocks vLLM recomputes
    into) and D recomputes the request, while P is still stopped; a request already
    decoding on D meanwhile keeps getting tokens (issue #29, bounded synchronous loads).
    Before the cancel existed, the forward, and with it every request on D, waited for
    the read to fail on the agent's deadlines (no late load counted)."""
    warm_up(p.base_url, d.base_url)  # D's first load from a P is asynchronous
    prompt = prompt_ids(300, seed=31)  # 3 blocks: synchronous
    expected = complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids
    params = prefill(p.base_url, prompt)
    before = counters(d.base_url)
    assert p.pid is not None
    with Stream(d.base_url, prompt_ids(20, seed=32), max_tokens=6000) as other:
        wait_until(lambda: other.num_chunks, 120.0, message="D's other request to decode")
        os.killpg(p.pid, signal.SIGSTOP)
        try:
            done = complete(d.base_url, prompt, NUM_NEW_TOKENS, kv_transfer_params=params)
            assert done.token_ids == expected  # recomputed
            after = poll_metrics(d.base_url,
                                 lambda m: m.get(LATE_SYNC_LOADS, 0) > before[LATE_SYNC_LOADS]
                                 and m.get(FAILURES, 0) > before[FAILURES],
                                 timeout_s=60)
            seen = other.num_chunks
            wait_until(lambda: other.num_chunks, 60.0, until=lambda num: num > seen,
                       message="D's other request to go on decoding while P is stopped")
            assert not other.ended, other.error  # it decoded all along, P still stopped
        finally:
            os.killpg(p.pid, signal.SIGCONT)
    assert after[LATE_SYNC_LOADS] == before[LATE_SYNC_LOADS] + 1  # given up at the deadline
    assert after[SYNC_LOADS] == before[SYNC_LOADS] + 1
    assert after[TRANSFERS] == before[TRANSFERS]
    assert after[FAILURES] == before[FAILURES] + 1
    wait_usage(d.base_url)


class Stream:
    """A streaming completion on D, read on a thread that counts its chunks; leaving
    the ``with`` block closes it (vLLM aborts the request)."""

    def __init__(self, base_url: str, prompt: list[int], max_tokens: int) -> None:
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                     "ignore_eos": True, "stream": True}
        self.url = f"{base_url}/v1/completions"
        self.num_chunks = 0
        self.ended = False
        self.error: BaseException | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="stream")

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._closing.set()
        self._thread.join(60.0)

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=300.0) as response:
                for line in response.iter_lines():
                    if self._closing.is_set():
                        return
                    if line.startswith("data: {"):
                        self.num_chunks += 1
        except BaseException as exc:
            self.error = exc
        self.ended = True


def test_a_peer_without_the_secret_is_refused(
    vllm_servers: ServersForTest, tiny_llama: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a cluster secret of at least 16 bytes\n")
    secret.chmod(0o600)
    with_secret = kv_config(secret_file=str(secret))
    d_without = vllm_servers.shared(spec(tiny_llama, json.dumps(ZERO_CONFIG), "p"))
    p, d = vllm_servers.private_all(spec(tiny_llama, with_secret, "p-secret"),
                                    spec(tiny_llama, with_secret, "d-secret"))
    prompt = prompt_ids(400, seed=31)
    expected = complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids

    ok = pd_complete(p.base_url, d.base_url, prompt, expect_transfers=1)
    assert ok.completion.token_ids == expected and ok.num_transfers == 1

    # a D with another secret (here: this user's host secret) cannot verify P's
    # signature: it reads nothing and computes the prompt itself (the agents'
    # handshake refuses such a peer too: tests/transfer/test_cluster_secret.py)
    params = prefill(p.base_url, prompt)
    before = counters(d_without.base_url)
    done = complete(d_without.base_url, prompt, NUM_NEW_TOKENS, kv_transfer_params=params)
    assert done.token_ids == expected
    after = poll_metrics(d_without.base_url,
                         lambda m: m.get(PARAMS_REFUSED, 0) > before[PARAMS_REFUSED])
    assert (after.get(TRANSFERS, 0), after.get(FAILURES, 0)) == (before[TRANSFERS],
                                                                 before[FAILURES])
    log = d_without.log_path.read_text(errors="replace")
    assert "refusing its kv_transfer_params (bad_signature)" in log, log[-3000:]
    # P is not wedged: the refused reader's grant ends with its lease; others still read
    again = pd_complete(p.base_url, d.base_url, prompt_ids(300, seed=32), expect_transfers=1)
    assert again.num_transfers == 1


def test_block_sizes_it_cannot_convert_are_refused_not_moved(
    vllm_servers: ServersForTest, tiny_llama: Path
) -> None:
    # vLLM's CPU cache stores K transposed inside each block: kvbridge cannot regroup
    # its tokens into blocks of another size, so the handshake refuses the pair
    p = vllm_servers.shared(spec(tiny_llama, json.dumps(ZERO_CONFIG), "p"))
    d = vllm_servers.private(ServerSpec(tiny_llama, dtype="bfloat16", block_size=64,
                                        kv_transfer_config=kv_config("recompute"),
                                        instance="d-64"))
    prompt = prompt_ids(500, seed=33)
    expected = complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids
    before = counters(d.base_url)
    done = complete(d.base_url, prompt, NUM_NEW_TOKENS,
                    kv_transfer_params=prefill(p.base_url, prompt))
    assert done.token_ids == expected  # recomputed
    after = poll_metrics(d.base_url, lambda m: m.get(FAILURES, 0) > before[FAILURES])
    assert after[TRANSFERS] == before[TRANSFERS]
    log = d.log_path.read_text(errors="replace")
    assert "equal block sizes: local 64, remote 128" in log, log[-3000:]
    wait_usage(d.base_url)  # (P, never asked for a block, frees at its lease's end)
