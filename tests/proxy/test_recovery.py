"""D failing after P's token in the first-token flow: the rest comes from another
backend, token for token what D would have sent, or the client gets one error.

In-process, against ``fake_vllm.py``'s servers (one "model": a colocated answer
is known exactly, text as vLLM's detokenizer renders it), made to fail as vLLM
does: a 500 (a KV load that failed), vLLM's SSE error event, a connection
refused or broken mid-answer, an answer that is not JSON, several tokens per
event, another model's tokens. Real vLLM: ``tests/integrations/vllm/test_proxy_xpyd.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.proxy.fake_vllm import (
    LEAD,
    SPLIT,
    TRAIL,
    Server,
    always,
    answer_of,
    ask_all,
    colocated,
    events,
    text_of,
    with_params,
    without_params,
)

PROMPT = [5, 17, 3, 40, 8]
MAX_TOKENS = 8
BASE = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}
#: Its answer: t1, 97, 98, then SPLIT and "é" in two tokens (LEAD, TRAIL), then more.
SPLIT_LATER = [7, 2, 41]
RESENT = 'kvbridge_proxy_continuations_resent_total{role="%s"}'
UNFINISHED = "kvbridge_proxy_continuations_unfinished_total"


def resent(metrics: dict[str, float]) -> tuple[float, float, float]:
    """(copies sent again to a D, to a P, answers left unfinished)."""
    return metrics[RESENT % "decode"], metrics[RESENT % "prefill"], metrics[UNFINISHED]


def d_failing(kind: str) -> Server:
    return {
        "load": Server("d", fail_if=with_params),  # its KV load failed: vLLM's 500
        "500": Server("d", fail_if=always),
        "error": Server("d", error_after=0),  # vLLM's error event, before any token
        "garbage": Server("d", garbage=True),
        "gone": Server("d", gone=True),  # died after P's token: connections refused
    }[kind]


@pytest.mark.parametrize("kind, stream", [
    (kind, stream) for kind in ("load", "500", "garbage", "gone") for stream in (False, True)
] + [("error", True)])
def test_d_failing_before_its_tokens_gives_colocateds_answer_from_d_again_or_p(
        kind: str, stream: bool) -> None:
    p, d = Server("p"), d_failing(kind)
    [response], metrics = ask_all([{**BASE, "stream": stream}], [p], [d])
    want = colocated(PROMPT, MAX_TOKENS)
    assert answer_of(response, stream) == (want, text_of(want, PROMPT))
    if stream:
        assert not any("error" in e for e in events(response))
    continuation = {**BASE, "stream": stream, "prompt": [*PROMPT, want[0]],
                    "max_tokens": MAX_TOKENS - 1}
    d_bodies = [{k: v for k, v in b.items() if k != "kv_transfer_params"} for b in d.bodies]
    if kind == "load":  # D computes the prompt itself, without P's params
        assert d_bodies == [continuation, continuation]
        assert "kv_transfer_params" in d.bodies[0] and "kv_transfer_params" not in d.bodies[1]
        assert (len(p.bodies), resent(metrics)) == (1, (1, 0, 0))
    else:  # D fails again: P continues
        assert d_bodies == ([] if kind == "gone" else [continuation, continuation])
        assert p.bodies[1] == continuation
        assert (len(p.bodies), resent(metrics)) == (2, (1, 1, 0))


def test_another_d_gets_the_rest_when_one_fails() -> None:
    p, d1, d2 = Server("p"), Server("d1", fail_if=with_params), Server("d2")
    bodies = [{**BASE, "prompt": [4, i + 2], "stream": i % 2 == 1} for i in range(4)]
    responses, metrics = ask_all(bodies, [p], [d1, d2])
    for body, response in zip(bodies, responses, strict=True):
        want = colocated(body["prompt"], MAX_TOKENS)
        assert answer_of(response, body["stream"]) == (want, text_of(want, body["prompt"]))
    # every request d1 got failed (it had P's params); each went again to d2, not d1
    num_failed = len(d1.bodies)
    assert num_failed >= 1 and all("kv_transfer_params" in b for b in d1.bodies)
    assert [("kv_transfer_params" in b) for b in d2.bodies].count(False) == num_failed
    assert len(d2.bodies) == 4 and resent(metrics) == (num_failed, 0, 0)


def test_a_stream_broken_mid_answer_continues_after_the_tokens_sent() -> None:
    p, d1, d2 = Server("p"), Server("d1", break_after=2), Server("d2")
    body = {**BASE, "stream": True, "stream_options": {"include_usage": True}}
    [response], metrics = ask_all([body], [p], [d1, d2])
    want = colocated(PROMPT, MAX_TOKENS)
    assert answer_of(response, True) == (want, text_of(want, PROMPT))  # no token twice
    [again] = d2.bodies  # after P's token and d1's two
    assert (again["prompt"], again["max_tokens"]) == ([*PROMPT, *want[:3]], MAX_TOKENS - 3)
    assert "kv_transfer_params" not in again
    # d2's usage counts its prompt's last three tokens as the client's output
    assert [e["usage"] for e in events(response) if e.get("usage")] == [
        {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}]
    assert resent(metrics) == (1, 0, 0)


@pytest.mark.parametrize("per_event", [1, 2])
def test_a_break_inside_a_character_resumes_from_the_last_whole_token(per_event: int) -> None:
    """d1 breaks right after LEAD (half of "é", shown as ""). One token per event: the
    client's text is whole after SPLIT, d2 starts there and sends LEAD again (checked,
    not shown). Two per event: an event tells nothing of where its text ends, so d2
    starts after P's token and every token the client holds comes again, checked."""
    want = colocated(SPLIT_LATER, MAX_TOKENS)
    assert want[3:6] == [SPLIT, LEAD, TRAIL]
    p, d2 = Server("p"), Server("d2")
    d1 = Server("d1", per_event=per_event, break_after=4 // per_event)  # after t2..t5
    [response], metrics = ask_all([{**BASE, "prompt": SPLIT_LATER, "stream": True}], [p],
                                  [d1, d2])
    assert answer_of(response, True) == (want, text_of(want, SPLIT_LATER))
    [again] = d2.bodies
    num_done = 4 if per_event == 1 else 1
    assert again["prompt"] == [*SPLIT_LATER, *want[:num_done]]
    assert resent(metrics) == (1, 0, 0)


def test_a_sampled_answer_broken_inside_a_character_ends_with_one_error() -> None:
    """Sampled, the tokens after the last whole one would not come again: no backend
    may continue (the text would differ), so the client gets an error, once."""
    p, d1, d2 = Server("p"), Server("d1", per_event=2, break_after=2), Server("d2")
    body = {**BASE, "prompt": SPLIT_LATER, "stream": True, "temperature": 0.7}
    [response], metrics = ask_all([body], [p], [d1, d2])
    got = events(response)
    assert "ends inside a character and is sampled" in got[-1]["error"]["message"]
    assert [t for e in got[:-1] for c in e["choices"] for t in c["token_ids"]] == \
        colocated(SPLIT_LATER, 5)
    assert d2.bodies == [] and resent(metrics) == (0, 0, 1)


def test_a_copy_whose_tokens_differ_is_never_sent_on() -> None:
    """d2 serves another model: the tokens it sends again differ from those the client
    holds, so its stream is dropped and P continues."""
    p, d1 = Server("p"), Server("d1", per_event=2, break_after=2)
    d2 = Server("d2", shift=1)
    [response], metrics = ask_all([{**BASE, "stream": True}], [p], [d1, d2])
    want = colocated(PROMPT, MAX_TOKENS)
    assert answer_of(response, True) == (want, text_of(want, PROMPT))
    assert p.bodies[1]["prompt"] == [*PROMPT, want[0]]
    assert resent(metrics) == (1, 1, 0)


def test_a_break_after_the_last_token_ends_the_answer_without_asking_again() -> None:
    p, d = Server("p"), Server("d", break_after=MAX_TOKENS - 1)  # every token sent
    body = {**BASE, "stream": True, "stream_options": {"include_usage": True}}
    [response], metrics = ask_all([body], [p], [d])
    want = colocated(PROMPT, MAX_TOKENS)
    assert answer_of(response, True) == (want, text_of(want, PROMPT))
    assert events(response)[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 8,
                                             "total_tokens": 13}
    assert (len(d.bodies), len(p.bodies), resent(metrics)) == (1, 1, (0, 0, 0))


@pytest.mark.parametrize("stream", [False, True])
def test_the_client_gets_one_error_when_no_backend_can_continue(stream: bool) -> None:
    p = Server("p", fail_if=without_params)  # prefills, but fails a continuation
    d = Server("d", fail_if=always)
    [response], metrics = ask_all([{**BASE, "stream": stream}], [p], [d])
    words = "after P's first token no backend could give the rest of the answer"
    if stream:
        got = events(response)
        assert got[0]["choices"][0]["token_ids"] == colocated(PROMPT, 1)
        assert words in got[-1]["error"]["message"] and len(got) == 2
    else:
        assert response.status_code == 502 and words in response.json()["error"]["message"]
    message = response.text
    assert "decode http://d/v1/completions answered 500" in message
    assert "prefill http://p/v1/completions answered 500" in message
    assert resent(metrics) == (1, 1, 1)


def test_a_stream_not_asking_for_token_ids_continues_after_the_tokens_sent() -> None:
    """D is asked for its token ids anyway: without them the proxy would not know
    where the client's answer ends. The client gets them, as it gets P's token's."""
    p, d1, d2 = Server("p"), Server("d1", break_after=2), Server("d2")
    body: dict[str, Any] = {**BASE, "stream": True, "return_token_ids": False}
    [response], metrics = ask_all([body], [p], [d1, d2])
    want = colocated(PROMPT, MAX_TOKENS)
    assert answer_of(response, True) == (want, text_of(want, PROMPT))
    assert all(c.get("prompt_token_ids") is None for e in events(response) for c in e["choices"])
    assert all(b["return_token_ids"] is True for b in d1.bodies + d2.bodies)
    assert d2.bodies[0]["prompt"] == [*PROMPT, *want[:3]] and resent(metrics) == (1, 0, 0)
