"""The proxy's chat completions, ``/v1/models``, several choices and bad bodies, in-process.

The fake vLLM here answers ``n`` choices and a completion's several prompts the
way vLLM does: one engine request per choice (choice ``j`` sampled with
``seed + j``), a prefill held under a grant per engine request, and the
``kv_transfer_params`` of one of them returned. The grants live in a ledger P
and D share: each must be read once (by a D request carrying its params), none
twice. The answers through the proxy are compared with the same fake serving
the request on its own (colocated). Real vLLM: ``tests/integrations/vllm/test_proxy_chat.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvbridge.proxy.app import build_proxy_app
from kvbridge.proxy.config import ProxyConfig

T = TypeVar("T")


def next_token(ids: list[int], seed: int | None) -> int:
    """The fake model's pick after ``ids``: greedy without a seed, else seeded."""
    return ((seed or 0) * 1000003 + sum(ids) * 31 + len(ids) * 7) % 97 + 2


def generate(ids: list[int], max_tokens: int, seed: int | None) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(ids + out, seed))
    return out


def render(messages: list[dict[str, Any]]) -> list[int]:
    """The fake chat template: BOS, each message's numbers, then an assistant marker."""
    return [2, *(int(w) for m in messages for w in str(m["content"]).split()), 3]


@dataclass
class Ledger:
    """Grants P issued, and how often a D read each."""

    issued: list[str] = field(default_factory=list)
    reads: dict[str, int] = field(default_factory=dict)

    def unread(self) -> list[str]:
        return [g for g in self.issued if not self.reads.get(g)]

    def read_twice(self) -> list[str]:
        return [g for g, n in self.reads.items() if n > 1]


@dataclass
class Fake:
    """A fake vLLM server (P, D or colocated): completions, chat completions, models."""

    name: str
    ledger: Ledger
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    refuse_connections: bool = False
    refused_seed: int | None = None  # answers 400 to a request with this seed

    def app(self) -> FastAPI:
        app = FastAPI()
        for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
            app.add_api_route(path, self._endpoint(path, chat), methods=["POST"])

        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model",
                                                              "owned_by": self.name}]})

        app.add_api_route("/v1/models", models, methods=["GET"])
        return app

    def _endpoint(self, path: str, chat: bool) -> Callable[[Request], Awaitable[Response]]:
        async def serve(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append((path, body))
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
            if (body.get("min_tokens") or 0) > max_tokens or (
                    body.get("seed") is not None and body.get("seed") == self.refused_seed):
                return JSONResponse({"error": {"message": "min_tokens > max_tokens",
                                               "type": "BadRequestError"}}, 400)
            return self._answer(body, chat, max_tokens)

        return serve

    def _answer(self, body: dict[str, Any], chat: bool, max_tokens: int) -> Response:
        if chat:
            prompts = [render(body["messages"])]
        else:
            prompt = body["prompt"]
            raw = prompt if isinstance(prompt, list) and prompt and not isinstance(
                prompt[0], int) else [prompt]
            prompts = [[int(w) for w in p.split()] if isinstance(p, str) else p for p in raw]
        n, seed = body.get("n") or 1, body.get("seed")
        if n > 1 and body.get("temperature", 1.0) < 1e-5:  # vLLM's refusal
            return JSONResponse({"error": {"message": f"n must be 1 when using greedy "
                                                      f"sampling, got {n}.",
                                           "type": "BadRequestError"}}, 400)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_prefill"):  # every engine request reads the grant
            grant = params["grant"]
            self.ledger.reads[grant] = self.ledger.reads.get(grant, 0) + n * len(prompts)
        outs, kv = [], None
        for ids in prompts:
            for j in range(n):
                outs.append((ids, generate(ids, max_tokens, seed + j if n > 1 and seed is not
                                           None else seed)))
                if params.get("do_remote_decode"):  # held for D, one grant each
                    grant = f"grant-{len(self.ledger.issued)}"
                    self.ledger.issued.append(grant)
                    kv = {"do_remote_prefill": True, "grant": grant}
        usage = {"prompt_tokens": sum(len(ids) for ids in prompts),
                 "completion_tokens": sum(len(out) for _, out in outs)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        head = {"id": f"{self.name}-{len(self.bodies)}", "created": 1, "model": "m",
                "object": "chat.completion" if chat else "text_completion"}
        if body.get("stream"):
            options = body.get("stream_options") or {}
            events = self._events(head, outs, chat, usage if options.get("include_usage")
                                  else None)
            return StreamingResponse(events, media_type="text/event-stream")
        choices = []
        for index, (_, out) in enumerate(outs):
            text = "".join(f"<{t}>" for t in out)
            choice: dict[str, Any] = {"index": index, "finish_reason": "length",
                                      "token_ids": out}
            choice.update({"message": {"role": "assistant", "content": text}} if chat
                          else {"text": text})
            choices.append(choice)
        return JSONResponse({**head, "choices": choices, "usage": usage,
                             "kv_transfer_params": kv})

    @staticmethod
    async def _events(head: dict[str, Any], outs: list[tuple[list[int], list[int]]], chat: bool,
                      usage: dict[str, int] | None) -> AsyncIterator[bytes]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n".encode()

        if chat:
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}}
                         for i in range(len(outs))])
        for step in range(max(len(out) for _, out in outs)):
            for index, (_, out) in enumerate(outs):  # interleaved, as vLLM's
                if step < len(out):
                    text = f"<{out[step]}>"
                    choice: dict[str, Any] = {
                        "index": index, "token_ids": [out[step]],
                        "finish_reason": "length" if step == len(out) - 1 else None}
                    choice.update({"delta": {"content": text}} if chat else {"text": text})
                    yield event([choice])
        if usage is not None:
            yield event([], usage=usage)
        yield b"data: [DONE]\n\n"


