"""P/D through KVBridgeConnector in real vLLM servers, token for token against colocated vLLM.

Servers (bf16 tiny Llama, block size 128, TP 1): a plain colocated vLLM for the
reference answers, P and D with the zero config a user types (authenticated
by this user's host secret: P signs the params it hands out, D checks them). Each P/D answer
must equal the colocated one and D must have loaded the prompt's KV through the
connector (kvbridge's transfer counters and vLLM's external prefix-cache hits),
and P must give its blocks back once D has read them.

With the zero config every load of this tiny model is small enough to be
synchronous (read before the forward of the step that schedules it); the
eight-at-once test runs a D whose threshold makes its larger loads
asynchronous, so both kinds run side by side in the same steps. That server
(``pd.mixed_spec``) is shared with test_pd_faults. The cap on unread holds runs
on a P of its own (a small cache, ``pd.small_p_spec``), which test_pd_faults then kills.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integrations.vllm.client import (
    EXTERNAL_PREFIX_CACHE_HITS,
    KV_CACHE_USAGE,
    complete,
    metrics,
    poll_metrics,
)
from tests.integrations.vllm.pd import (
    BLOCK_NBYTES,
    BLOCK_SIZE,
    BYTES,
    D_TIMELINE,
    FAILURES,
    HELD_BYTES,
    HELD_REQUESTS,
    LATE_SYNC_LOADS,
    NUM_NEW_TOKENS,
    P_TIMELINE,
    PARAMS_REFUSED,
    SMALL_P_BLOCKS,
    SYNC_BLOCKS,
    SYNC_LOADS,
    TEXT_PROMPTS,
    TRANSFERS,
    answers_at_once,
    at_once,
    counters,
    first_texts,
    kvbridge_proxy,
    mixed_spec,
    pd_complete,
    pd_spec,
    prefill,
    prompt_ids,
    small_p_spec,
    wait_usage,
    warm_up,
)
from tests.integrations.vllm.servers import ServersForTest, ServerSpec, VllmServer
from tests.marks import full_only
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture
def ref_spec(tiny_llama: Path) -> ServerSpec:
    return ServerSpec(tiny_llama, dtype="bfloat16", block_size=BLOCK_SIZE)


@pytest.fixture
def p_spec(tiny_llama: Path) -> ServerSpec:
    return pd_spec(tiny_llama, "p")


@pytest.fixture
def d_spec(tiny_llama: Path) -> ServerSpec:
    return pd_spec(tiny_llama, "d")


@pytest.fixture
def mixed(tiny_llama: Path) -> ServerSpec:
    """The second P/D server (``pd.mixed_spec``); its tests run last here: it takes
    the pool's third place from D."""
    return mixed_spec(tiny_llama)


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def reference(
    servers: ServersForTest,
    spec: ServerSpec,
    prompts: list[list[int]],
    max_tokens: int = NUM_NEW_TOKENS,
) -> list[list[int]]:
    """Colocated greedy tokens of ``prompts`` (asked once per prompt in the session)."""
    missing = [p for p in prompts if tuple(p) + (max_tokens,) not in _REFERENCE]
    if missing:
        server = servers.shared(spec)
        for prompt in missing:
            _REFERENCE[tuple(prompt) + (max_tokens,)] = complete(
                server.base_url, prompt, max_tokens
            ).token_ids
    return [_REFERENCE[tuple(p) + (max_tokens,)] for p in prompts]


def pd_pair(
    servers: ServersForTest, p_spec: ServerSpec, d_spec: ServerSpec
) -> tuple[VllmServer, VllmServer]:
    p, d = servers.shared_all(p_spec, d_spec)
    return p, d


