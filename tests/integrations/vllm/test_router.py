"""P/D through vllm-router (the router vLLM deployments run), token for token against colocated.

vllm-router's NIXL mode (``--vllm-pd-disaggregation --kv-connector nixl``)
sends P the client's request with ``max_tokens`` 1, ``stream`` false and
``{"do_remote_decode": true, ...}``, then sends D the client's request with
the ``kv_transfer_params`` of P's answer, copied as they are, and relays D's
answer (streamed or not). kvbridge's params are signed (issue 29): D loads
only if they arrive unchanged, so every check here also reads D's counters:
no params refused, one transfer per request, every prompt token but the last
loaded from P. (The router re-encodes the params, and its JSON parser reads
floats to within 1 ULP: P's ``expires_at`` is whole seconds for that.)

Servers (``pd.router_specs``): the float32 tiny Llama (wide logits: no near
ties). P and D here also serve chat (vLLM's built-in ChatML template: the tiny
model has none); P has the zero config, D loads asynchronously; the colocated
answers are P's, asked without ``kv_transfer_params``. The second P of the
two-P test, and the second D of the two-D test, is the third server, the P that
test_router_faults.py (run next) kills (test_proxy_xpyd.py, run just before,
starts the three together).
The router runs as the real program, a child process on a free port.
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
    PROMPT_TOKENS,
    complete,
    metrics,
    poll_metrics,
)
from tests.integrations.vllm.pd import (
    BLOCK_SIZE,
    BYTES,
    FAILURES,
    HELD_REQUESTS,
    NUM_NEW_TOKENS,
    PARAMS_REFUSED,
    TRANSFERS,
    answer,
    at_once,
    counters,
    prompt_ids,
    router_specs,
    wait_usage,
)
from tests.integrations.vllm.router import require_router, vllm_router
from tests.integrations.vllm.servers import ServersForTest, VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# per block on D: 2 layers x 2 KV heads x 128 slots x (K+V of 32) x 4 bytes (float32)
BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 64 * 4


@pytest.fixture
def servers(vllm_servers: ServersForTest, tiny_llama_fp32: Path
            ) -> tuple[VllmServer, VllmServer, VllmServer]:
    """P, D and the second P (``pd.router_specs``), asked for together by every test
    here: the pool starts those not running together, and stops none of them between
    these tests."""
    p, d, p2 = vllm_servers.shared_all(*router_specs(tiny_llama_fp32))
    return p, d, p2


@pytest.fixture(scope="module", autouse=True)
def router_installed() -> None:
    require_router()


def completion_body(model: str, prompt: list[int], *, stream: bool) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": NUM_NEW_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}


def chat_body(model: str, text: str, *, stream: bool) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": NUM_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


def chat(url: str, body: dict[str, Any]) -> tuple[list[int], str, int]:
    """A chat answer's (tokens, text, prompt tokens); a stream's events joined, checked
    to end with ``[DONE]`` and no error event."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                      timeout=300) as response:
        if response.is_error:
            response.read()
            raise AssertionError(f"{response.status_code} from {url}: {response.text[:2000]}")
        if not body["stream"]:
            response.read()
            reply = response.json()
            [choice] = reply["choices"]
            return (choice["token_ids"], choice["message"]["content"],
                    reply["usage"]["prompt_tokens"])
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert not any("error" in event for event in events), events[-1]
    choices = [c for event in events for c in event["choices"]]
    return ([t for c in choices for t in c.get("token_ids") or []],
            "".join(c["delta"].get("content") or "" for c in choices),
            events[-1]["usage"]["prompt_tokens"])


