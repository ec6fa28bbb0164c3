"""``kvbridge proxy`` beyond single completions, in front of real vLLM P and D servers:
chat completions (streamed and not), ``/v1/models``, and several choices (``n``,
several prompts) — each answer equal to the colocated server's, P's KV read by D,
and no grant left held on P.

The servers are test_pd.py's (same specs: the pool keeps one of each), so this
module starts none of its own when run with it; the tiny Llama's tokenizer has
a chat template (``tiny_model.CHAT_TEMPLATE``).
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
    HELD_REQUESTS,
    TRANSFERS,
    counters,
    kvbridge_proxy,
    pd_spec,
    wait_usage,
)
from tests.integrations.vllm.servers import ServersForTest, ServerSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NUM_NEW_TOKENS = 12
_WORDS = "the cache block token prefill decode memory layer head server request model"


@pytest.fixture
def specs(tiny_llama: Path) -> tuple[ServerSpec, ServerSpec, ServerSpec]:
    """Colocated reference, P and D: test_pd.py's ``ref_spec``, ``p_spec`` and ``d_spec``."""
    ref = ServerSpec(tiny_llama, dtype="bfloat16", block_size=BLOCK_SIZE)
    return ref, pd_spec(tiny_llama, "p"), pd_spec(tiny_llama, "d")


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """One request; a stream is read whole (checked to end with one ``[DONE]``)."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as response:
        response.read()
    assert response.status_code == 200, response.text[:2000]
    if body.get("stream"):
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
        piece = (c.get("delta") or c.get("message") or {}).get("content") if (
            "delta" in c or "message" in c) else c.get("text")
        got[c["index"]] = (tokens + (c.get("token_ids") or []), text + (piece or ""))
    return got


def usage(response: httpx.Response) -> dict[str, Any]:
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response.json()["usage"]  # type: ignore[no-any-return]
    [found] = [json.loads(e.removeprefix("data: "))["usage"] for e in response.text.split("\n\n")
               if e.startswith("data: {") and '"usage":{' in e.replace(" ", "")]
    return found  # type: ignore[no-any-return]


def counts(u: dict[str, Any]) -> tuple[int, int, int]:
    return u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]


def test_chat_and_models_through_kvbridge_proxy_equal_colocated(
    vllm_servers: ServersForTest,
    specs: tuple[ServerSpec, ServerSpec, ServerSpec],
    tmp_path: Path,
) -> None:
    """A chat of about three blocks, streamed and not: the answer (text, tokens,
    usage) is colocated vLLM's, and D loaded the prompt's KV from P each time."""
    ref, p, d = vllm_servers.shared_all(*specs)
    words = _WORDS.split()
    user = {"role": "user", "content": " ".join(words[i % len(words)] for i in range(300))}
    body = {"model": str(p.spec.model), "max_tokens": NUM_NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    requests = [  # two prompts: the second would find the first's blocks in D's cache
        {**body, "messages": [{"role": "system", "content": "Answer in tokens."}, user]},
        {**body, "messages": [{"role": "system", "content": "Stream it."}, user],
         "stream": True, "stream_options": {"include_usage": True}},
    ]
    wanted = [post(ref.base_url, "/v1/chat/completions", r) for r in requests]
    for want in wanted:
        [(want_tokens, want_text)] = choices(want).values()
        assert len(want_tokens) == NUM_NEW_TOKENS and want_text
        assert usage(want)["prompt_tokens"] > 2 * BLOCK_SIZE
    before = counters(d.base_url)
    with kvbridge_proxy(p.base_url, d.base_url, tmp_path / "proxy.log") as proxy:
        for request, want in zip(requests, wanted, strict=True):
            got = post(proxy, "/v1/chat/completions", request)
            assert choices(got) == choices(want), request.get("stream")
            assert counts(usage(got)) == counts(usage(want))
        models, d_models = httpx.get(f"{proxy}/v1/models"), httpx.get(f"{d.base_url}/v1/models")
    after = poll_metrics(d.base_url, lambda m: m.get(TRANSFERS, 0) >= before[TRANSFERS] + 2)
    assert after[TRANSFERS] == before[TRANSFERS] + 2
    # the classic flow: D computes the last prompt token itself and loads the rest
    hits = after[EXTERNAL_PREFIX_CACHE_HITS] - before[EXTERNAL_PREFIX_CACHE_HITS]
    assert hits == sum(usage(want)["prompt_tokens"] - 1 for want in wanted)
    assert models.status_code == 200

    def model_ids(answer: httpx.Response) -> list[tuple[str, str, int]]:
        return [(m["id"], m["root"], m["max_model_len"]) for m in answer.json()["data"]]

    assert model_ids(models) == model_ids(d_models) == [
        (str(p.spec.model), str(p.spec.model), d_models.json()["data"][0]["max_model_len"])]
    assert models.json()["object"] == "list"
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_n_choices_and_several_prompts_through_kvbridge_proxy_leave_no_grant_held(
    vllm_servers: ServersForTest,
    specs: tuple[ServerSpec, ServerSpec, ServerSpec],
    tmp_path: Path,
) -> None:
    """``n`` > 1 (sampled with a seed, and greedy), chat and completions, streamed and
    not, and a list of prompts: each choice equals colocated vLLM's of the same index,
    and P's held requests are back to 0 at once (vLLM's P holds one grant per choice
    and returns the params of one: the proxy asks for each choice on its own)."""
    ref, p, d = vllm_servers.shared_all(*specs)
    model = str(p.spec.model)
    text = " ".join(_WORDS.split()[::-1] * 12)
    sampled = {"temperature": 1.0, "seed": 5}
    cases = [
        ("/v1/completions", {"prompt": text, "n": 3, **sampled}),
        ("/v1/completions", {"prompt": [text, text[:150]], "n": 2, "temperature": 0.0,
                             "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "n": 2,
                                  **sampled, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "n": 2,
                                  "temperature": 0.0}),
    ]
    with kvbridge_proxy(p.base_url, d.base_url, tmp_path / "proxy.log") as proxy:
        for path, case in cases:
            body = {"model": model, "max_tokens": NUM_NEW_TOKENS, "ignore_eos": True,
                    "return_token_ids": True, **case}
            want, got = post(ref.base_url, path, body), post(proxy, path, body)
            assert len(choices(want)) == case["n"] * (2 if "prompt" in case and isinstance(
                case["prompt"], list) else 1)
            assert choices(got) == choices(want), (path, case.get("stream"))
            assert counts(usage(got)) == counts(usage(want))
            if "seed" in case:  # the seed did matter: choices differ
                assert len({tuple(t) for t, _ in choices(want).values()}) > 1
            # nothing left held for nobody (each hold's lease is 30 s)
            poll_metrics(p.base_url, lambda m: m.get(HELD_REQUESTS, 1) == 0, timeout_s=15)
    wait_usage(p.base_url)
    wait_usage(d.base_url)
