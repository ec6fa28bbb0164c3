"""P/D proxy: an OpenAI-style ``/v1/completions`` front that prefills on P and decodes on D.

``kvbridge proxy`` (``kvbridge/serve_cli.py``) serves :func:`build_proxy_app`
with uvicorn. Per request, with round robin over each pool::

    client --body--> proxy --body + max_tokens=1, stream=false,
                              kv_transfer_params={"do_remote_decode": true}--> P
                     proxy <--{..., "kv_transfer_params": {...}}-------------- P
                     proxy --body + P's kv_transfer_params-------------------> D
    client <--D's answer (SSE passed through as it arrives, or one JSON)---- D

P answering without ``kv_transfer_params`` (no connector) is not an error: D
then prefills locally. A 4xx from a backend (the client's mistake) is passed
through; a backend that fails, answers 5xx or exceeds its time limit gives the
client a 502 with the reason (or, mid-stream, an SSE error event). Every backend
call has a time limit. ``GET /health`` reports every backend's health.

Imports no torch: the proxy starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvbridge.errors import ConfigError

__all__ = ["PDProxy", "ProxyConfig", "build_proxy_app"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Backends and time limits of a proxy.

    Attributes:
        prefill_urls: Base URLs of the prefill instances (``http://host:port``).
        decode_urls: Base URLs of the decode instances.
        connect_timeout_s: Limit on opening a backend connection.
        prefill_timeout_s: Limit on a whole prefill call.
        decode_timeout_s: Limit on a non-streamed decode call, and on a streamed
            one until its first byte.
        read_timeout_s: Longest silence within a streamed decode answer.
        health_timeout_s: Limit on one backend health check.
        max_body_nbytes: Largest request body accepted.

    Raises:
        ConfigError: an empty pool, a URL that is not ``http(s)://``, or a
            limit that is not positive.
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 300.0
    read_timeout_s: float = 120.0
    health_timeout_s: float = 2.0
    max_body_nbytes: int = 16 << 20

    def __post_init__(self) -> None:
        for pool in ("prefill_urls", "decode_urls"):
            urls = tuple(u.rstrip("/") for u in getattr(self, pool))
            if not urls:
                raise ConfigError(f"{pool} must name at least one backend")
            bad = [u for u in urls if not u.startswith(("http://", "https://"))]
            if bad:
                raise ConfigError(f"{pool}: {bad} are not http:// or https:// URLs")
            object.__setattr__(self, pool, urls)
        limits = {"connect_timeout_s": self.connect_timeout_s,
                  "prefill_timeout_s": self.prefill_timeout_s,
                  "decode_timeout_s": self.decode_timeout_s,
                  "read_timeout_s": self.read_timeout_s,
                  "health_timeout_s": self.health_timeout_s,
                  "max_body_nbytes": self.max_body_nbytes}
        bad_limits = {k: v for k, v in limits.items() if not v > 0}
        if bad_limits:
            raise ConfigError(f"time and size limits must be > 0, got {bad_limits}")


class _ProxyError(Exception):
    """Ends a proxied call with an error answer."""

    def __init__(self, status: int, message: str, kind: str = "bad_gateway") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind}}, self.status)


class _Passthrough(Exception):
    """A backend's 4xx answer, handed to the client as is."""

    def __init__(self, response: Response) -> None:
        super().__init__(f"backend answered {response.status_code}")
        self.response = response


