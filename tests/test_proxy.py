"""The P/D proxy in-process, against small in-process backends that record what they get.

The backends are plain ASGI apps behind a transport that routes by host (an
unknown host refuses the connection), so the tests see exactly what P and D
receive and can make either fail, stall or break a stream. The proxy against
real ``kvbridge serve`` processes is in ``tests/integration/test_serve_http.py``.
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

from kvbridge.errors import ConfigError
from kvbridge.proxy import ProxyConfig, backend_urls, build_proxy_app

T = TypeVar("T")
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "10.0.0.1",
          "remote_port": 5555, "remote_block_ids": [3, 4], "remote_block_size": 16,
          "remote_num_tokens": 20, "grant": "g"}


@dataclass
class Backend:
    """A fake instance: records bodies; ``mode`` picks how it answers."""

    name: str
    mode: str = "ok"
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        async def completions(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            if self.mode == "400":
                return JSONResponse({"error": {"message": "bad max_tokens", "type": "x"}}, 400)
            if self.mode == "500":
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
            if self.mode == "stall":
                await asyncio.sleep(30)
            if body.get("stream"):
                return StreamingResponse(self._events(), media_type="text/event-stream")
            params = PARAMS if self.mode == "ok" and body.get("kv_transfer_params") else None
            return JSONResponse({"answered_by": self.name, "kv_transfer_params": params})

        async def health() -> JSONResponse:
            return JSONResponse({"status": "ok"}, 200 if self.mode != "sick" else 503)

        app.add_api_route("/v1/completions", completions, methods=["POST"])
        app.add_api_route("/health", health, methods=["GET"])
        return app

    async def _events(self) -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {json.dumps({'from': self.name, 'i': i})}\n\n".encode()
        if self.mode == "break":
            raise httpx.ReadError("connection reset")
        yield b"data: [DONE]\n\n"


class _LiveStream(httpx.AsyncByteStream):
    """A response body read as it is produced (``ASGITransport`` would buffer it whole)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk


class Routes(httpx.AsyncBaseTransport):
    """Sends each request to the backend named by its host; unknown hosts refuse.

    A ``break`` backend's streams are served live, so they can fail mid-way.
    """

    def __init__(self, backends: list[Backend]) -> None:
        self._backends = {b.name: b for b in backends}
        self._apps = {b.name: httpx.ASGITransport(app=b.app()) for b in backends}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host not in self._apps:
            raise httpx.ConnectError("connection refused", request=request)
        backend = self._backends[host]
        if backend.mode == "break":
            backend.bodies.append(json.loads(await request.aread()))
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_LiveStream(backend._events()))
        return await self._apps[host].handle_async_request(request)


def run(backends: list[Backend], prefill: list[str], decode: list[str],
        scenario: Callable[[httpx.AsyncClient], Awaitable[T]], **limits: Any) -> T:
    config = ProxyConfig(backend_urls(prefill), backend_urls(decode), **limits)

    async def main() -> T:
        app = build_proxy_app(config, transport=Routes(backends))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy", timeout=60) as client:
            return await scenario(client)

    return asyncio.run(main())


REQUEST = {"prompt": "hi", "max_tokens": 9, "temperature": 0.5, "seed": 3}


def test_prefill_then_decode_with_round_robin() -> None:
    p1, p2, d1, d2 = Backend("p1"), Backend("p2"), Backend("d1"), Backend("d2")

    async def scenario(client: httpx.AsyncClient) -> list[str]:
        answers = []
        for _ in range(4):
            r = await client.post("/v1/completions",
                                  json={**REQUEST, "kv_transfer_params": {"grant": "forged"}})
            assert r.status_code == 200
            answers.append(r.json()["answered_by"])
        return answers

    answers = run([p1, p2, d1, d2], ["p1", "p2"], ["d1", "d2"], scenario)
    assert answers == ["d1", "d2", "d1", "d2"]
    assert len(p1.bodies) == len(p2.bodies) == 2
    for body in p1.bodies + p2.bodies:  # P: one token, unary, asked to keep the KV for D
        assert body == {**REQUEST, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True}}
    for body in d1.bodies + d2.bodies:  # D: the original request with P's params
        assert body == {**REQUEST, "kv_transfer_params": PARAMS}


def test_prefill_without_params_means_decode_prefills_locally() -> None:
    p, d = Backend("p", mode="no-params"), Backend("d")

    async def scenario(client: httpx.AsyncClient) -> int:
        r = await client.post("/v1/completions",
                              json={**REQUEST, "kv_transfer_params": {"x": 1}})
        return r.status_code

    assert run([p, d], ["p"], ["d"], scenario) == 200
    assert d.bodies == [REQUEST]


