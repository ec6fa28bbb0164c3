"""HTTP pieces shared by the engine server and the P/D proxy.

``kvbridge/reference/server.py`` and ``kvbridge/proxy/app.py`` both answer
OpenAI-style JSON errors, read request bodies under a size limit, stream SSE
and notice clients that go away; this module holds that once. It imports no
torch, so the proxy stays quick to start.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

__all__ = [
    "SSE_DONE",
    "ApiError",
    "ClientGone",
    "ClosingStreamingResponse",
    "add_error_handlers",
    "error_body",
    "read_body",
    "sse_event",
    "unless_client_gone",
]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Last event of every SSE answer.
SSE_DONE = b"data: [DONE]\n\n"


def error_body(message: str, kind: str) -> dict[str, Any]:
    """The OpenAI-style error object ``{"error": {"message", "type"}}``."""
    return {"error": {"message": message, "type": kind}}


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE ``data:`` event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class ApiError(Exception):
    """Ends a call with an error status; the message goes to the client.

    Args:
        status: HTTP status code of the answer.
        message: Text for the client.
        kind: OpenAI-style error ``type``.
    """

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def response(self) -> JSONResponse:
        """The OpenAI-style error answer."""
        return JSONResponse(error_body(str(self), self.kind), self.status)


class ClientGone(Exception):
    """The client disconnected before its answer was ready (answered 499)."""


class ClosingStreamingResponse(StreamingResponse):
    """An SSE answer that closes its generator however the response ends.

    Starlette may cancel a stream while the generator sits at a ``yield``
    (client gone); closing it here runs the generator's ``finally`` at once, so
    whatever it holds (an engine request, a backend stream) is released.
    """

    def __init__(self, content: AsyncGenerator[bytes, None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.generator = content

    async def discard(self) -> None:
        """Close an answer that will not be sent: the generator runs to its first
        ``yield`` and is closed there, so its ``finally`` runs (closing a generator
        that never started would skip it)."""
        try:
            await anext(self.generator)
        except StopAsyncIteration:
            pass
        finally:
            await self.generator.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generator.aclose()


async def read_body(request: Request, max_nbytes: int) -> bytes:
    """The whole request body, refused once it grows past ``max_nbytes``.

    Raises:
        ApiError: 413 when the body is longer than ``max_nbytes``.
        ClientGone: the client left before its body arrived (an abort, not a failure).
    """
    chunks: list[bytes] = []
    nbytes = 0
    try:
        async for chunk in request.stream():
            nbytes += len(chunk)
            if nbytes > max_nbytes:
                raise ApiError(413, f"request body exceeds {max_nbytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


async def unless_client_gone(request: Request, work: Awaitable[_T]) -> _T:
    """Await ``work``, cancelling it if the client disconnects first.

    Cancelling lets ``work`` release what it holds (abort an engine request,
    close backend connections) instead of finishing for nobody.

    Returns:
        What ``work`` returns.

    Raises:
        ClientGone: the client disconnected before ``work`` finished.
    """

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def add_error_handlers(app: FastAPI) -> None:
    """Answer routing errors (404, 405, ...) and uncaught exceptions as JSON errors.

    Args:
        app: The app to install the handlers on (changed in place).
    """

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind).response()

    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.error("request failed: %r", exc)  # starlette logs the traceback too
        return ApiError(500, f"internal error: {exc!r}", "server_error").response()

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