class _ClientGone(Exception):
    """The client disconnected before the answer was ready."""


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its generator (and so D's stream) however the response ends."""

    def __init__(self, content: AsyncGenerator[bytes, None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generator.aclose()


async def _unless_client_gone(request: Request, work: Awaitable[_T]) -> _T:
    """Await ``work``; cancel it (closing backend connections) if the client disconnects."""

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


class PDProxy:
    """Routes completions P -> D over pooled HTTP connections.

    Args:
        config: Backends and limits.
        transport: httpx transport to the backends (tests pass in-process apps);
            ``None`` uses the network.
    """

    def __init__(self, config: ProxyConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport,
                                         limits=httpx.Limits(max_connections=None))
        self._prefill_urls = itertools.cycle(config.prefill_urls)
        self._decode_urls = itertools.cycle(config.decode_urls)

    async def aclose(self) -> None:
        """Close the backend connections. Idempotent."""
        await self._client.aclose()

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: P, then D; never waits past the configured limits."""
        try:
            body = await self._read_json(request)
            request_id = f"pd-{uuid.uuid4().hex}"
            return await _unless_client_gone(request, self._route(body, request_id))
        except _ProxyError as exc:
            logger.warning("completion failed: %s", exc)
            return exc.response()
        except _Passthrough as exc:
            return exc.response
        except _ClientGone:
            return Response(status_code=499)

    async def _read_json(self, request: Request) -> dict[str, Any]:
        chunks: list[bytes] = []
        try:
            async for chunk in request.stream():
                chunks.append(chunk)
                if sum(map(len, chunks)) > self.config.max_body_nbytes:
                    raise _ProxyError(413, f"request body exceeds "
                                           f"{self.config.max_body_nbytes} bytes",
                                      "invalid_request_error")
        except ClientDisconnect:  # gone before its body arrived: an abort, not a failure
            raise _ClientGone from None
        try:
            # NaN and Infinity are not JSON: refused here, they could not be forwarded.
            body = json.loads(b"".join(chunks), parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise _ProxyError(400, f"invalid JSON body: {exc}", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise _ProxyError(400, f"request body must be a JSON object, got "
                                   f"{type(body).__name__}", "invalid_request_error")
        # Checked here: P is always asked with stream=false and max_tokens=1 and would
        # not notice. A bad value found only by D would leave P holding the prompt's
        # blocks until the lease ends.
        if not isinstance(body.get("stream", False), bool):
            raise _ProxyError(400, f"stream must be true or false, got {body['stream']!r}",
                              "invalid_request_error")
        max_tokens = body.get("max_tokens", 1)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _ProxyError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r:.40}",
                              "invalid_request_error")
        return body

    async def _route(self, body: dict[str, Any], request_id: str) -> Response:
        params = await self._prefill(body, request_id)
        d_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params is not None:
            d_body["kv_transfer_params"] = params
        if body.get("stream") is True:
            return await self._decode_stream(d_body, request_id)
        return await self._decode(d_body, request_id)

    async def _post(self, url: str, body: dict[str, Any], request_id: str,
                    timeout_s: float, what: str) -> httpx.Response:
        """POST ``body`` to ``url`` (whole answer read) within ``timeout_s``.

        Raises:
            _ProxyError: 502 for a failure, a time-out or a 5xx answer.
            _Passthrough: a 4xx answer.
        """
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._client.post(url, json=body,
                                                   headers={"x-request-id": request_id})
        except TimeoutError:
            raise _ProxyError(502, f"{what} {url} did not answer within {timeout_s} s") from None
        except httpx.HTTPError as exc:
            raise _ProxyError(502, f"{what} {url} failed: {exc!r}") from None
        self._check_status(response, url, what)
        return response

    @staticmethod
    def _check_status(response: httpx.Response, url: str, what: str) -> None:
        if response.status_code >= 500:
            raise _ProxyError(502, f"{what} {url} answered {response.status_code}: "
                                   f"{_error_text(response)}")
        if response.status_code >= 400:
            raise _Passthrough(Response(response.content, response.status_code,
                                        media_type="application/json"))

    async def _prefill(self, body: dict[str, Any], request_id: str) -> dict[str, Any] | None:
        """Run the prompt on the next P; return the params for D (``None``: D prefills)."""
        url = next(self._prefill_urls)
        p_body = {**body, "max_tokens": 1, "stream": False,
                  "kv_transfer_params": {"do_remote_decode": True}}
        response = await self._post(f"{url}/v1/completions", p_body, request_id,
                                    self.config.prefill_timeout_s, "prefill")
        try:
            params: object = response.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise _ProxyError(502, f"prefill {url} answered something other than a JSON "
                                   f"object: {response.text[:200]!r}") from None
        if params is None:
            logger.warning("%s: prefill %s returned no kv_transfer_params; decode prefills "
                           "locally", request_id, url)
            return None
        if not isinstance(params, dict):
            raise _ProxyError(502, f"prefill {url} returned kv_transfer_params of type "
                                   f"{type(params).__name__}")
        return params

    async def _decode(self, body: dict[str, Any], request_id: str) -> Response:
        url = f"{next(self._decode_urls)}/v1/completions"
        response = await self._post(url, body, request_id, self.config.decode_timeout_s,
                                    "decode")
        return Response(response.content, response.status_code, media_type="application/json")

    async def _decode_stream(self, body: dict[str, Any], request_id: str) -> Response:
        url = f"{next(self._decode_urls)}/v1/completions"
        request = self._client.build_request("POST", url, json=body,
                                             headers={"x-request-id": request_id})
        limit_s = self.config.decode_timeout_s
        try:
            async with asyncio.timeout(limit_s):
                response = await self._client.send(request, stream=True)
        except TimeoutError:
            raise _ProxyError(502, f"decode {url} did not answer within {limit_s} s") from None
        except httpx.HTTPError as exc:
            raise _ProxyError(502, f"decode {url} failed: {exc!r}") from None
        if response.status_code != 200:
            try:
                await response.aread()
            finally:
                await response.aclose()
            self._check_status(response, url, "decode")
        return _ClosingStreamingResponse(self._relay(response, url))

    async def _relay(self, response: httpx.Response, url: str) -> AsyncGenerator[bytes, None]:
        """D's SSE bytes as they arrive; a failure ends the stream with an error event."""
        limit_s = self.config.read_timeout_s
        chunks = response.aiter_bytes()
        try:
            while True:
                try:
                    async with asyncio.timeout(limit_s):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                yield chunk
        except (httpx.HTTPError, TimeoutError) as exc:
            reason = f"silent for {limit_s} s" if isinstance(exc, TimeoutError) else repr(exc)
            logger.warning("decode %s stream broke: %s", url, reason)
            error = {"error": {"message": f"decode {url} failed mid-stream: {reason}",
                               "type": "bad_gateway"}}
            yield f"\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await response.aclose()

    async def health(self) -> JSONResponse:
        """``GET /health``: 200 when at least one P and one D are healthy, else 503."""
        config = self.config
        checks = await asyncio.gather(*(self._check(u) for u in config.prefill_urls),
                                      *(self._check(u) for u in config.decode_urls))
        prefill, decode = checks[: len(config.prefill_urls)], checks[len(config.prefill_urls):]
        usable = any(c["ok"] for c in prefill) and any(c["ok"] for c in decode)
        status = "ok" if all(c["ok"] for c in checks) else ("degraded" if usable else "down")
        return JSONResponse({"status": status, "prefill": prefill, "decode": decode},
                            200 if usable else 503)

    async def _check(self, url: str) -> dict[str, Any]:
        limit_s = self.config.health_timeout_s
        try:
            async with asyncio.timeout(limit_s):
                response = await self._client.get(f"{url}/health")
        except TimeoutError:
            return {"url": url, "ok": False, "detail": f"no answer within {limit_s} s"}
        except httpx.HTTPError as exc:
            return {"url": url, "ok": False, "detail": repr(exc)}
        ok = response.status_code == 200
        return {"url": url, "ok": ok, "detail": "ok" if ok else _error_text(response)}


def build_proxy_app(config: ProxyConfig,
                    transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy's HTTP app; its backend connections close when the app shuts down.

    Args:
        config: Backends and limits.
        transport: See :class:`PDProxy`.

    Returns:
        A FastAPI (ASGI) app with ``POST /v1/completions`` and ``GET /health``.
    """
    proxy = PDProxy(config, transport)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _ProxyError(exc.status_code, str(exc.detail), kind).response()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.aclose()

    app = FastAPI(title="kvbridge proxy", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.error("request failed: %r", exc)
        return _ProxyError(500, f"internal error: {exc!r}", "server_error").response()

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_api_route("/v1/completions", proxy.completions, methods=["POST"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.state.proxy = proxy
    return app


def backend_urls(values: Sequence[str]) -> tuple[str, ...]:
    """Normalise ``host:port`` or URL arguments to base URLs (``http://`` by default)."""
    return tuple(v if "://" in v else f"http://{v}" for v in values)