class Hosts(httpx.AsyncBaseTransport):
    """Each request to the fake named by its host; a refusing one refuses connections."""

    def __init__(self, fakes: list[Fake]) -> None:
        self._fakes = {f.name: f for f in fakes}
        self._apps = {f.name: httpx.ASGITransport(app=f.app()) for f in fakes}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        fake = self._fakes.get(request.url.host)
        if fake is None or fake.refuse_connections:
            raise httpx.ConnectError("connection refused", request=request)
        return await self._apps[fake.name].handle_async_request(request)


@dataclass
class Deployment:
    """Fakes behind one proxy, and a colocated fake for the expected answers."""

    prefill: list[Fake]
    decode: list[Fake]
    colocated: Fake
    ledger: Ledger


def deployment(num_prefill: int = 1, num_decode: int = 1) -> Deployment:
    ledger = Ledger()
    return Deployment([Fake(f"p{i}", ledger) for i in range(num_prefill)],
                      [Fake(f"d{i}", ledger) for i in range(num_decode)],
                      Fake("c", Ledger()), ledger)


def run(dep: Deployment, scenario: Callable[[httpx.AsyncClient, httpx.AsyncClient],
                                            Awaitable[T]], **config: Any) -> T:
    """``scenario(proxy, colocated)``, each an HTTP client."""
    proxy_config = ProxyConfig(tuple(f"http://{f.name}" for f in dep.prefill),
                               tuple(f"http://{f.name}" for f in dep.decode), **config)

    async def main() -> T:
        app = build_proxy_app(proxy_config, transport=Hosts(dep.prefill + dep.decode))
        async with app.router.lifespan_context(app):
            proxy = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                      base_url="http://proxy", timeout=30)
            colocated = httpx.AsyncClient(transport=Hosts([dep.colocated]),
                                          base_url="http://c", timeout=30)
            async with proxy, colocated:
                return await scenario(proxy, colocated)

    return asyncio.run(main())


def choices_of(response: httpx.Response, stream: bool) -> dict[int, tuple[list[int], str]]:
    """Each choice's (tokens, text) by index, from one JSON answer or from its events."""
    assert response.status_code == 200, response.text
    if stream:
        raw = [e for e in response.text.split("\n\n") if e]
        assert raw[-1] == "data: [DONE]" and raw.count("data: [DONE]") == 1
        parts = [c for e in raw[:-1] for c in json.loads(e.removeprefix("data: "))["choices"]]
    else:
        parts = response.json()["choices"]
    got: dict[int, tuple[list[int], str]] = {}
    for c in parts:
        tokens, text = got.get(c["index"], ([], ""))
        piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
        piece = piece if piece is not None else (c.get("message") or {}).get("content", "")
        got[c["index"]] = (tokens + (c.get("token_ids") or []), text + (piece or ""))
    return got


def usage_of(response: httpx.Response, stream: bool) -> dict[str, int] | None:
    if not stream:
        return response.json().get("usage")  # type: ignore[no-any-return]
    events = [json.loads(e.removeprefix("data: ")) for e in response.text.split("\n\n")
              if e.startswith("data: {")]
    usages = [e["usage"] for e in events if e.get("usage")]
    assert len(usages) <= 1
    return usages[0] if usages else None


CHAT = {"model": "m", "messages": [{"role": "user", "content": "5 17 3"}], "max_tokens": 6}
COMPLETION = {"model": "m", "prompt": [5, 17, 3, 40], "max_tokens": 6}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
BODIES = {"chat": CHAT, "completion": COMPLETION}


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "seed": 11},
                                      {"temperature": 0.7, "seed": 0}])