def test_streams_pass_through() -> None:
    p, d = Backend("p"), Backend("d")

    async def scenario(client: httpx.AsyncClient) -> str:
        r = await client.post("/v1/completions", json={**REQUEST, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.text

    text = run([p, d], ["p"], ["d"], scenario)
    expected = "".join(f"data: {json.dumps({'from': 'd', 'i': i})}\n\n" for i in range(3))
    assert text == expected + "data: [DONE]\n\n"
    assert p.bodies[0]["stream"] is False and d.bodies[0]["stream"] is True


def test_a_stream_that_breaks_ends_with_an_error_event() -> None:
    p, d = Backend("p"), Backend("d", mode="break")

    async def scenario(client: httpx.AsyncClient) -> str:
        return (await client.post("/v1/completions", json={**REQUEST, "stream": True})).text

    text = run([p, d], ["p"], ["d"], scenario)
    events = [e for e in text.split("\n\n") if e]
    assert [json.loads(e[6:])["i"] for e in events[:3]] == [0, 1, 2]
    assert "failed mid-stream" in json.loads(events[3][6:])["error"]["message"]
    assert events[4] == "data: [DONE]"


@pytest.mark.parametrize("failing, mode, stream, status, words", [
    ("p", "400", False, 400, "bad max_tokens"),  # the client's mistake: passed through
    ("p", "500", False, 502, "prefill http://p/v1/completions answered 500: boom"),
    ("p", "stall", False, 502, "prefill http://p/v1/completions did not answer within 0.5 s"),
    ("p", "gone", False, 502, "prefill http://p/v1/completions failed: ConnectError"),
    ("d", "500", False, 502, "decode http://d/v1/completions answered 500: boom"),
    ("d", "500", True, 502, "decode http://d/v1/completions answered 500: boom"),
    ("d", "stall", False, 502, "decode http://d/v1/completions did not answer within 0.5 s"),
    ("d", "stall", True, 502, "decode http://d/v1/completions did not answer within 0.5 s"),
    ("d", "gone", True, 502, "decode http://d/v1/completions failed: ConnectError"),
])
def test_backend_failures_give_clear_errors(failing: str, mode: str, stream: bool, status: int,
                                            words: str) -> None:
    backends = {"p": Backend("p"), "d": Backend("d")}
    backends[failing].mode = mode
    live = [b for b in backends.values() if b.mode != "gone"]

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        async with asyncio.timeout(10):  # never a hang
            return await client.post("/v1/completions", json={**REQUEST, "stream": stream})

    r = run(live, ["p"], ["d"], scenario, prefill_timeout_s=0.5, decode_timeout_s=0.5)
    assert r.status_code == status
    assert words in r.json()["error"]["message"]
    assert len(backends["p"].bodies) == (0 if backends["p"].mode == "gone" else 1)
    if failing == "p":
        assert backends["d"].bodies == []  # no decode after a failed prefill


@pytest.mark.parametrize("body, words", [(b"{", "invalid JSON"), (b"[1]", "JSON object"),
                                         (b'{"prompt": "x", "stream": 1}', "stream must be")])
def test_bad_bodies_get_400_without_backend_calls(body: bytes, words: str) -> None:
    p, d = Backend("p"), Backend("d")

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", content=body)

    r = run([p, d], ["p"], ["d"], scenario)
    assert r.status_code == 400 and words in r.json()["error"]["message"]
    assert p.bodies == d.bodies == []


@pytest.mark.parametrize("modes, status, overall", [
    ({"p1": "ok", "p2": "ok", "d": "ok"}, 200, "ok"),
    ({"p1": "sick", "p2": "ok", "d": "ok"}, 200, "degraded"),
    ({"p1": "ok", "p2": "gone", "d": "sick"}, 503, "down"),
])
def test_health_reports_every_backend(modes: dict[str, str], status: int, overall: str) -> None:
    backends = [Backend(name, mode) for name, mode in modes.items() if mode != "gone"]

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        return await client.get("/health")

    r = run(backends, ["p1", "p2"], ["d"], scenario)
    assert r.status_code == status
    body = r.json()
    assert body["status"] == overall
    reported = {c["url"]: c["ok"] for c in body["prefill"] + body["decode"]}
    assert reported == {f"http://{n}": m == "ok" for n, m in modes.items()}


def test_config_validation() -> None:
    assert backend_urls(["h:1", "https://x/"]) == ("http://h:1", "https://x/")
    assert ProxyConfig(("http://a/",), ("http://b",)).prefill_urls == ("http://a",)
    with pytest.raises(ConfigError, match="prefill_urls"):
        ProxyConfig((), ("http://b",))
    with pytest.raises(ConfigError, match="ftp://b"):
        ProxyConfig(("http://a",), ("ftp://b",))
    with pytest.raises(ConfigError, match="read_timeout_s"):
        ProxyConfig(("http://a",), ("http://b",), read_timeout_s=0)
