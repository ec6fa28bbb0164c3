"""The proxy's first-token path, in-process, against a fake vLLM P and D sharing one "model"
(``fake_vllm.py``: a colocated greedy answer is known exactly, text rendered as
vLLM's incremental detokenizer does). D failing after P's token:
``test_recovery.py``. The real thing, through real vLLM servers, is in
``tests/integrations/vllm/test_pd.py``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvbridge.proxy import first_token
from tests.proxy.fake_vllm import (
    EOS,
    LEAD,
    SPLIT,
    TRAIL,
    Detokenizer,
    Server,
    always,
    answer_of,
    ask_all,
    colocated,
    events,
    text_of,
)


def ask(body: dict[str, Any], *, d_fails: bool = False, first: bool = True,
        p_short: bool = False) -> tuple[httpx.Response, Server, Server]:
    [response], p, d = ask_at_once([body], d_fails=d_fails, first=first, p_short=p_short)
    return response, p, d


def ask_at_once(bodies: list[dict[str, Any]], *, d_fails: bool = False, first: bool = True,
                p_short: bool = False) -> tuple[list[httpx.Response], Server, Server]:
    """Send every body to one proxy at the same time; the answers in the bodies' order."""
    p = Server("p", short=p_short)
    d = Server("d", fail_if=always) if d_fails else Server("d")
    responses, _ = ask_all(bodies, [p], [d], first_token=first)
    return responses, p, d


PROMPT = [5, 17, 3, 40, 8]
BASE = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}


def test_the_answer_equals_colocated_and_d_continues_after_ps_token() -> None:
    response, p, d = ask(BASE)
    want = colocated(PROMPT, 6)
    answer = response.json()
    choice = answer["choices"][0]
    assert (choice["token_ids"], choice["text"]) == (want, text_of(want))
    assert choice["prompt_token_ids"] == PROMPT
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] is None
    [p_body], [d_body] = p.bodies, d.bodies
    assert (p_body["max_tokens"], p_body["return_token_ids"]) == (1, True)
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "first_token_flow": True}
    assert d_body["prompt"] == [*PROMPT, want[0]] and d_body["max_tokens"] == 5
    assert d_body["kv_transfer_params"]["remote_num_tokens"] == len(PROMPT)


@pytest.mark.parametrize("stream", [False, True])
def test_a_p_that_stopped_short_of_the_prompt_gets_the_classic_flow(stream: bool) -> None:
    # a P that stops one token short for a recurrent state (vLLM's NixlConnector):
    # its token follows the prompt without its last token
    response, p, d = ask({**BASE, "stream": stream}, p_short=True)
    want = colocated(PROMPT, 6)
    assert colocated(PROMPT[:-1], 1) != want[:1]  # P's token would be wrong
    if stream:
        got = [t for e in events(response) for c in e["choices"] for t in c.get("token_ids") or []]
    else:
        got = response.json()["choices"][0]["token_ids"]
    assert got == want
    [d_body] = d.bodies
    assert d_body["prompt"] == PROMPT and d_body["max_tokens"] == 6
    assert d_body["kv_transfer_params"]["remote_num_tokens"] == len(PROMPT) - 1


