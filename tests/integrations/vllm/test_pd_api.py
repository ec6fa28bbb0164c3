"""``kvbridge proxy`` beyond single completions, in front of real vLLM P and D servers:
chat completions (streamed and not), ``/v1/models``, and several choices (``n``,
several prompts): each answer equal to colocated vLLM's, D loading P's KV, and no
grant left held on P.

Servers: test_pd.py's P (``pd.pd_spec``) and its second P/D server
(``pd.mixed_spec``) as D, the two it leaves running, so that this module (run
right after it: ``conftest.MODULE_ORDER``) starts none. The colocated answers come
from P itself, asked without ``kv_transfer_params`` (the connector then does
nothing). The prompts are longer than D's synchronous-load threshold: D loads
them asynchronously, and its recompute policy cannot hide a failed load, which
the transfer counters would show. The tiny Llama's tokenizer has a chat
template (``tiny_model.CHAT_TEMPLATE``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integrations.vllm.client import EXTERNAL_PREFIX_CACHE_HITS, poll_metrics
from tests.integrations.vllm.pd import (
    BLOCK_SIZE,
    FAILURES,
    HELD_REQUESTS,
    LATE_SYNC_LOADS,
    SYNC_BLOCKS,
    TRANSFERS,
    counters,
    kvbridge_proxy,
    mixed_spec,
    pd_spec,
    wait_usage,
)
from tests.integrations.vllm.servers import ServersForTest, VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NUM_NEW_TOKENS = 12
_WORDS = ("the", "cache", "block", "token", "prefill", "decode", "memory", "layer", "head",
          "server", "request", "model")
#: A user message of about 660 tokens: more than SYNC_BLOCKS blocks, so D loads it async.
LONG_TEXT = " ".join(_WORDS[i % len(_WORDS)] for i in range(400))


@pytest.fixture
def p_and_d(vllm_servers: ServersForTest, tiny_llama: Path) -> tuple[VllmServer, VllmServer]:
    p, d = vllm_servers.shared_all(pd_spec(tiny_llama, "p"), mixed_spec(tiny_llama))
    return p, d


def post(url: str, path: str, body: dict[str, Any], status: int = 200) -> httpx.Response:
    """One request; a stream is read whole (checked to end with one ``[DONE]``)."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as response:
        response.read()
    assert response.status_code == status, response.text[:2000]
    if body.get("stream") and status == 200:
        events = [e for e in response.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1, events[-3:]
        assert not any('"error"' in e for e in events), events[-2:]
    return response


def choices(response: httpx.Response) -> dict[int, tuple[list[int], str]]:
    """Each choice's (tokens, text) by index, from one JSON answer or from its events."""
    if response.headers["content-type"].startswith("text/event-stream"):
        parts = [c for e in response.text.split("\n\n") if e.startswith("data: {")
                 for c in json.loads(e.removeprefix("data: "))["choices"]]
    else:
        parts = response.json()["choices"]
    got: dict[int, tuple[list[int], str]] = {}
    for c in parts:
        tokens, text = got.get(c["index"], ([], ""))
        message = c.get("delta") or c.get("message")
        piece = message.get("content") if message is not None else c.get("text")
        got[c["index"]] = (tokens + (c.get("token_ids") or []), text + (piece or ""))
    return got


def usage(response: httpx.Response) -> tuple[int, int, int]:
    """(prompt, completion, total) tokens of an answer or of a stream's usage event."""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(e.removeprefix("data: ")) for e in response.text.split("\n\n")
                  if e.startswith("data: {")]
        [found] = [e["usage"] for e in events if e.get("usage")]
    else:
        found = response.json()["usage"]
    return found["prompt_tokens"], found["completion_tokens"], found["total_tokens"]


