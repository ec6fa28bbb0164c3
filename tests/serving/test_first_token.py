"""The proxy's first-token path, in-process, against a fake vLLM P and D sharing one "model".

The fake model is a deterministic next-token function of the whole sequence, so
a colocated greedy answer is known exactly; P and D speak vLLM's completion
format (``return_token_ids``, ``prompt_token_ids`` on the choice, ``usage``,
SSE events) and render text as vLLM's incremental detokenizer does
(:class:`Detokenizer`), down to a character split over two tokens. The real
thing, through real vLLM servers, is in ``tests/integrations/vllm/test_pd.py``.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvbridge.serving import first_token
from kvbridge.serving.proxy import ProxyConfig, build_proxy_app

EOS = 1
SPLIT = 150  # the fake model answers it with "é" in two tokens: LEAD, then TRAIL
LEAD, TRAIL = 200, 201
_BYTES = {LEAD: "é".encode()[:1], TRAIL: "é".encode()[1:]}


def next_token(ids: list[int]) -> int:
    """The fake model's greedy choice after ``ids`` (EOS after a 99, "é" after a SPLIT)."""
    if ids[-1] in (SPLIT, LEAD):
        return LEAD if ids[-1] == SPLIT else TRAIL
    return EOS if ids[-1] == 99 else (sum(ids) * 31 + len(ids)) % 97 + 2


def _ends_inside_a_character(data: bytes) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)
    return bool(decoder.getstate()[0])


class Detokenizer:
    """vLLM's incremental detokenizer (tokenizers' ``DecodeStream``) as measured.

    Primed with the prompt; each token's text is everything not yet shown, or
    nothing while the bytes end inside a character (which it keeps for the
    next token: a request that stops there never shows them). Primed with a
    prompt that ends inside a character, it has shown none of the prompt, so
    the token that completes the character brings the prompt's text with it.
    """

    def __init__(self, prompt: list[int]) -> None:
        self._bytes = b"".join(map(token_bytes, prompt))
        self._shown = 0 if _ends_inside_a_character(self._bytes) else len(self._bytes)

    def step(self, token: int) -> str:
        self._bytes += token_bytes(token)
        if _ends_inside_a_character(self._bytes):
            return ""
        text = self._bytes[self._shown:].decode("utf-8", "replace")
        self._shown = len(self._bytes)
        return text


def colocated(prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
        if out[-1] == EOS:
            break
    return out


def token_bytes(token: int) -> bytes:
    return _BYTES.get(token) or f"<{token}>".encode()


def text_of(ids: list[int], prompt: list[int] | None = None) -> str:
    """The text of an answer ``ids`` to ``prompt``, as a colocated server shows it."""
    detokenizer = Detokenizer(prompt or [])
    return "".join(detokenizer.step(t) for t in ids)


@dataclass
class Server:
    """A fake vLLM server (P or D) that records the bodies it got."""

    name: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    fail: bool = False
    short: bool = False  # as P: stops one token short of the prompt (a recurrent state)

    def app(self) -> FastAPI:
        app = FastAPI()

        async def completions(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            if self.fail:
                return JSONResponse({"error": {"message": "boom", "type": "x"}}, 500)
            prompt = body["prompt"]
            ids = [int(c) for c in prompt.split()] if isinstance(prompt, str) else prompt
            params = body.get("kv_transfer_params") or {}
            short = self.short and params.get("do_remote_decode")
            out = colocated(ids[:-1] if short else ids, body["max_tokens"])
            wants = bool(body.get("return_token_ids"))
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                     "total_tokens": len(ids) + len(out)}
            reason = "stop" if out[-1] == EOS else "length"
            kv = ({"do_remote_prefill": True, "remote_num_tokens": len(ids) - bool(short),
                   "grant": "g" * 16}
                  if params.get("do_remote_decode") else None)
            if body.get("stream"):
                return StreamingResponse(self._events(ids, out, wants, usage, reason),
                                         media_type="text/event-stream")
            choice = {"index": 0, "text": text_of(out, ids), "finish_reason": reason,
                      "token_ids": out if wants else None,
                      "prompt_token_ids": ids if wants else None}
            return JSONResponse({"id": f"cmpl-{self.name}", "created": 1, "model": "m",
                                 "object": "text_completion", "choices": [choice],
                                 "usage": usage, "kv_transfer_params": kv})

        app.add_api_route("/v1/completions", completions, methods=["POST"])
        return app

    async def _events(self, ids: list[int], out: list[int], wants: bool,
                      usage: dict[str, int], reason: str) -> AsyncIterator[bytes]:
        detokenizer = Detokenizer(ids)
        for i, token in enumerate(out):
            choice: dict[str, Any] = {"index": 0, "text": detokenizer.step(token),
                                      "finish_reason": reason if i == len(out) - 1 else None}
            if wants:
                choice["token_ids"] = [token]
                if i == 0:
                    choice["prompt_token_ids"] = ids
            event = {"id": f"cmpl-{self.name}", "created": 1, "model": "m", "choices": [choice]}
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


class Hosts(httpx.AsyncBaseTransport):
    def __init__(self, servers: list[Server]) -> None:
        self._apps = {s.name: httpx.ASGITransport(app=s.app()) for s in servers}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._apps[request.url.host].handle_async_request(request)


def ask(body: dict[str, Any], *, d_fails: bool = False, first: bool = True,
        p_short: bool = False) -> tuple[httpx.Response, Server, Server]:
    [response], p, d = ask_at_once([body], d_fails=d_fails, first=first, p_short=p_short)
    return response, p, d


def ask_at_once(bodies: list[dict[str, Any]], *, d_fails: bool = False, first: bool = True,
                p_short: bool = False) -> tuple[list[httpx.Response], Server, Server]:
    """Send every body to one proxy at the same time; the answers in the bodies' order."""
    p, d = Server("p", short=p_short), Server("d", fail=d_fails)
    config = ProxyConfig(("http://p",), ("http://d",), first_token=first)

    async def main() -> list[httpx.Response]:
        app = build_proxy_app(config, transport=Hosts([p, d]))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:

                async def one(body: dict[str, Any]) -> httpx.Response:
                    response = await client.post("/v1/completions", json=body, timeout=30)
                    await response.aread()
                    return response

                return list(await asyncio.gather(*map(one, bodies)))

    return asyncio.run(main()), p, d


def events(response: httpx.Response) -> list[dict[str, Any]]:
    raw = [e for e in response.text.split("\n\n") if e]
    assert raw[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in raw[:-1]]


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


def test_a_decode_failing_after_ps_token_ends_the_stream_with_an_error() -> None:
    response, _, _ = ask({**BASE, "stream": True}, d_fails=True)
    got = events(response)
    assert got[0]["choices"][0]["token_ids"] == [colocated(PROMPT, 1)[0]]
    assert "error" in got[-1] and "502" not in response.text.split("\n")[0]


def answer_of(response: httpx.Response, stream: bool) -> tuple[list[int], str]:
    """The client's tokens and text, from one JSON answer or from its events."""
    assert response.status_code == 200, response.text
    choices = ([c for e in events(response) for c in e["choices"]] if stream
               else response.json()["choices"])
    tokens = [t for c in choices for t in c.get("token_ids") or []]
    return tokens, "".join(c["text"] for c in choices)


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