@pytest.mark.parametrize("num_prompt_tokens", [5, 600, *full_only(BLOCK_SIZE)])  # <1, 5, 1 blocks
def test_pd_answers_equal_colocated_and_d_loads_the_prompt(
    vllm_servers: ServersForTest,
    ref_spec: ServerSpec,
    p_spec: ServerSpec,
    d_spec: ServerSpec,
    num_prompt_tokens: int,
) -> None:
    vllm_servers.shared_all(ref_spec, p_spec, d_spec)  # the first time: started together
    prompt = prompt_ids(num_prompt_tokens)
    [expected] = reference(vllm_servers, ref_spec, [prompt])
    p, d = pd_pair(vllm_servers, p_spec, d_spec)
    result = pd_complete(p.base_url, d.base_url, prompt, expect_transfers=1)
    assert result.completion.token_ids == expected
    # P announces where its (only) worker listens: its own port, not a base
    params = result.params
    assert len(params["remote_ports"]) == 1 and params["remote_port"] == params["remote_ports"][0]
    assert params["remote_block_size"] == BLOCK_SIZE
    # D loaded everything but the last prompt token, whose logits it computes itself
    num_blocks = -(-(num_prompt_tokens - 1) // BLOCK_SIZE)
    # vLLM's default failure policy "fail": every load asynchronous (a late synchronous
    # one would fail the request)
    assert (result.num_transfers, result.num_failures, result.num_sync_loads) == (1, 0, 0)
    assert result.external_hits == num_prompt_tokens - 1
    assert result.nbytes == num_blocks * BLOCK_NBYTES
    # P gives its blocks back once D has read them; D's are free once answered
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_d_reads_only_what_its_prefix_cache_lacks(
    vllm_servers: ServersForTest,
    ref_spec: ServerSpec,
    p_spec: ServerSpec,
    d_spec: ServerSpec,
) -> None:
    first = prompt_ids(700, seed=1)
    partial = first[: 3 * BLOCK_SIZE] + prompt_ids(300, seed=2)  # shares 3 blocks
    full = prompt_ids(4 * BLOCK_SIZE + 1, seed=3)  # a second time: 4 blocks hit, 1 token left
    expected = reference(vllm_servers, ref_spec, [first, partial, full])
    p, d = pd_pair(vllm_servers, p_spec, d_spec)

    assert (
        pd_complete(p.base_url, d.base_url, first, expect_transfers=1).completion.token_ids
        == expected[0]
    )
    result = pd_complete(p.base_url, d.base_url, partial, expect_transfers=1)
    assert result.completion.token_ids == expected[1]
    assert result.external_hits == len(partial) - 1 - 3 * BLOCK_SIZE
    assert result.nbytes == (-(-(len(partial) - 1) // BLOCK_SIZE) - 3) * BLOCK_NBYTES

    assert (
        pd_complete(p.base_url, d.base_url, full, expect_transfers=1).completion.token_ids
        == expected[2]
    )
    result = pd_complete(p.base_url, d.base_url, full)
    assert result.completion.token_ids == expected[2]
    assert (result.num_transfers, result.nbytes, result.external_hits) == (0, 0, 0)
    wait_usage(p.base_url)  # D said it will not read: P lets go at once, not at the lease


def test_a_stream_through_kvbridge_proxy_starts_with_ps_token(
    vllm_servers: ServersForTest,
    ref_spec: ServerSpec,
    p_spec: ServerSpec,
    d_spec: ServerSpec,
    tmp_path: Path,
) -> None:
    prompt = prompt_ids(2 * BLOCK_SIZE + 9, seed=7)
    [expected] = reference(vllm_servers, ref_spec, [prompt])
    p, d = pd_pair(vllm_servers, p_spec, d_spec)
    before = counters(d.base_url)
    body = {"model": str(p.spec.model), "prompt": prompt, "max_tokens": NUM_NEW_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with (
        kvbridge_proxy(p.base_url, d.base_url, tmp_path / "proxy.log") as proxy,
        httpx.stream("POST", f"{proxy}/v1/completions", json=body, timeout=60) as response,
    ):
        assert response.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: {")]
    tokens = [t for event in events for c in event["choices"] for t in c.get("token_ids") or []]
    assert tokens == expected
    assert events[0]["choices"][0]["token_ids"] == expected[:1]  # P's token, sent first
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), NUM_NEW_TOKENS)
    # D computed only P's token's position: it loaded every prompt token
    after = poll_metrics(d.base_url, lambda m: m.get(TRANSFERS, 0) > before[TRANSFERS])
    assert after[EXTERNAL_PREFIX_CACHE_HITS] - before[EXTERNAL_PREFIX_CACHE_HITS] == len(prompt)
    assert after[BYTES] - before[BYTES] == 3 * BLOCK_NBYTES
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_requests_shaped_like_vllms_toy_proxy(
    vllm_servers: ServersForTest,
    ref_spec: ServerSpec,
    p_spec: ServerSpec,
    d_spec: ServerSpec,
) -> None:
    prompt = prompt_ids(333, seed=4)
    [expected] = reference(vllm_servers, ref_spec, [prompt])
    p, d = pd_pair(vllm_servers, p_spec, d_spec)
    before = counters(d.base_url)
    p_before, d_before = metrics(p.base_url), metrics(d.base_url)
    # what vllm's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py sends
    to_p = {
        "model": str(p.spec.model),
        "prompt": prompt,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0.0,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    answer = httpx.post(f"{p.base_url}/v1/completions", json=to_p, timeout=60).json()
    to_d = {
        "model": str(d.spec.model),
        "prompt": prompt,
        "max_tokens": NUM_NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": answer["kv_transfer_params"],
    }
    reply = httpx.post(f"{d.base_url}/v1/completions", json=to_d, timeout=60).json()
    assert reply["choices"][0]["token_ids"] == expected
    after = poll_metrics(d.base_url, lambda m: m.get(TRANSFERS, 0) > before[TRANSFERS])
    assert after[BYTES] - before[BYTES] == 3 * BLOCK_NBYTES
    # the read's timeline (issue #40): one more entry in each phase, P's and D's
    poll_metrics(d.base_url, lambda m: all(m.get(n, 0) > d_before.get(n, 0) for n in D_TIMELINE))
    poll_metrics(p.base_url, lambda m: all(m.get(n, 0) > p_before.get(n, 0) for n in P_TIMELINE))


def test_client_leaving_d_gives_every_block_back(
    vllm_servers: ServersForTest,
    p_spec: ServerSpec,
    d_spec: ServerSpec,
) -> None:
    p, d = pd_pair(vllm_servers, p_spec, d_spec)
    prompt = prompt_ids(900, seed=5)
    params = prefill(p.base_url, prompt)
    poll_metrics(p.base_url, lambda m: m.get(KV_CACHE_USAGE, 0) > 0)  # held for D
    body = {
        "model": str(d.spec.model),
        "prompt": prompt,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
        "kv_transfer_params": params,
    }
    with httpx.stream(
        "POST", f"{d.base_url}/v1/completions", json=body, timeout=60
    ) as response:
        for _ in response.iter_lines():
            break  # the client reads one event and leaves
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_first_tokens_that_are_half_a_character_through_kvbridge_proxy(
    vllm_servers: ServersForTest,
    ref_spec: ServerSpec,
    p_spec: ServerSpec,
    d_spec: ServerSpec,
    tmp_path: Path,
) -> None:
    """Text prompts whose first answer token is half a UTF-8 character, with
    whole ones, several at once, streamed and not: text and tokens as colocated.

    P shows such a token as "" (its bytes wait for the next token); D asked to
    continue after it put the prompt's text in front of the answer (issue 28).
    """
    ref = vllm_servers.shared(ref_spec)
    model = str(ref.spec.model)
    texts = first_texts(ref.base_url, model, TEXT_PROMPTS)
    split = [prompt for prompt, text in zip(TEXT_PROMPTS, texts, strict=True) if not text]
    whole = [prompt for prompt, text in zip(TEXT_PROMPTS, texts, strict=True) if text]
    assert len(split) >= 3 and any(len(p) > 500 for p in split), texts
    prompts = [*split[:2], *[p for p in split if len(p) > 500][:1], *whole[:3]]
    expected = answers_at_once(ref.base_url, model, prompts, NUM_NEW_TOKENS, stream=False)
    p, d = pd_pair(vllm_servers, p_spec, d_spec)
    with kvbridge_proxy(p.base_url, d.base_url, tmp_path / "proxy.log") as proxy:
        for stream in (False, True):
            got = answers_at_once(proxy, model, prompts, NUM_NEW_TOKENS, stream=stream)
            for prompt, want, answer in zip(prompts, expected, got, strict=True):
                assert answer == want, (stream, prompt[:40])
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_kvbridge_proxy_lets_p_go_when_d_refuses_or_the_client_leaves(
    vllm_servers: ServersForTest,
    p_spec: ServerSpec,
    d_spec: ServerSpec,
    tmp_path: Path,
) -> None:
    """P's blocks go back at once (not at the end of their 30 s lease) when D refuses the
    request P prefilled for it, or when the client leaves after P's first token."""
    p, d = pd_pair(vllm_servers, p_spec, d_spec)
    wait_usage(p.base_url)
    body = {"model": str(p.spec.model), "temperature": 0.0, "ignore_eos": True}
    with kvbridge_proxy(p.base_url, d.base_url, tmp_path / "proxy.log") as proxy:
        # P answers (the proxy asks it for one token, not streamed); D refuses (400)
        d_refuses = [{"stream": False, "stream_options": {"include_usage": True}},
                     {"stream": True, "min_tokens": 10}]  # > max_tokens
        for seed, changes in enumerate(d_refuses):
            refused = {**body, "prompt": prompt_ids(600, seed=90 + seed), "max_tokens": 5,
                       **changes}
            response = httpx.post(f"{proxy}/v1/completions", json=refused, timeout=60)
            assert response.status_code >= 400 or "decode refused" in response.text, (
                response.text[:300])
            wait_usage(p.base_url)
        gone = {**body, "prompt": prompt_ids(700, seed=92), "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", f"{proxy}/v1/completions", json=gone, timeout=60) as response:
            for _ in response.iter_lines():
                break  # P's token came: the client leaves
        wait_usage(p.base_url)
        wait_usage(d.base_url)


FORGERIES = ("unsigned", "lease extended", "blocks reordered", "another server",
             "another grant", "another prompt's")


def forge(name: str, params: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """What a client that reaches D may send instead of P's ``params`` (``other``: P's
    params of another prompt)."""
    match name:
        case "unsigned":
            return {k: v for k, v in params.items() if k != "signature"}
        case "lease extended":
            return {**params, "expires_at": params["expires_at"] + 3600}
        case "blocks reordered":
            return {**params, "remote_block_ids": params["remote_block_ids"][::-1]}
        case "another server":
            return {**params, "remote_port": free_port(), "remote_ports": [free_port()]}
        case "another grant":
            return {**params, "grant": "x" * 22}
    return other


def test_forged_params_sent_straight_to_d_move_no_byte_and_d_answers_right(
    vllm_servers: ServersForTest,
    ref_spec: ServerSpec,
    p_spec: ServerSpec,
    d_spec: ServerSpec,
) -> None:
    """Params P did not sign as they are plan no read on D: D computes the prompt
    itself (its answer equals colocated), its transfer counters do not move, and its
    prefix cache holds only what it computed (P's honest params then find it all there)."""
    p, d = pd_pair(vllm_servers, p_spec, d_spec)
    prompts = [prompt_ids(2 * BLOCK_SIZE + 1, seed=60 + i) for i in range(len(FORGERIES) + 1)]
    expected = reference(vllm_servers, ref_spec, prompts[:-1])
    held = [prefill(p.base_url, prompt) for prompt in prompts]
    for i, name in enumerate(FORGERIES):
        before = counters(d.base_url)
        forged = forge(name, held[i], held[-1])
        done = complete(d.base_url, prompts[i], NUM_NEW_TOKENS, kv_transfer_params=forged)
        assert done.token_ids == expected[i], name
        refused = before[PARAMS_REFUSED]
        after = poll_metrics(d.base_url, lambda m, n=refused: m.get(PARAMS_REFUSED, 0) > n)
        for counter in (TRANSFERS, FAILURES, BYTES, EXTERNAL_PREFIX_CACHE_HITS):
            assert after.get(counter, 0) == before[counter], (name, counter)
        # P's own params for it now: D's prefix cache has the whole prompt (of its own
        # computing), reads nothing and gives P's grant back
        again = complete(d.base_url, prompts[i], NUM_NEW_TOKENS, kv_transfer_params=held[i])
        assert again.token_ids == expected[i], name
    assert counters(d.base_url)[TRANSFERS] == after.get(TRANSFERS, 0)
    # every hold on P was given back: the honest ones by D, the other prompt's too
    # (D refused it as signed for another prompt and told P)
    wait_usage(p.base_url)


def test_eight_requests_at_once_through_kvbridge_proxy_sync_and_async_loads(
    vllm_servers: ServersForTest,
    ref_spec: ServerSpec,
    p_spec: ServerSpec,
    mixed: ServerSpec,
    tmp_path: Path,
) -> None:
    lengths = [7, 90, 130, 256, 300, 511, 800, 1200]
    prompts = [prompt_ids(n, seed=10 + i) for i, n in enumerate(lengths)]
    # through the proxy D loads the whole prompt (P's token is appended to D's prompt)
    num_sync = sum(1 for n in lengths if -(-n // BLOCK_SIZE) <= SYNC_BLOCKS)
    assert 0 < num_sync < len(lengths)
    expected = reference(vllm_servers, ref_spec, prompts)
    p, d = pd_pair(vllm_servers, p_spec, mixed)
    warm_up(p.base_url, d.base_url)
    before = counters(d.base_url)
    with kvbridge_proxy(p.base_url, d.base_url, tmp_path / "proxy.log") as proxy:
        answers = at_once([partial(complete, proxy, prompt, NUM_NEW_TOKENS,
                                   model=str(p.spec.model)) for prompt in prompts])
    assert [answer.token_ids for answer in answers] == expected
    after = poll_metrics(d.base_url, lambda m: m.get(TRANSFERS, 0) + m.get(FAILURES, 0)
                         >= before[TRANSFERS] + before[FAILURES] + 8)
    num_late = after[LATE_SYNC_LOADS] - before[LATE_SYNC_LOADS]
    num_failed = after[FAILURES] - before[FAILURES]
    assert after[TRANSFERS] - before[TRANSFERS] + num_failed == 8
    if not num_late:
        assert num_failed == 0
        assert after[SYNC_LOADS] == before[SYNC_LOADS] + num_sync
    else:  # a loaded machine: a late load (its read cancelled, recomputed: the answers
        # above are right) turns P cold, later loads go async
        assert num_failed <= num_late
        assert 0 < after[SYNC_LOADS] - before[SYNC_LOADS] <= num_sync
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_unread_prefills_are_capped_and_held_until_their_lease_ends(
    vllm_servers: ServersForTest,
    tiny_llama: Path,
) -> None:
    """A flood of prefills nobody reads takes at most half of P's cache (the default
    ``max_held_share``: the oldest holds go first) and new prefills still run; the
    holds left end with their lease."""
    num_blocks = SMALL_P_BLOCKS
    p = vllm_servers.shared(small_p_spec(tiny_llama))  # test_pd_faults.py kills it later
    prompts = [prompt_ids(9 * BLOCK_SIZE - 50, seed=80 + i) for i in range(8)]  # 9 blocks each
    for prompt in prompts:  # 72 blocks held for nobody without a cap: the last would wait
        prefill(p.base_url, prompt)
    cap = num_blocks // 2 * BLOCK_NBYTES
    poll_metrics(p.base_url, lambda m: 0 < m.get(HELD_BYTES, 0) <= cap
                 and m.get(KV_CACHE_USAGE, 1) <= 0.5)
    answer = complete(p.base_url, prompt_ids(4000, seed=89), 4)  # a new prefill runs
    assert len(answer.token_ids) == 4
    wait_usage(p.base_url, timeout_s=30)  # the lease (10 s) of those held ended
    poll_metrics(p.base_url, lambda m: m.get(HELD_REQUESTS, 1) == 0)
