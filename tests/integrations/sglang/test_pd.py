"""kvbridge as SGLang's transfer backend, in real SGLang P/D servers (``servers.SglangSet``).

Every answer of P/D must equal the single server's token for token (greedy): the
first token comes from P's forward, every later one from D decoding over the KV
kvbridge moved, so KV that did not arrive whole changes them.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.servers import PdClient, SglangSet, post_json

PROMPTS = [
    "hello world, this is a test of",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "a",
    "Once upon a time there was a tiny model that " * 12,
]


def _generate_body(prompt: str, num_tokens: int = 16) -> dict[str, Any]:
    return {"text": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": num_tokens, "temperature": 0,
                                "ignore_eos": True}}


def _token_ids(status: int, answer: Any) -> list[int]:
    assert status == 200, f"status {status}: {answer}"
    return [int(entry[1]) for entry in answer["meta_info"]["output_token_logprobs"]]


def _reference(servers: SglangSet, prompt: str) -> list[int]:
    return _token_ids(*post_json(servers.single.url + "/generate", _generate_body(prompt)))


@pytest.mark.parametrize(("prefill", "decode"), [("p1", "d"), ("p2", "d"), ("p1", "d2")])
def test_answers_equal_the_single_server(sglang_set: SglangSet, prefill: str,
                                         decode: str) -> None:
    """P TP 1 -> D TP 1; P TP 2 -> D TP 1 (the D rank reads a head from each P rank);
    P TP 1 -> D TP 2 (each D rank reads its head of the one P rank)."""
    client = PdClient(getattr(sglang_set, prefill), getattr(sglang_set, decode))
    for prompt in PROMPTS:
        expected = _reference(sglang_set, prompt)
        got = _token_ids(*client.generate(_generate_body(prompt)))
        assert got == expected, f"{prefill} -> {decode}: prompt {prompt[:30]!r}"


def test_through_sglang_router(sglang_set: SglangSet) -> None:
    """The Rust sglang-router in P/D mode: completions and chat, as a client sends them."""
    for prompt in PROMPTS[:2]:
        body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        status, answer = post_json(sglang_set.router.url + "/v1/completions", body)
        _, single = post_json(sglang_set.single.url + "/v1/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == single["choices"][0]["text"]
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 12, "temperature": 0}
    status, answer = post_json(sglang_set.router.url + "/v1/chat/completions", chat)
    _, single = post_json(sglang_set.single.url + "/v1/chat/completions", chat)
    assert status == 200, answer
    assert answer["choices"][0]["message"] == single["choices"][0]["message"]


def test_concurrent_requests(sglang_set: SglangSet) -> None:
    """Eight requests at once through P TP 2: every answer still the single server's."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"request {i}: " + PROMPTS[i % len(PROMPTS)] for i in range(8)]
    expected = [_reference(sglang_set, p) for p in prompts]
    client = PdClient(sglang_set.p2, sglang_set.d)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: client.generate(_generate_body(p)), prompts))
    assert [_token_ids(*a) for a in answers] == expected
