"""OpenAI-style HTTP server around an ``AsyncEngine``: completions, health and metrics.

``kvbridge serve`` (``kvbridge/cli/serve.py``) builds the engine and serves
:func:`build_app` with uvicorn; tests drive the app in-process. Endpoints:

- ``POST /v1/completions``: ``prompt`` (text or token ids), ``max_tokens``,
  ``temperature`` (default 0: greedy), ``top_p``, ``seed``, ``stop``,
  ``ignore_eos``, ``stream``, ``return_token_ids`` and ``kv_transfer_params``.
  The answer carries the completion's ``token_ids`` per choice (and, with
  ``return_token_ids``, the prompt's ``prompt_token_ids`` in the first body, as
  vLLM does: the proxy's first-token flow needs them), the ``kv_transfer_params`` a prefill
  instance hands out, and a ``kvbridge`` object (cached / remote prompt tokens,
  TTFT). ``stream=true`` answers with SSE ``data:`` events ending in ``[DONE]``.
- ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /v1/models``.

Every client error answers ``{"error": {"message", "type"}}`` with a 4xx code
and the server keeps serving. A client that goes away aborts its request in the
engine, so its blocks are freed.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Annotated, Any, cast

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbridge.connector.params import KVTransferParams
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
from kvbridge.reference.engine.async_engine import AsyncEngine, EngineDeadError
from kvbridge.reference.engine.engine import InvalidRequestError
from kvbridge.reference.engine.model_config import NUM_BYTE_TOKENS
from kvbridge.reference.engine.request import FinishReason, RequestOutput, SamplingParams
from kvbridge.reference.metrics import CONTENT_TYPE, ServerMetrics

__all__ = ["DEFAULT_MAX_BODY_NBYTES", "ApiError", "CompletionRequest", "build_app"]

logger = logging.getLogger(__name__)

#: Largest request body accepted (bytes); a longer body answers 413.
DEFAULT_MAX_BODY_NBYTES = 16 << 20
#: Limit on reading engine stats for ``/metrics``.
_STATS_TIMEOUT_S = 10.0


_StopString = Annotated[str, msgspec.Meta(min_length=1)]


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /v1/completions`` (unknown fields are rejected)."""

    prompt: str | list[Annotated[int, msgspec.Meta(ge=0)]]
    model: str | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None
    stop: _StopString | Annotated[list[_StopString], msgspec.Meta(max_length=16)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    return_token_ids: bool = False
    kv_transfer_params: KVTransferParams | None = None


class _TextStream:
    """Turns sampled token ids into text deltas and cuts the text at stop strings.

    Bytes of a character split over tokens are held until complete. With stop
    strings, the last ``max(len(stop)) - 1`` characters are held back until it is
    clear that no stop string starts there.
    """

    def __init__(self, stop: list[str]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._num_held = max((len(s) for s in stop), default=1) - 1
        self._text = ""
        self._num_sent = 0
        self.stopped = False

    def push(self, token_ids: list[int], final: bool) -> str:
        """Add tokens; return the text that may be sent now (all of it when ``final``)."""
        if self.stopped:
            return ""
        self._text += self._decoder.decode(bytes(t for t in token_ids if t < NUM_BYTE_TOKENS),
                                           final=final)
        hits = [i for i in (self._text.find(s, self._num_sent) for s in self._stop) if i >= 0]
        if hits:
            self._text, self.stopped, final = self._text[: min(hits)], True, True
        end = len(self._text) if final else max(self._num_sent, len(self._text) - self._num_held)
        delta, self._num_sent = self._text[self._num_sent : end], end
        return delta


class _CompletionServer:
    """Request handlers over one engine; owns the server's metrics."""

    def __init__(self, engine: AsyncEngine, model_name: str, max_body_nbytes: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_body_nbytes = max_body_nbytes
        self.metrics = ServerMetrics()
        self.config = engine.engine.config

    def _parse(self, body: bytes) -> CompletionRequest:
        """Decode and check a body.

        Raises:
            ApiError: 400 for a malformed body or bad ``kv_transfer_params``,
                404 for another model.
        """
        try:
            req = msgspec.json.decode(body, type=CompletionRequest)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # a ValidationError is a
            # DecodeError; bytes that are not UTF-8 inside a string raise UnicodeDecodeError
            raise ApiError(400, f"invalid request body: {exc}") from None
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"model {req.model!r} is not served here (serving "
                                f"{self.model_name!r})", "not_found_error")
        params = req.kv_transfer_params
        if params is not None and params.do_remote_prefill:
            missing = params.missing_for_prefill()
            if missing:
                raise ApiError(400, f"kv_transfer_params with do_remote_prefill lack: "
                                    f"{', '.join(missing)}")
        return req

    async def completions(self, request: Request) -> Response:
        start_s = time.monotonic()
        try:
            req = self._parse(await read_body(request, self.max_body_nbytes))
            request_id = f"cmpl-{uuid.uuid4().hex}"
            logger.debug("%s: %s (client id %s)", request_id, "stream" if req.stream else "unary",
                         request.headers.get("x-request-id"))
            prompt_ids = (self.engine.engine.tokenizer.encode(req.prompt)
                          if isinstance(req.prompt, str) else list(req.prompt))
            outputs = cast(AsyncGenerator[RequestOutput, None], self.engine.generate_stream(
                request_id, prompt_ids, _sampling_params(req), req.kv_transfer_params))
            call = _Completion(self, request_id, req, prompt_ids, outputs, start_s)
            response = await unless_client_gone(request, call.start())
        except ApiError as exc:
            response = exc.response()
        except ClientGone:
            self.metrics.num_aborted += 1
            response = Response(status_code=499)
        self.metrics.responses_by_code[str(response.status_code)] += 1
        return response

    async def health(self) -> JSONResponse:
        running = self.engine.is_running
        connector = self.config.connector
        return JSONResponse({
            "status": "ok" if running else "engine stopped",
            "model": self.model_name,
            "role": self.config.role.value,
            "tp_size": self.config.tp_size,
            "engine_id": connector.engine_id if connector is not None else None,
        }, 200 if running else 503)

    async def metrics_page(self) -> Response:
        try:
            stats = await asyncio.wait_for(self.engine.get_stats(), _STATS_TIMEOUT_S)
        except (EngineDeadError, TimeoutError) as exc:
            return ApiError(503, f"engine stats unavailable: {exc}", "server_error").response()
        return Response(self.metrics.exposition(stats), media_type=CONTENT_TYPE)

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "kvbridge"}]})


