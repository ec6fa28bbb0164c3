"""The proxy's HTTP app: :class:`PDProxy` routes each request P then D.

``kvbridge proxy`` (``kvbridge/cli/proxy.py``) serves :func:`build_proxy_app`
with uvicorn. The flows it routes (classic, first-token, fan-out, recovery,
unhealthy backends) are drawn in the package docstring (``__init__.py``);
its limits are :class:`~kvbridge.proxy.config.ProxyConfig`.

Imports no torch: the proxy starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbridge.http_common import (
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
from kvbridge.proxy import api_bodies, fan_out, first_token
from kvbridge.proxy.api_bodies import CHAT, COMPLETIONS, Api
from kvbridge.proxy.backend_pool import (
    BackendPool,
    ClientErrorAnswer,
    NoBackendError,
    is_lost_connection,
)
from kvbridge.proxy.config import ProxyConfig
from kvbridge.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from kvbridge.proxy.recovery import Continuer

__all__ = ["PDProxy", "build_proxy_app"]

logger = logging.getLogger(__name__)

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