def test_chat_and_models_through_kvbridge_proxy_equal_colocated(
    p_and_d: tuple[VllmServer, VllmServer], tmp_path: Path
) -> None:
    """Chats of about six blocks, streamed and not: the answer (text, tokens, usage)
    is colocated vLLM's, and D loaded each prompt's KV from P."""
    p, d = p_and_d
    body = {"model": str(p.spec.model), "max_tokens": NUM_NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    user = {"role": "user", "content": LONG_TEXT}
    requests = [  # two prompts: the second would find the first's blocks in D's cache
        {**body, "messages": [{"role": "system", "content": "Answer in tokens."}, user]},
        {**body, "messages": [{"role": "system", "content": "Stream it."}, user],
         "max_completion_tokens": NUM_NEW_TOKENS, "max_tokens": 3,
         "stream": True, "stream_options": {"include_usage": True}},
    ]
    wanted = [post(p.base_url, "/v1/chat/completions", r) for r in requests]
    for want in wanted:
        [(want_tokens, want_text)] = choices(want).values()
        assert len(want_tokens) == NUM_NEW_TOKENS and want_text
        assert usage(want)[0] > SYNC_BLOCKS * BLOCK_SIZE
    before = counters(d.base_url)
    with kvbridge_proxy(p.base_url, d.base_url, tmp_path / "proxy.log") as proxy:
        for request, want in zip(requests, wanted, strict=True):
            got = post(proxy, "/v1/chat/completions", request)
            assert choices(got) == choices(want), request.get("stream")
            assert usage(got) == usage(want)
        models = httpx.get(f"{proxy}/v1/models", timeout=30)
    after = poll_metrics(d.base_url, lambda m: m.get(TRANSFERS, 0) + m.get(FAILURES, 0)
                         >= before[TRANSFERS] + before[FAILURES] + 2)
    assert (after[TRANSFERS], after.get(FAILURES, 0)) == (before[TRANSFERS] + 2,
                                                           before[FAILURES])
    # the classic flow: D computes the last prompt token itself and loads the rest
    hits = after[EXTERNAL_PREFIX_CACHE_HITS] - before[EXTERNAL_PREFIX_CACHE_HITS]
    assert hits == sum(usage(want)[0] - 1 for want in wanted)
    # what D answers itself, but for the time it was asked and the ids vLLM makes per call
    d_models = httpx.get(f"{d.base_url}/v1/models", timeout=30)
    assert models.status_code == 200

    def stable(answer: httpx.Response) -> Any:
        data = answer.json()
        for card in data["data"]:
            card.pop("created")
            card["permission"] = [{k: v for k, v in perm.items() if k not in ("id", "created")}
                                  for perm in card.get("permission") or []]
        return data

    assert stable(models) == stable(d_models)
    assert [card["id"] for card in models.json()["data"]] == [str(p.spec.model)]
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_n_choices_and_several_prompts_through_kvbridge_proxy_leave_no_grant_held(
    p_and_d: tuple[VllmServer, VllmServer], tmp_path: Path
) -> None:
    """``n`` > 1 sampled with a seed, chat and completions, streamed and not, and a
    list of prompts: each choice equals colocated vLLM's of the same index, and P's
    held requests are back to 0 at once (vLLM's P holds one grant per choice and
    returns the params of one: the proxy asks for each choice on its own). Greedy
    ``n`` > 1 is refused as vLLM refuses it."""
    p, d = p_and_d
    text = " ".join(_WORDS[::-1] * 50)
    sampled = {"temperature": 1.0, "seed": 5}
    chat = {"messages": [{"role": "user", "content": text}]}
    cases = [
        ("/v1/completions", {"prompt": text, "n": 3, **sampled}),
        ("/v1/completions", {"prompt": [text, text[:300]], "n": 2, "temperature": 0.8,
                             "seed": 0, "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": [text[:200], text[:400]], "temperature": 0.0}),
        ("/v1/chat/completions", {**chat, "n": 2, **sampled, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {**chat, "n": 2, "temperature": 0.5, "seed": 9}),
    ]
    before = counters(d.base_url)
    num_choices = 0
    with kvbridge_proxy(p.base_url, d.base_url, tmp_path / "proxy.log") as proxy:
        for path, case in cases:
            body = {"model": str(p.spec.model), "max_tokens": NUM_NEW_TOKENS,
                    "ignore_eos": True, "return_token_ids": True, **case}
            want, got = post(p.base_url, path, body), post(proxy, path, body)
            n = case.get("n", 1) * (len(case["prompt"]) if isinstance(case.get("prompt"), list)
                                    else 1)
            num_choices += n
            assert sorted(choices(want)) == list(range(n))
            assert choices(got) == choices(want), (path, case)
            assert usage(got) == usage(want), (path, case)
            if "seed" in case:  # the seed mattered: the choices of one prompt differ
                assert choices(want)[0] != choices(want)[1]
            # nothing left held for nobody (an unread hold's lease is 30 s)
            poll_metrics(p.base_url, lambda m: m.get(HELD_REQUESTS, 1) == 0, timeout_s=15)
        greedy = {"model": str(p.spec.model), "prompt": text, "n": 2, "temperature": 0.0}
        refusals = [post(url, "/v1/completions", greedy, status=400) for url in
                    (p.base_url, proxy)]
    assert [r.json()["error"]["message"] for r in refusals] == [
        "n must be 1 when using greedy sampling, got 2."] * 2
    after = poll_metrics(d.base_url, lambda m: m.get(TRANSFERS, 0) + m.get(FAILURES, 0)
                         >= before[TRANSFERS] + before[FAILURES] + 1)
    # a failed read here is only a synchronous load past its deadline on a loaded or
    # slow host (cancelled and recomputed: the answers above are right)
    num_failed = after.get(FAILURES, 0) - before[FAILURES]
    assert num_failed <= after.get(LATE_SYNC_LOADS, 0) - before[LATE_SYNC_LOADS]
    assert after[TRANSFERS] > before[TRANSFERS]
    assert num_choices == 13
    wait_usage(p.base_url)
    wait_usage(d.base_url)