class _Completion:
    """One ``/v1/completions`` call: collects or streams its engine outputs."""

    def __init__(self, server: _CompletionServer, request_id: str, req: CompletionRequest,
                 prompt_ids: list[int], outputs: AsyncGenerator[RequestOutput, None],
                 start_s: float) -> None:
        self.server = server
        self.request_id = request_id
        self.req = req
        # with return_token_ids: the prompt's ids go with the first body (as vLLM does)
        self.prompt_ids: list[int] | None = prompt_ids if req.return_token_ids else None
        self.outputs = outputs
        self.start_s = start_s
        self.created = int(time.time())
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.text = _TextStream(stop)
        self.token_ids: list[int] = []
        self.finished = False

    async def start(self) -> Response:
        """Run to the first output (so bad requests get a status code), then answer."""
        try:
            first = await anext(self.outputs)
        except BaseException as exc:
            await self.outputs.aclose()  # aborts the engine request, if it started
            if isinstance(exc, InvalidRequestError):
                raise ApiError(400, str(exc)) from None
            if isinstance(exc, EngineDeadError):
                raise ApiError(503, str(exc), "server_error") from None
            raise
        if self.req.stream:
            return ClosingStreamingResponse(self._events(first))
        return await self._collect(first)

    def _add(self, out: RequestOutput) -> tuple[str, list[int]]:
        """Account one output; returns its text delta and token ids."""
        self.token_ids += out.new_token_ids
        delta = self.text.push(out.new_token_ids, final=out.finished)
        self.finished = out.finished or self.text.stopped
        metrics = self.server.metrics
        metrics.num_generation_tokens += len(out.new_token_ids)
        if self.finished:
            metrics.num_prompt_tokens += out.num_prompt_tokens
            if out.ttft_s is not None:
                metrics.ttft_s.observe(out.ttft_s)
            metrics.duration_s.observe(time.monotonic() - self.start_s)
        return delta, out.new_token_ids

    def _body(self, out: RequestOutput, text: str, token_ids: list[int]) -> dict[str, Any]:
        reason: str | None = None
        if self.finished:
            reason = "stop" if self.text.stopped else str(out.finish_reason or FinishReason.STOP)
        body: dict[str, Any] = {
            "id": self.request_id, "object": "text_completion", "created": self.created,
            "model": self.server.model_name,
            "choices": [{"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
                         "finish_reason": reason}],
        }
        if self.prompt_ids is not None:
            body["choices"][0]["prompt_token_ids"], self.prompt_ids = self.prompt_ids, None
        if self.finished:
            num_completion = len(self.token_ids)
            body["usage"] = {"prompt_tokens": out.num_prompt_tokens,
                             "completion_tokens": num_completion,
                             "total_tokens": out.num_prompt_tokens + num_completion}
            params = out.kv_transfer_params
            body["kv_transfer_params"] = params.to_json_dict() if params is not None else None
            body["kvbridge"] = {"num_cached_tokens": out.num_cached_tokens,
                                "num_remote_tokens": out.num_remote_tokens, "ttft_s": out.ttft_s}
        return body

    async def _collect(self, first: RequestOutput) -> Response:
        text = ""
        out = first
        async with contextlib.aclosing(self.outputs):
            while True:
                text += self._add(out)[0]
                if self.finished:
                    break
                out = await anext(self.outputs)
        if out.finish_reason is FinishReason.ERROR:
            raise ApiError(500, f"request failed: {out.error}", "server_error")
        return JSONResponse(self._body(out, text, self.token_ids))

    async def _events(self, first: RequestOutput) -> AsyncGenerator[bytes, None]:
        out = first
        try:
            async with contextlib.aclosing(self.outputs):
                while True:
                    delta, token_ids = self._add(out)
                    if out.finish_reason is FinishReason.ERROR:
                        yield sse_event(error_body(f"request failed: {out.error}",
                                                   "server_error"))
                        break
                    yield sse_event(self._body(out, delta, token_ids))
                    if self.finished:
                        break
                    out = await anext(self.outputs)
        except EngineDeadError as exc:
            yield sse_event(error_body(str(exc), "server_error"))
        finally:
            if not self.finished:
                self.server.metrics.num_aborted += 1
        yield SSE_DONE


def _sampling_params(req: CompletionRequest) -> SamplingParams:
    try:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                              max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def build_app(engine: AsyncEngine, model_name: str | None = None,
              max_body_nbytes: int = DEFAULT_MAX_BODY_NBYTES) -> FastAPI:
    """The HTTP app serving ``engine``.

    Args:
        engine: A running engine; the caller shuts it down after the app stops.
        model_name: Name clients may send as ``model`` (default: the model's name).
        max_body_nbytes: Largest request body accepted.

    Returns:
        A FastAPI (ASGI) app.
    """
    name = model_name or engine.engine.model_config.name
    server = _CompletionServer(engine, name, max_body_nbytes)
    app = FastAPI(title="kvbridge", docs_url=None, redoc_url=None, openapi_url=None)

    add_error_handlers(app)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_page, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.state.completion_server = server
    return app
