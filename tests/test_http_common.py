"""The HTTP pieces the engine server and the proxy share, on a small app of their own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.types import Message

from kvbridge import http_common as hc

MAX_NBYTES = 64


def _app() -> FastAPI:
    app = FastAPI()
    hc.add_error_handlers(app)

    async def echo(request: Request) -> Response:
        try:
            return Response(await hc.read_body(request, MAX_NBYTES))
        except hc.ApiError as exc:
            return exc.response()

    async def boom() -> Response:
        raise RuntimeError("kaput")

    app.add_api_route("/echo", echo, methods=["POST"])
    app.add_api_route("/boom", boom, methods=["GET"])
    return app


def _call(method: str, path: str, body: bytes = b"") -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, content=body)

    return asyncio.run(main())


@pytest.mark.parametrize("nbytes", [0, 1, MAX_NBYTES])
def test_bodies_up_to_the_limit_are_read_whole(nbytes: int) -> None:
    body = bytes(range(nbytes))
    r = _call("POST", "/echo", body)
    assert r.status_code == 200 and r.content == body


def test_a_body_over_the_limit_gets_413_naming_the_limit() -> None:
    r = _call("POST", "/echo", b"x" * (MAX_NBYTES + 1))
    assert r.status_code == 413
    assert r.json() == hc.error_body(f"request body exceeds {MAX_NBYTES} bytes",
                                  "invalid_request_error")


@pytest.mark.parametrize("method, path, status, kind, words", [
    ("GET", "/nowhere", 404, "not_found_error", "Not Found"),
    ("GET", "/echo", 405, "invalid_request_error", "Method Not Allowed"),
    ("GET", "/boom", 500, "server_error", "internal error: RuntimeError('kaput')"),
])
def test_routing_errors_and_crashes_answer_json(method: str, path: str, status: int, kind: str,
                                                words: str) -> None:
    r = _call(method, path)
    assert r.status_code == status
    assert r.json() == hc.error_body(words, kind)


def test_sse_event_round_trips_its_payload() -> None:
    payload = {"text": "a\nb", "ids": [1, 2], "nested": {"x": None}}
    event = hc.sse_event(payload)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert b"\n" not in event[:-2]  # one line: a newline would end the event early
    assert json.loads(event[len(b"data: "):-2]) == payload
    assert hc.SSE_DONE == b"data: [DONE]\n\n"


def _request(messages: list[Message]) -> Request:
    """A request whose ``receive`` hands out ``messages``, then waits forever."""

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def test_unless_client_gone_returns_the_result_while_the_client_stays() -> None:
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert asyncio.run(hc.unless_client_gone(_request([]), work())) == 7


def test_unless_client_gone_cancels_the_work_when_the_client_leaves() -> None:
    cancelled = asyncio.Event()

    async def main() -> None:
        async def work() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(hc.ClientGone):
            await hc.unless_client_gone(_request([{"type": "http.disconnect"}]), work())

    asyncio.run(main())
    assert cancelled.is_set()


def test_a_closing_stream_closes_its_generator_when_sending_fails() -> None:
    closed: list[bool] = []

    async def events() -> AsyncGenerator[bytes, None]:
        try:
            while True:
                yield hc.sse_event({"i": 1})
        finally:
            closed.append(True)

    async def main() -> None:
        num_sent = 0

        async def send(message: Message) -> None:
            nonlocal num_sent
            num_sent += 1
            if num_sent > 3:
                raise OSError("client went away")

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        response = hc.ClosingStreamingResponse(events())
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        with pytest.raises(ClientDisconnect):  # starlette's name for the failed send
            await response(scope, receive, send)
        assert closed == [True]  # at once, not when the event loop shuts down

    asyncio.run(main())
