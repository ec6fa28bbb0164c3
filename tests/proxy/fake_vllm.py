"""A fake vLLM completions server for the proxy's in-process tests, and its "model".

The model is a deterministic next-token function of the whole sequence, so a
colocated greedy answer is known exactly. A :class:`Server` speaks vLLM's
completion format (``return_token_ids``, ``prompt_token_ids`` on the choice,
``usage``, SSE events, ``kv_transfer_params`` for a P) and renders text as
vLLM's incremental detokenizer does (:class:`Detokenizer`), down to a character
split over two tokens. It can fail as a real one does: a 500 (e.g. for a KV
load that failed), a connection refused or broken mid-stream, vLLM's error
event, an answer that is not JSON, several tokens per event (vLLM merges the
deltas of a client that lags), another model's tokens. :class:`Hosts` routes a
proxy's backend calls to them by host name, streams as they are produced.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvbridge.proxy.app import build_proxy_app
from kvbridge.proxy.config import ProxyConfig

EOS = 1
SPLIT = 150  # the fake model answers it with "é" in two tokens: LEAD, then TRAIL
LEAD, TRAIL = 200, 201
_BYTES = {LEAD: "é".encode()[:1], TRAIL: "é".encode()[1:]}


def next_token(ids: list[int]) -> int:
    """The fake model's greedy choice after ``ids`` (EOS after a 99, "é" after a SPLIT,
    which comes after a 98)."""
    if ids[-1] in (SPLIT, LEAD, 98):
        return {SPLIT: LEAD, LEAD: TRAIL, 98: SPLIT}[ids[-1]]
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


def never(_: dict[str, Any]) -> bool:
    return False


def always(_: dict[str, Any]) -> bool:
    return True


def with_params(body: dict[str, Any]) -> bool:
    """A D request carrying P's params (its KV load is what fails)."""
    return bool((body.get("kv_transfer_params") or {}).get("do_remote_prefill"))


def without_params(body: dict[str, Any]) -> bool:
    """A request without any params (not a prefill for D, not a decode after P)."""
    return not body.get("kv_transfer_params")


@dataclass
class Server:
    """A fake vLLM server (P or D) that records the bodies it got.

    Attributes:
        fail_if: answer 500 to the requests it picks.
        short: as P, stop one token short of the prompt (a recurrent state).
        break_after: a stream's connection breaks after this many token events.
        error_after: a stream sends vLLM's error event after this many token events.
        per_event: tokens per stream event.
        garbage: answer 200 with a body that is not JSON.
        gone: refuse connections.
        shift: another model: every token but EOS this much higher.
    """

    name: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    fail_if: Callable[[dict[str, Any]], bool] = never
    short: bool = False
    break_after: int | None = None
    error_after: int | None = None
    per_event: int = 1
    garbage: bool = False
    gone: bool = False
    shift: int = 0

    def respond(self, body: dict[str, Any]) -> httpx.Response:
        self.bodies.append(body)
        if self.garbage:
            return httpx.Response(200, text="<html>upstream hiccup</html>")
        if self.fail_if(body):
            return httpx.Response(500, json={"error": {"message": "boom", "type": "x"}})
        prompt = body["prompt"]
        ids = [int(c) for c in prompt.split()] if isinstance(prompt, str) else prompt
        params = body.get("kv_transfer_params") or {}
        short = self.short and params.get("do_remote_decode")
        out = [t if t == EOS else t + self.shift
               for t in colocated(ids[:-1] if short else ids, body["max_tokens"])]
        wants = bool(body.get("return_token_ids"))
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                 "total_tokens": len(ids) + len(out)}
        reason = "stop" if out[-1] == EOS else "length"
        kv = ({"do_remote_prefill": True, "remote_num_tokens": len(ids) - bool(short),
               "grant": "g" * 16}
              if params.get("do_remote_decode") else None)
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_LiveStream(self._events(ids, out, wants, usage,
                                                                  reason)))
        choice = {"index": 0, "text": text_of(out, ids), "finish_reason": reason,
                  "token_ids": out if wants else None,
                  "prompt_token_ids": ids if wants else None}
        return httpx.Response(200, json={"id": f"cmpl-{self.name}", "created": 1, "model": "m",
                                         "object": "text_completion", "choices": [choice],
                                         "usage": usage, "kv_transfer_params": kv})

    async def _events(self, ids: list[int], out: list[int], wants: bool,
                      usage: dict[str, int], reason: str) -> AsyncIterator[bytes]:
        detokenizer = Detokenizer(ids)
        groups = [out[i:i + self.per_event] for i in range(0, len(out), self.per_event)]
        for k, group in enumerate(groups):
            await asyncio.sleep(0)  # the proxy relays each event as it comes
            if k == self.break_after:
                raise httpx.ReadError("connection reset by peer")
            if k == self.error_after:
                error = {"error": {"message": "KV load failed", "type": "InternalServerError",
                                   "code": 500}}
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
                return
            choice: dict[str, Any] = {
                "index": 0, "text": "".join(detokenizer.step(t) for t in group),
                "finish_reason": reason if k == len(groups) - 1 else None,
                "prompt_token_ids": ids if wants and k == 0 else None,
                "token_ids": group if wants else None}
            event = {"id": f"cmpl-{self.name}", "created": 1, "model": "m", "choices": [choice]}
            yield f"data: {json.dumps(event)}\n\n".encode()
        if self.break_after == len(groups):  # after the last token, before the end
            raise httpx.ReadError("connection reset by peer")
        yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