def d_loaded(d_url: str, before: dict[str, float], prompt_lengths: list[int]) -> None:
    """D read each prompt's KV from P with the params P signed, and nothing else: one
    transfer per prompt, every token but the last, no params refused, no failure."""
    num_tokens = [n - 1 for n in prompt_lengths]
    after = poll_metrics(d_url, lambda m: m.get(TRANSFERS, 0.0) + m.get(FAILURES, 0.0)
                         >= before[TRANSFERS] + before[FAILURES] + len(prompt_lengths))
    moved = {name: after.get(name, 0.0) - before[name]
             for name in (TRANSFERS, FAILURES, PARAMS_REFUSED, BYTES,
                          EXTERNAL_PREFIX_CACHE_HITS)}
    assert moved == {
        TRANSFERS: len(prompt_lengths), FAILURES: 0, PARAMS_REFUSED: 0,
        BYTES: sum(-(-n // BLOCK_SIZE) for n in num_tokens) * BLOCK_NBYTES,
        EXTERNAL_PREFIX_CACHE_HITS: sum(num_tokens),
    }


def test_completions_through_vllm_router_equal_colocated_streamed_or_not(
    servers: tuple[VllmServer, VllmServer, VllmServer], tmp_path: Path
) -> None:
    p, d, _ = servers
    model = str(p.spec.model)
    # random tokens: no two prompts share a block, so D's prefix cache never answers
    prompts = [prompt_ids(n, seed=40 + i) for i, n in enumerate((5, 300, 700, 9, 260, 1100))]
    expected = [complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids for prompt in prompts]
    before = counters(d.base_url)
    with vllm_router([p], [d], tmp_path / "router.log") as router:
        for i, prompt in enumerate(prompts):
            stream = i >= len(prompts) // 2
            tokens, _ = answer(router, completion_body(model, prompt, stream=stream))
            assert tokens == expected[i], (stream, len(prompt))
    d_loaded(d.base_url, before, [len(prompt) for prompt in prompts])
    wait_usage(p.base_url)  # P's holds given back: D told it it had read them
    wait_usage(d.base_url)


def test_chat_completions_through_vllm_router_equal_colocated_streamed_or_not(
    servers: tuple[VllmServer, VllmServer, VllmServer], tmp_path: Path
) -> None:
    p, d, _ = servers
    model = str(p.spec.model)
    texts = [f"{i} " + " ".join(f"word{(i * 31 + j) % 97}" for j in range(n))
             for i, n in enumerate((3, 150, 400, 5, 200))]
    expected = [chat(p.base_url, chat_body(model, text, stream=False)) for text in texts]
    before = counters(d.base_url)
    with vllm_router([p], [d], tmp_path / "router.log") as router:
        for i, text in enumerate(texts):
            stream = i >= 2
            got = chat(router, chat_body(model, text, stream=stream))
            assert got == expected[i], (stream, text[:30])
    d_loaded(d.base_url, before, [num_prompt for _, _, num_prompt in expected])
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_requests_at_once_through_vllm_router(
    servers: tuple[VllmServer, VllmServer, VllmServer], tmp_path: Path
) -> None:
    p, d, _ = servers
    model = str(p.spec.model)
    prompts = [prompt_ids(n, seed=50 + i)
               for i, n in enumerate((7, 90, 130, 256, 300, 511, 800, 1200))]
    expected = [complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids for prompt in prompts]
    before = counters(d.base_url)
    with vllm_router([p], [d], tmp_path / "router.log") as router:
        got = at_once([partial(answer, router, completion_body(model, prompt, stream=i % 2 == 1))
                       for i, prompt in enumerate(prompts)])
    assert [tokens for tokens, _ in got] == expected
    d_loaded(d.base_url, before, [len(prompt) for prompt in prompts])
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_two_prefill_servers_behind_vllm_router(
    servers: tuple[VllmServer, VllmServer, VllmServer], tmp_path: Path
) -> None:
    """2P1D: the router sends prefills to both Ps in turn; D reads each prompt from the
    P that computed it (each P signs its own params; one host secret)."""
    p, d, p2 = servers
    model = str(p.spec.model)
    prompts = [prompt_ids(n, seed=60 + i) for i, n in enumerate((140, 300, 520, 700))]
    expected = [complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids for prompt in prompts]
    before = counters(d.base_url)
    prefilled_before = [metrics(server.base_url).get(PROMPT_TOKENS, 0.0) for server in (p, p2)]
    with vllm_router([p, p2], [d], tmp_path / "router.log") as router:
        got = at_once([partial(answer, router, completion_body(model, prompt, stream=False))
                       for prompt in prompts])
    assert [tokens for tokens, _ in got] == expected
    d_loaded(d.base_url, before, [len(prompt) for prompt in prompts])
    # round robin: each P prefilled two of the four prompts (which two is the router's)
    prefilled = [poll_metrics(server.base_url, lambda m, n=n: m.get(PROMPT_TOKENS, 0.0) > n)
                 [PROMPT_TOKENS] - n for server, n in zip((p, p2), prefilled_before, strict=True)]
    assert all(prefilled) and sum(prefilled) == sum(len(prompt) for prompt in prompts), prefilled
    for server in (p, p2, d):
        wait_usage(server.base_url)


def test_two_decode_servers_behind_vllm_router(
    servers: tuple[VllmServer, VllmServer, VllmServer], tmp_path: Path
) -> None:
    """1P2D: the router sends decodes to both Ds in turn; each reads its prompts from
    P, and P holds nothing afterwards."""
    p, d, d2 = servers
    model = str(p.spec.model)
    prompts = [prompt_ids(n, seed=70 + i) for i, n in enumerate((150, 330, 40, 610))]
    expected = [complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids for prompt in prompts]
    before = {server.base_url: counters(server.base_url) for server in (d, d2)}
    with vllm_router([p], [d, d2], tmp_path / "router.log") as router:
        got = at_once([partial(answer, router, completion_body(model, prompt, stream=i % 2 == 1))
                       for i, prompt in enumerate(prompts)])
    assert [tokens for tokens, _ in got] == expected
    moved = {}
    for url, counts in before.items():
        after = poll_metrics(url, lambda m, c=counts: m.get(TRANSFERS, 0.0) + m.get(FAILURES, 0.0)
                             >= c[TRANSFERS] + c[FAILURES] + 2)
        moved[url] = {name: after.get(name, 0.0) - counts[name]
                      for name in (TRANSFERS, FAILURES, PARAMS_REFUSED)}
    # round robin: each D read two of the four prompts (which two is the router's)
    assert [m[TRANSFERS] for m in moved.values()] == [2, 2], moved
    assert all(m[FAILURES] == m[PARAMS_REFUSED] == 0 for m in moved.values()), moved
    poll_metrics(p.base_url, lambda m: m.get(HELD_REQUESTS, 1) == 0, timeout_s=15)
    for server in (p, d, d2):
        wait_usage(server.base_url)
