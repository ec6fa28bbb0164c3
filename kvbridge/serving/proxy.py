"""P/D proxy: an OpenAI-style front that prefills on P and decodes on D.

``kvbridge proxy`` (``kvbridge/cli/proxy.py``) serves :func:`build_proxy_app`
with uvicorn: ``POST /v1/completions`` and ``POST /v1/chat/completions`` go P
then D, ``GET /v1/models`` is D's answer, ``GET /health`` reports every backend,
``GET /metrics`` the proxy's counters.
Per request, with round robin over each pool::

    client --body--> proxy --body + max_tokens=1, stream=false,
                              kv_transfer_params={"do_remote_decode": true}--> P
                     proxy <--{..., "kv_transfer_params": {...}}-------------- P
                     proxy --body + P's kv_transfer_params-------------------> D
    client <--D's answer (SSE passed through as it arrives, or one JSON)---- D

That is the classic flow. By default (``ProxyConfig.first_token``) completions
that allow it take the first-token path (``kvbridge/serving/first_token.py``): the
client gets P's token the moment P answers, and D, asked for the rest with
that token appended to its prompt, loads the prompt's KV and continues; so
the client's first token waits for P only. Chat completions take the classic
flow: D would continue after P's token only from token ids, which only
``/v1/completions`` takes, and a chat answer passes through what the server
does to chat output alone (reasoning and tool-call parsers, set by server
flags the proxy cannot see), so the answer could differ.

A request for several choices (``n``, or a completion's list of prompts) is
split into one request per choice (``api_bodies.py``: P would hold a grant
per choice and hand out the params of one) and the answers merged
(``fan_out.py``).

P answering without ``kv_transfer_params`` (no connector) is not an error: D
then prefills locally. A 4xx from a backend (the client's mistake) is passed
through; in the classic flow, a backend that fails, answers 5xx or exceeds its
time limit gives the client a 502 with the reason (or, mid-stream, an SSE
error event). In the first-token flow, a D failing after P's token has the
rest of the answer asked for again, from where the client's tokens end, from
another D (or the same) that computes the prompt, then from a P
(``recovery.py``); the client gets an error only when none can finish, and
``GET /metrics`` counts both. Every backend call has a time limit. When P has
prefilled but D never gets the request carrying P's params (D refused it, or
the client left after P's first token and before D was asked), the proxy asks
D in the background for one token with them, so that P's blocks are read and
let go at once rather than held for nobody until their lease ends.

Unhealthy backends (``backend_pool.py``): one that could not be reached, did
not answer in time or answered 502, 503 or 504 is skipped for
``unhealthy_backoff_s`` while another of its role is usable, and probed on
``/health`` before it gets requests again; a 500 fails its request only. A
prefill whose connection failed is retried once on another P (the client has
received nothing yet); a classic decode only when its connection never opened
(D cannot have used P's blocks). A classic stream to the client is never
retried. With no usable backend of a role the client gets 503 and, per
backend, why. ``GET /health`` reports every backend's health.

Imports no torch: the proxy starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbridge.errors import ConfigError
from kvbridge.serving import api_bodies, fan_out, first_token
from kvbridge.serving.api_bodies import CHAT, COMPLETIONS, Api
from kvbridge.serving.backend_pool import (
    BackendPool,
    ClientErrorAnswer,
    NoBackendError,
    is_lost_connection,
)
from kvbridge.serving.http_common import (
    SSE_DONE,
    ApiError,
    ClientGone,
    ClosingStreamingResponse,
    add_error_handlers,
    error_body,
    read_body,
    sse_event,
    unless_client_gone,
)
from kvbridge.serving.metrics import CONTENT_TYPE, ProxyMetrics
from kvbridge.serving.recovery import Continuer

__all__ = ["PDProxy", "ProxyConfig", "build_proxy_app"]

logger = logging.getLogger(__name__)

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
        unhealthy_backoff_s: How long a backend that failed is skipped before
            its ``/health`` is probed again.
        first_token: send P's token to the client as the first token and ask D
            for the rest (module docstring); False: the classic flow only.
        max_choices: Most choices (``n`` times the prompts) one request may ask for.

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
    unhealthy_backoff_s: float = 5.0
    first_token: bool = True
    max_choices: int = 64

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
                  "max_body_nbytes": self.max_body_nbytes,
                  "unhealthy_backoff_s": self.unhealthy_backoff_s,
                  "max_choices": self.max_choices}
        bad_limits = {k: v for k, v in limits.items() if not v > 0}
        if bad_limits:
            raise ConfigError(f"time and size limits must be > 0, got {bad_limits}")


def _bad_gateway(message: str) -> ApiError:
    return ApiError(502, message, "bad_gateway")


class PDProxy:
    """Routes completions and chat completions P -> D over pooled HTTP connections.

    Args:
        config: Backends and limits.
        transport: httpx transport to the backends (tests pass in-process apps);
            ``None`` uses the network.
        clock: Monotonic seconds for the backends' back-off.
    """

    def __init__(self, config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport,
                                         limits=httpx.Limits(max_connections=None))
        limits = (config.unhealthy_backoff_s, config.health_timeout_s, clock)
        self.prefill_pool = BackendPool("prefill", config.prefill_urls, self._client, *limits)
        self.decode_pool = BackendPool("decode", config.decode_urls, self._client, *limits)
        self._background: set[asyncio.Task[None]] = set()
        self.metrics = ProxyMetrics()
        self._continuer = Continuer(self.decode_pool, self.prefill_pool, config.decode_timeout_s,
                                    config.read_timeout_s, self.metrics, self._release_later)

    async def aclose(self) -> None:
        """Finish background calls, close the backend connections. Idempotent."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.config.decode_timeout_s)
        await self._client.aclose()

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: P, then D; never waits past the configured limits."""
        return await self._serve(request, COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``: P, then D (the classic flow)."""
        return await self._serve(request, CHAT)

    async def models(self) -> Response:
        """``GET /v1/models``: a D's answer as it is (P and D serve the same model)."""
        try:
            response, _ = await self.decode_pool.get("/v1/models", f"pd-{uuid.uuid4().hex}",
                                                     self.config.decode_timeout_s)
        except ApiError as exc:
            logger.warning("models failed: %s", exc)
            return exc.response()
        except ClientErrorAnswer as exc:
            response = exc.response
        return Response(response.content, response.status_code, media_type="application/json")

    async def _serve(self, request: Request, api: Api) -> Response:
        try:
            raw = await read_body(request, self.config.max_body_nbytes)
            body = api_bodies.parse(raw, api, self.config.max_choices)
            units = api_bodies.split(body, api)
            request_id = f"pd-{uuid.uuid4().hex}"
            work = (self._route(body, request_id, api) if len(units) == 1
                    else self._fan_out(body, units, request_id, api))
            return await unless_client_gone(request, work)
        except ApiError as exc:
            logger.warning("%s failed: %s", api.path, exc)
            return exc.response()
        except ClientErrorAnswer as exc:
            return Response(exc.response.content, exc.response.status_code,
                            media_type="application/json")
        except ClientGone:
            return Response(status_code=499)

    async def _route(self, body: dict[str, Any], request_id: str, api: Api) -> Response:
        # No usable D: refuse before P prefills (and holds blocks) for nobody.
        try:
            await self.decode_pool.pick(advance=False)
        except NoBackendError as exc:
            raise ApiError(503, str(exc), "service_unavailable") from None
        wants_first = self.config.first_token and not api.chat and first_token.plan(body)
        answer, p_url = await self._prefill(body, request_id, wants_first, api)
        params = self._params(answer, p_url, request_id)
        first = first_token.take(answer) if wants_first and params is not None else None
        if first is not None and not first_token.covers_prompt(first, params):
            logger.warning("%s: prefill computed only part of the prompt; classic flow",
                           request_id)
            first = None
        stream = body.get("stream") is True
        if first is not None:
            return await self._continue(body, first, params, request_id, stream)
        d_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params is not None:
            d_body["kv_transfer_params"] = params
        try:
            response, url = await self.decode_pool.post(d_body, request_id,
                                                        self.config.decode_timeout_s, stream,
                                                        api.path)
        except ClientErrorAnswer:
            if params is not None:  # D refused it: P holds the prompt for nobody
                release = api_bodies.classic_release_body(body, api, params)
                self._release_later(release, request_id, api)
            raise
        if stream:
            return ClosingStreamingResponse(self._relay(response, url, api))
        return Response(response.content, response.status_code, media_type="application/json")

    async def _fan_out(self, body: dict[str, Any], units: list[dict[str, Any]],
                       request_id: str, api: Api) -> Response:
        """Each choice P -> D on its own, all at once; one answer (``fan_out.py``).

        A unit failing fails the request with its error once every unit has
        ended: one cancelled between P's answer and D's call would leave P
        holding its blocks for nobody. The streams of those that did not fail
        are closed unsent, so that their own clean-up lets P's blocks go.
        """
        results = await asyncio.gather(
            *(self._route(unit, f"{request_id}-{k}", api) for k, unit in enumerate(units)),
            return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        responses = [r for r in results if not isinstance(r, BaseException)]
        if failures:
            for response in responses:
                if isinstance(response, ClosingStreamingResponse):
                    await response.discard()
            raise failures[0]
        n = body.get("n") or 1
        if body.get("stream") is True:
            streams = [_sse_of(response) for response in responses]
            return ClosingStreamingResponse(fan_out.merge_streams(streams, n))
        answers = []
        for k, response in enumerate(responses):
            try:
                answer: object = json.loads(bytes(response.body))
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise _bad_gateway(f"the answer to choice {k} is not a JSON object: "
                                   f"{bytes(response.body)[:200]!r}")
            answers.append(answer)
        return JSONResponse(fan_out.merge_answers(answers, n))

    async def _prefill(self, body: dict[str, Any], request_id: str, wants_first: bool,
                       api: Api) -> tuple[dict[str, Any], str]:
        """Run the prompt on the next P; return its JSON answer and P's URL."""
        p_body = first_token.prefill_body(body, wants_first)
        response, url = await self.prefill_pool.post(p_body, request_id,
                                                     self.config.prefill_timeout_s, False,
                                                     api.path)
        try:
            answer: object = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise _bad_gateway(f"prefill {url} answered something other than a JSON "
                               f"object: {response.text[:200]!r}")
        return answer, url

    @staticmethod
    def _params(answer: dict[str, Any], url: str, request_id: str) -> dict[str, Any] | None:
        """The params P hands out for D (``None``: D prefills)."""
        params = answer.get("kv_transfer_params")
        if params is None:
            logger.warning("%s: prefill %s returned no kv_transfer_params; decode prefills "
                           "locally", request_id, url)
            return None
        if not isinstance(params, dict):
            raise _bad_gateway(f"prefill {url} returned kv_transfer_params of type "
                               f"{type(params).__name__}")
        return params

    async def _continue(self, body: dict[str, Any], first: first_token.FirstToken,
                        params: dict[str, Any] | None, request_id: str, stream: bool
                        ) -> Response:
        """The first-token path: P's token to the client now, D's tokens after it."""
        if first.finished:  # nothing for D to generate; it still lets P's blocks go
            if params is not None:
                self._release_later(first_token.release_body(body, first, params), request_id)
            if stream:
                event = first_token.first_event(body, first)
                return Response(sse_event(event) + SSE_DONE, media_type="text/event-stream")
            return JSONResponse(first_token.only_first(body, first))
        if stream:
            return ClosingStreamingResponse(self._continuer.stream(body, first, params,
                                                                   request_id))
        return JSONResponse(await self._continuer.answer(body, first, params, request_id))

    def _release_later(self, d_body: dict[str, Any], request_id: str,
                       api: Api = COMPLETIONS) -> None:
        """Ask D in the background for one token so that P's blocks are read and released."""

        async def release() -> None:
            try:
                response, _ = await self.decode_pool.post(d_body, request_id,
                                                          self.config.decode_timeout_s, False,
                                                          api.path)
                await response.aclose()
            except (ApiError, ClientErrorAnswer) as exc:
                logger.warning("%s: could not hand P's blocks to a decode (P keeps them until "
                               "its lease ends): %s", request_id, exc)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _relay(self, response: httpx.Response, base_url: str, api: Api
                     ) -> AsyncGenerator[bytes, None]:
        """D's SSE bytes as they arrive; a failure ends the stream with an error event.

        Never retried: the client may already hold part of the answer.
        """
        url = f"{base_url}{api.path}"
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
            if isinstance(exc, TimeoutError) or is_lost_connection(exc):
                self.decode_pool.mark_down(base_url, f"stream broke: {reason}")
            # The blank line ends an event the broken stream may have left half-written.
            error = error_body(f"decode {url} failed mid-stream: {reason}", "bad_gateway")
            yield b"\n\n" + sse_event(error) + SSE_DONE
        finally:
            await response.aclose()

    async def metrics_page(self) -> Response:
        """``GET /metrics``: the proxy's counters (``ProxyMetrics``), Prometheus text."""
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def health(self) -> JSONResponse:
        """``GET /health``: 200 when at least one P and one D are healthy, else 503.

        The answers also refresh which backends round robin skips.
        """
        pools = (self.prefill_pool, self.decode_pool)
        checks = await asyncio.gather(*(self._check(pool, url)
                                        for pool in pools for url in pool.urls))
        num_prefill = len(self.prefill_pool.urls)
        prefill, decode = checks[:num_prefill], checks[num_prefill:]
        usable = any(c["ok"] for c in prefill) and any(c["ok"] for c in decode)
        status = "ok" if all(c["ok"] for c in checks) else ("degraded" if usable else "down")
        return JSONResponse({"status": status, "prefill": prefill, "decode": decode},
                            200 if usable else 503)

    @staticmethod
    async def _check(pool: BackendPool, url: str) -> dict[str, Any]:
        problem = await pool.probe(url)
        if problem is None:
            pool.mark_up(url)
        else:
            pool.mark_down(url, f"health check: {problem}")
        return {"url": url, "ok": problem is None, "detail": problem or "ok"}


async def _sse_of(response: Response) -> AsyncGenerator[bytes, None]:
    """The SSE bytes of a unit's streamed answer (one already whole, or a live stream)."""
    if isinstance(response, ClosingStreamingResponse):
        async with contextlib.aclosing(response.generator) as chunks:
            async for chunk in chunks:
                yield chunk
    else:
        yield bytes(response.body)


def build_proxy_app(config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None,
                    clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The proxy's HTTP app; its backend connections close when the app shuts down.

    Args:
        config: Backends and limits.
        transport: See :class:`PDProxy`.
        clock: See :class:`PDProxy`.

    Returns:
        A FastAPI (ASGI) app with ``POST /v1/completions``, ``POST /v1/chat/completions``,
        ``GET /v1/models`` and ``GET /health``.
    """
    proxy = PDProxy(config, transport, clock)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.aclose()

    app = FastAPI(title="kvbridge proxy", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    add_error_handlers(app)
    app.add_api_route("/v1/completions", proxy.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", proxy.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/metrics", proxy.metrics_page, methods=["GET"])
    app.state.proxy = proxy
    return app


def backend_urls(values: Sequence[str]) -> tuple[str, ...]:
    """Normalise ``host:port`` or URL arguments to base URLs (``http://`` by default)."""
    return tuple(v if "://" in v else f"http://{v}" for v in values)