def test_n_choices_equal_colocated_and_every_grant_is_read_once(
    kind: str, stream: bool, sampling: dict[str, Any]
) -> None:
    dep = deployment(2, 2)
    body = {**BODIES[kind], **sampling, "n": 3, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    path = PATHS[kind]

    async def scenario(proxy: httpx.AsyncClient, colocated: httpx.AsyncClient
                       ) -> tuple[httpx.Response, httpx.Response]:
        return await proxy.post(path, json=body), await colocated.post(path, json=body)

    got, want = run(dep, scenario)
    assert choices_of(got, stream) == choices_of(want, stream)
    assert sorted(choices_of(got, stream)) == [0, 1, 2]
    assert usage_of(got, stream) == usage_of(want, stream)
    # one grant per choice, each read once: none left held on P
    assert len(dep.ledger.issued) == 3
    assert dep.ledger.unread() == [] and dep.ledger.read_twice() == []
    for fake in dep.prefill + dep.decode:  # each call to a backend asks for one choice
        assert all("n" not in b for _, b in fake.bodies)
    if stream:
        ids = {json.loads(e.removeprefix("data: "))["id"] for e in got.text.split("\n\n")
               if e.startswith("data: {")}
        assert len(ids) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_with_n_are_numbered_as_vllm_numbers_them(stream: bool) -> None:
    dep = deployment()
    body = {**COMPLETION, "prompt": ["5 17", "3 40 8"], "n": 2, "seed": 4, "temperature": 1.0,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}

    async def scenario(proxy: httpx.AsyncClient, colocated: httpx.AsyncClient
                       ) -> tuple[httpx.Response, httpx.Response]:
        return (await proxy.post("/v1/completions", json=body),
                await colocated.post("/v1/completions", json=body))

    got, want = run(dep, scenario)
    assert choices_of(got, stream) == choices_of(want, stream)
    assert len(choices_of(got, stream)) == 4
    assert usage_of(got, stream) == usage_of(want, stream) == {
        "prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29}
    assert len(dep.ledger.issued) == 4 and dep.ledger.unread() == []
    assert dep.ledger.read_twice() == []


def test_chat_takes_the_classic_flow_over_the_pools() -> None:
    dep = deployment(2, 2)
    body = {**CHAT, "max_completion_tokens": 5, "min_tokens": 2, "temperature": 0.0,
            "kv_transfer_params": {"grant": "forged"}}

    async def scenario(proxy: httpx.AsyncClient, colocated: httpx.AsyncClient
                       ) -> list[tuple[httpx.Response, httpx.Response]]:
        pairs = []
        for stream in (False, True, False, True):
            pairs.append((await proxy.post(PATHS["chat"], json={**body, "stream": stream}),
                          await colocated.post(PATHS["chat"], json={**body, "stream": stream})))
        return pairs

    for (got, want), stream in zip(run(dep, scenario), (False, True) * 2, strict=True):
        assert choices_of(got, stream) == choices_of(want, stream)
    for fake in dep.prefill:  # P: one token, unary, asked to keep the KV for D
        assert len(fake.bodies) == 2
        for path, p_body in fake.bodies:
            assert path == PATHS["chat"]
            assert (p_body["max_tokens"], p_body["max_completion_tokens"]) == (1, 1)
            assert (p_body["min_tokens"], p_body["stream"]) == (1, False)
            assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    for fake in dep.decode:  # D: the client's request with P's params
        assert len(fake.bodies) == 2
        for path, d_body in fake.bodies:
            assert path == PATHS["chat"] and d_body["max_completion_tokens"] == 5
            assert d_body["kv_transfer_params"]["grant"].startswith("grant-")
    assert dep.ledger.unread() == []


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_d_refusing_a_choice_fails_the_request_and_p_lets_every_grant_go(
    kind: str, stream: bool
) -> None:
    dep = deployment()
    body = {**BODIES[kind], "n": 2, "min_tokens": 9, "stream": stream}  # > max_tokens: D says 400

    async def scenario(proxy: httpx.AsyncClient, _: httpx.AsyncClient) -> httpx.Response:
        return await proxy.post(PATHS[kind], json=body)

    response = run(dep, scenario)  # the proxy's shutdown waits for its background releases
    assert response.status_code == 400 and "min_tokens" in response.text
    assert len(dep.ledger.issued) == 2 and dep.ledger.unread() == []
    releases = [b for _, b in dep.decode[0].bodies if "min_tokens" not in b]
    assert len(releases) == 2 and all(b["max_tokens"] == 1 for b in releases)
    if kind == "chat":
        assert all(b["messages"] == CHAT["messages"] for b in releases)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_one_choice_refused_fails_a_stream_and_the_others_are_closed_unsent(kind: str) -> None:
    dep = deployment()
    dep.decode[0].refused_seed = 8
    body = {**BODIES[kind], "n": 3, "seed": 7, "temperature": 1.0, "stream": True}

    async def scenario(proxy: httpx.AsyncClient, _: httpx.AsyncClient) -> httpx.Response:
        return await proxy.post(PATHS[kind], json=body)

    response = run(dep, scenario)
    assert response.status_code == 400 and "min_tokens > max_tokens" in response.text
    # choices 0 and 2 were read by their D stream (closed unsent), choice 1 released
    assert len(dep.ledger.issued) == 3 and dep.ledger.unread() == []
    assert dep.ledger.read_twice() == []


def test_models_is_a_decodes_answer_and_skips_a_dead_one() -> None:
    dep = deployment(1, 2)
    dep.decode[0].refuse_connections = True

    async def scenario(proxy: httpx.AsyncClient, _: httpx.AsyncClient) -> list[httpx.Response]:
        return [await proxy.get("/v1/models") for _ in range(2)]

    for response in run(dep, scenario):
        assert response.status_code == 200
        assert response.json() == {"object": "list", "data": [
            {"id": "m", "object": "model", "owned_by": "d1"}]}
    assert dep.prefill[0].bodies == []

    for fake in dep.decode:
        fake.refuse_connections = True
    [response] = run(dep, lambda proxy, _: asyncio.gather(proxy.get("/v1/models")))
    assert response.status_code == 503
    assert "no decode backend is usable" in response.json()["error"]["message"]


BAD = [
    (b"{", "invalid JSON"),
    (b"[1]", "must be a JSON object"),
    (b'{"max_tokens": NaN}', "invalid JSON"),
    (b"[" * 5000 + b"]" * 5000, "invalid JSON"),  # nested too deeply
    (b'{"stream": "yes"}', "stream must be true or false"),
    (b'{"max_tokens": "5"}', "max_tokens must be an integer >= 1"),
    (b'{"max_tokens": 2.5}', "max_tokens must be an integer >= 1"),
    (b'{"max_completion_tokens": 0}', "max_completion_tokens must be an integer >= 1"),
    (b'{"n": 0}', "n must be an integer >= 1"),
    (b'{"n": true}', "n must be an integer >= 1"),
    (b'{"n": 65}', "65 choices asked for"),
    (b'{"n": 2, "best_of": 3}', "best_of 3 is not supported"),
    (b'{"n": 2, "temperature": 0}', "n must be 1 when using greedy sampling, got 2."),
    (b'{"best_of": 2}', "best_of 2 is not supported"),
    (b'{"use_beam_search": true}', "use_beam_search is not supported"),
    (b'{"n": 2, "seed": "7"}', "seed must be an integer"),
    (b'{"n": 2, "stream": true, "stream_options": {"continuous_usage_stats": true}}',
     "continuous_usage_stats"),
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_bad_bodies_get_a_typed_4xx_before_any_backend_call_and_the_proxy_serves_on(
    kind: str
) -> None:
    dep = deployment()
    base = json.dumps(BODIES[kind])[:-1].encode()  # a valid body, open for more keys
    bad = [(raw if not raw.startswith(b"{\"") else base + b", " + raw[1:], words)
           for raw, words in BAD]
    if kind == "chat":
        bad.append((b'{"model": "m", "messages": "hi"}', "messages must be a non-empty list"))
    else:
        bad.append((base + b', "prompt": [[1], [2], [3]], "n": 22}', "66 choices asked for"))
        bad.append((base + b', "prompt_embeds": ["a", "b"]}', "2 prompt_embeds"))

    async def scenario(proxy: httpx.AsyncClient, _: httpx.AsyncClient
                       ) -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        answers = [await proxy.post(PATHS[kind], content=raw) for raw, _ in bad]
        huge = await proxy.post(PATHS[kind], content=base + b', "x": "' + b"a" * 20000 + b'"}')
        return answers, huge, await proxy.post(PATHS[kind], json=BODIES[kind])

    answers, huge, good = run(dep, scenario, max_body_nbytes=16384)
    for (raw, words), response in zip(bad, answers, strict=True):
        assert response.status_code == 400, (raw[:60], response.text)
        error = response.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error", raw[:60]
    assert huge.status_code == 413 and "exceeds 16384 bytes" in huge.json()["error"]["message"]
    assert [len(f.bodies) for f in dep.prefill + dep.decode] == [1, 1]  # only the good one
    assert good.status_code == 200 and dep.ledger.unread() == []