def test_a_stream_starts_with_ps_token_and_counts_it_as_output() -> None:
    body = {**BASE, "stream": True, "stream_options": {"include_usage": True}}
    response, p, d = ask(body)
    got = events(response)
    want = colocated(PROMPT, 6)
    assert got[0]["choices"][0]["token_ids"] == [want[0]]
    assert got[0]["choices"][0]["prompt_token_ids"] == PROMPT
    tokens = [t for e in got for c in e["choices"] for t in c.get("token_ids") or []]
    assert tokens == want
    assert "".join(c["text"] for e in got for c in e["choices"]) == text_of(want)
    # D's first event named its prompt (with P's token): the client sees its own
    assert [c["prompt_token_ids"] for e in got for c in e["choices"]
            if c.get("prompt_token_ids")] == [PROMPT, PROMPT]
    assert got[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert {e["id"] for e in got} == {"cmpl-p"}
    assert "stream_options" not in p.bodies[0] and p.bodies[0]["stream"] is False


def test_tokens_not_asked_for_are_not_returned() -> None:
    body = {k: v for k, v in BASE.items() if k != "return_token_ids"}
    response, p, _ = ask(body)
    choice = response.json()["choices"][0]
    assert choice["text"] == text_of(colocated(PROMPT, 6))
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None  # as D gave
    assert p.bodies[0]["return_token_ids"] is True  # the proxy needs them from P


@pytest.mark.parametrize("stream", [False, True])
def test_ps_token_ending_the_request_is_the_answer_and_d_still_frees_p(stream: bool) -> None:
    prompt = [4, 99]  # the fake model's EOS comes next
    body = {**BASE, "prompt": prompt, "ignore_eos": False, "stream": stream}
    response, _, d = ask(body)
    if stream:
        [event] = events(response)
        choice = event["choices"][0]
    else:
        choice = response.json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"]) == ([EOS], "stop")
    # D was asked (in the background) for one token, with P's params: P's blocks go back
    [release] = d.bodies
    assert release["max_tokens"] == 1 and release["kv_transfer_params"]["grant"] == "g" * 16


@pytest.mark.parametrize("extra", [
    {"stop": ["<5>"]}, {"logprobs": 1}, {"n": 2}, {"echo": True}, {"presence_penalty": 0.5},
    {"temperature": 0.8, "seed": 3}, {"response_format": {"type": "json_object"}},
    {"max_tokens": 1}, {"prompt": [[1, 2], [3]]},
    {"skip_special_tokens": False, "spaces_between_special_tokens": False},
])
def test_requests_that_could_depend_on_where_t1_is_sampled_take_the_classic_flow(
    extra: dict[str, Any]
) -> None:
    body = {**BASE, **extra}
    assert not first_token.plan(body)
    assert first_token.plan(BASE) and first_token.plan({**BASE, "temperature": 0.8})


def test_classic_flow_when_disabled_or_when_p_gives_no_token_ids() -> None:
    response, _, d = ask(BASE, first=False)
    assert d.bodies[0]["prompt"] == PROMPT and d.bodies[0]["max_tokens"] == 6
    assert response.json()["choices"][0]["token_ids"] == colocated(PROMPT, 6)
    no_ids = first_token.take({"choices": [{"text": "x", "token_ids": None}]})
    assert no_ids is None
    whole = {"text": "x", "token_ids": [7], "prompt_token_ids": [1, 2]}
    assert first_token.take({"choices": [whole]}) is not None
    # a character split over P's token and the next: only D decoding both gets it right
    half = {**whole, "text": "\ufffd"}
    assert first_token.take({"choices": [half]}) is None


SPLIT_PROMPT = [5, 17, SPLIT]


@pytest.mark.parametrize("stream", [False, True])
def test_a_first_token_inside_a_character_takes_the_classic_flow(stream: bool) -> None:
    """P shows t1 as "" (its bytes wait for t2); D primed with prompt + t1 would show
    the prompt's text in front of "é". The client gets colocated's answer instead."""
    want = colocated(SPLIT_PROMPT, 6)
    assert want[:2] == [LEAD, TRAIL]
    assert text_of(want[:1], SPLIT_PROMPT) == ""  # what P answers
    assert Detokenizer([*SPLIT_PROMPT, LEAD]).step(TRAIL) == "<5><17><150>é"  # D, so primed
    response, p, d = ask({**BASE, "prompt": SPLIT_PROMPT, "stream": stream})
    tokens, text = answer_of(response, stream)
    assert (tokens, text) == (want, text_of(want, SPLIT_PROMPT))
    assert text.startswith("é<")
    [p_body], [d_body] = p.bodies, d.bodies
    assert p_body["max_tokens"] == 1
    # D samples t1 again after the prompt P gave it, and renders t1 and t2 together
    assert (d_body["prompt"], d_body["max_tokens"]) == (SPLIT_PROMPT, 6)
    assert d_body["kv_transfer_params"]["remote_num_tokens"] == len(SPLIT_PROMPT)


def test_ps_token_is_taken_only_with_a_whole_text_unless_it_ended_the_request() -> None:
    whole = {"text": "x", "token_ids": [7], "prompt_token_ids": [1, 2], "finish_reason": "length"}
    assert first_token.take({"choices": [whole]}) is not None
    for text in ("", "\ufffd", "a\ufffd"):
        assert first_token.take({"choices": [{**whole, "text": text}]}) is None, text
    # P's token ended the request: P's answer is the client's, as colocated gives it
    for text in ("", "\ufffd", "x"):
        first = first_token.take({"choices": [{**whole, "text": text, "finish_reason": "stop"}]})
        assert first is not None and first.finished and first.text == text


@pytest.mark.parametrize("stream", [False, True])
def test_requests_at_once_each_get_colocateds_answer(stream: bool) -> None:
    """As the issue found it: several requests at once, some of whose first
    tokens are half a character; each answer is colocated's, text and tokens."""
    prompts = [[5, 17, SPLIT], PROMPT, [9, SPLIT], [3, 3, 3], [40, 41, 42, SPLIT], [4, 99]]
    bodies = [{**BASE, "prompt": prompt, "ignore_eos": False, "stream": stream}
              for prompt in prompts]
    responses, _, d = ask_at_once(bodies)
    for prompt, response in zip(prompts, responses, strict=True):
        want = colocated(prompt, 6)
        assert answer_of(response, stream) == (want, text_of(want, prompt)), prompt
    # only those went the classic way (D asked for the client's prompt and all 6 tokens)
    classic = [b["prompt"] for b in d.bodies if b["prompt"] in prompts]
    assert sorted(classic) == sorted(p for p in prompts if p[-1] == SPLIT)
    assert {b["max_tokens"] for b in d.bodies if b["prompt"] in prompts} == {6}