class _LiveStream(httpx.AsyncByteStream):
    """A response body read as it is produced (it may break on the way)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk


class Hosts(httpx.AsyncBaseTransport):
    """Sends each request to the server named by its host; unknown or gone hosts refuse."""

    def __init__(self, servers: list[Server]) -> None:
        self._servers = {s.name: s for s in servers}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        server = self._servers.get(request.url.host)
        if server is None or server.gone:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return server.respond(json.loads(await request.aread()))


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """A stream's events, checked to end with one ``[DONE]``."""
    raw = [e for e in response.text.split("\n\n") if e]
    assert raw[-1] == "data: [DONE]" and raw.count("data: [DONE]") == 1, raw[-3:]
    return [json.loads(e.removeprefix("data: ")) for e in raw[:-1]]


def answer_of(response: httpx.Response, stream: bool) -> tuple[list[int], str]:
    """The client's tokens and text, from one JSON answer or from its events."""
    assert response.status_code == 200, response.text
    choices = ([c for e in events(response) for c in e["choices"]] if stream
               else response.json()["choices"])
    tokens = [t for c in choices for t in c.get("token_ids") or []]
    return tokens, "".join(c["text"] for c in choices)


def ask_all(bodies: list[dict[str, Any]], prefill: list[Server], decode: list[Server],
            **config: Any) -> tuple[list[httpx.Response], dict[str, float]]:
    """Send every body to one proxy in front of ``prefill`` and ``decode`` at the same time.

    Returns:
        The answers in the bodies' order (read whole), and the proxy's ``/metrics``
        after them (sample name with labels -> value).
    """
    proxy_config = ProxyConfig(tuple(f"http://{s.name}" for s in prefill),
                               tuple(f"http://{s.name}" for s in decode), **config)

    async def main() -> tuple[list[httpx.Response], dict[str, float]]:
        app = build_proxy_app(proxy_config, transport=Hosts(prefill + decode))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:

                async def one(body: dict[str, Any]) -> httpx.Response:
                    response = await client.post("/v1/completions", json=body, timeout=30)
                    await response.aread()
                    return response

                responses = list(await asyncio.gather(*map(one, bodies)))
                page = (await client.get("/metrics")).text
        samples = [line.rsplit(" ", 1) for line in page.splitlines() if not line.startswith("#")]
        return responses, {name: float(value) for name, value in samples}

    return asyncio.run(main())
