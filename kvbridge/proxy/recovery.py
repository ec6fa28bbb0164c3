"""The rest of a first-token answer after P's token: D, and another backend when D fails.

``app.py`` hands a :class:`Continuer` each first-token request whose token
the client has (or will have) from P (``first_token.py``). D is asked for the
rest with P's ``kv_transfer_params``. When D then fails — its connection is
refused, reset or silent, it answers 5xx, its stream carries an error event,
ends early, or its answer is not a completion — the client, who holds P's
token (and maybe some of D's), would otherwise get an error. Instead the rest
is asked for again, without P's params, from where the client's tokens end
(``first_token.continuation_body``; ``continuation.py`` keeps what the client
holds)::

    D (P's params) --fails--> another D, or the same one if it is the only one
                              (no params: it computes the prompt and the answer's
                              tokens so far, then continues) --fails--> a P (the same)

Each backend continues from the tokens the client already has, as it would
after sampling them itself: a greedy answer is token for token what D would
have sent. A copy whose tokens differ from what the client holds
is dropped (``continuation.StreamBroken``), never sent on. The client gets an
error only when no backend could finish; each copy sent again and each answer
left unfinished is counted (``metrics.ProxyMetrics``). D refusing the request
(4xx: the client's mistake) is passed on as before, and P's blocks let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import httpx

from kvbridge.http_common import SSE_DONE, ApiError, error_body, sse_event
from kvbridge.proxy import first_token
from kvbridge.proxy.backend_pool import (
    BackendFailed,
    BackendPool,
    ClientErrorAnswer,
    is_lost_connection,
)
from kvbridge.proxy.continuation import DeliveredStream, StreamBroken
from kvbridge.proxy.metrics import ProxyMetrics

__all__ = ["Continuer"]

logger = logging.getLogger(__name__)

#: Asks D in the background to read P's blocks and let them go: (D's body, request id).
Release = Callable[[dict[str, Any], str], None]


class _LegFailed(Exception):
    """One backend's part of the answer ended in a failure; ``url``: the backend's."""

    def __init__(self, message: str, url: str | None) -> None:
        super().__init__(message)
        self.url = url


class Continuer:
    """Asks for the rest of first-token answers, and again elsewhere when D fails.

    Args:
        decode_pool: The D backends.
        prefill_pool: The P backends (the last resort).
        timeout_s: Limit on a non-streamed call, and on a stream until its first byte.
        read_timeout_s: Longest silence within a stream.
        metrics: Where copies sent again and unfinished answers are counted.
        release: See :data:`Release`.
    """

    def __init__(self, decode_pool: BackendPool, prefill_pool: BackendPool, timeout_s: float,
                 read_timeout_s: float, metrics: ProxyMetrics, release: Release) -> None:
        self._decode_pool = decode_pool
        self._prefill_pool = prefill_pool
        self._timeout_s = timeout_s
        self._read_timeout_s = read_timeout_s
        self._metrics = metrics
        self._release = release

    async def answer(self, body: dict[str, Any], first: first_token.FirstToken,
                     params: dict[str, Any] | None, request_id: str) -> dict[str, Any]:
        """The whole (non-streamed) answer: P's token, then the rest.

        Raises:
            ClientErrorAnswer: D refused the request (4xx).
            ApiError: 502 when neither D nor P could give the rest.
        """
        failures: list[str] = []
        failed_url: str | None = None
        for leg in range(3):
            leg_params = params if leg == 0 else None
            pool = self._pool_of(leg, failures, request_id)
            try:
                response, url = await pool.post(
                    first_token.decode_body(body, first, leg_params), request_id,
                    self._timeout_s, False, exclude=self._exclude(leg, failed_url))
            except ClientErrorAnswer as exc:
                if leg == 0:
                    if params is not None:  # D refused it: P holds the prompt for nobody
                        self._release(first_token.release_body(body, first, params), request_id)
                    raise
                failures.append(f"{pool.role} refused: {exc.response.text[:200]}")
                continue
            except ApiError as exc:
                failures.append(str(exc))
                failed_url = exc.url if isinstance(exc, BackendFailed) else failed_url
                continue
            try:
                d_answer: object = response.json()
            except ValueError:
                d_answer = None
            if _is_completion(d_answer):
                assert isinstance(d_answer, dict)
                return first_token.merge_answer(body, first, d_answer)
            failures.append(f"{pool.role} {url} answered something other than a completion: "
                            f"{response.text[:200]!r}")
            failed_url = url
        self._metrics.num_unfinished += 1
        raise ApiError(502, _unfinished(failures), "bad_gateway")

    async def stream(self, body: dict[str, Any], first: first_token.FirstToken,
                     params: dict[str, Any] | None, request_id: str
                     ) -> AsyncGenerator[bytes, None]:
        """P's token as the first event, then the rest as it comes, from one leg or more."""
        delivered = DeliveredStream(body, first)
        failures: list[str] = []
        failed_url: str | None = None
        asked_d = refused = False
        try:
            yield sse_event(first_token.first_event(body, first))
            for leg in range(3):
                point = delivered.resume_point()
                if leg > 0 and point is None:
                    failures.append("the answer so far ends inside a character and is "
                                    "sampled: no backend can continue it as it is")
                    break
                pool = self._pool_of(leg, failures, request_id)
                if leg == 0:
                    leg_body = first_token.decode_body(body, first, params)
                else:
                    assert point is not None
                    delivered.start_leg(point)
                    leg_body = first_token.continuation_body(body, first, point.done_ids)
                try:
                    asked_d = True
                    response, url = await pool.post(leg_body, request_id, self._timeout_s, True,
                                                    exclude=self._exclude(leg, failed_url))
                except ClientErrorAnswer as exc:
                    if leg == 0:
                        refused = True
                        message = f"decode refused the continuation: {exc.response.text[:300]}"
                        yield sse_event(error_body(message, "bad_gateway")) + SSE_DONE
                        return
                    failures.append(f"{pool.role} refused: {exc.response.text[:200]}")
                    continue
                except ApiError as exc:
                    failures.append(str(exc))
                    failed_url = exc.url if isinstance(exc, BackendFailed) else failed_url
                    continue
                try:
                    async with contextlib.aclosing(
                            self._relay(response, url, pool, delivered)) as events:
                        async for chunk in events:
                            yield chunk
                    return
                except _LegFailed as exc:
                    failures.append(str(exc))
                    failed_url = exc.url
                if delivered.finished:  # the client holds the whole answer
                    for event in delivered.tail():
                        yield sse_event(event)
                    yield SSE_DONE
                    return
            self._metrics.num_unfinished += 1
            yield sse_event(error_body(_unfinished(failures), "bad_gateway")) + SSE_DONE
        finally:
            # the client left after P's token (D never asked), or D refused: D reads
            # nothing, so P's blocks go now rather than at the end of their lease
            if (refused or not asked_d) and params is not None:
                self._release(first_token.release_body(body, first, params), request_id)

    def _pool_of(self, leg: int, failures: list[str], request_id: str) -> BackendPool:
        """The pool of ``leg`` (0: D with P's params; 1: a D again; 2: a P), counting the
        copies sent again."""
        if leg == 0:
            return self._decode_pool
        pool = self._decode_pool if leg == 1 else self._prefill_pool
        logger.warning("%s: the rest of the answer goes to a %s, after: %s", request_id,
                       pool.role, failures[-1] if failures else "?")
        self._metrics.num_resent[pool.role] += 1
        return pool

    def _exclude(self, leg: int, failed_url: str | None) -> tuple[str, ...]:
        """Backends not to ask on ``leg``: the D that failed, while another D is usable."""
        if leg == 1 and failed_url is not None and self._decode_pool.any_usable(
                exclude=(failed_url,)):
            return (failed_url,)
        return ()

    async def _relay(self, response: httpx.Response, url: str, pool: BackendPool,
                     delivered: DeliveredStream) -> AsyncGenerator[bytes, None]:
        """One leg's events, rewritten for the client, up to and with ``[DONE]``.

        Raises:
            _LegFailed: the leg broke, went silent, sent an error or a bad event, or
                ended before the answer did.
        """
        limit_s = self._read_timeout_s
        chunks = response.aiter_bytes()
        pending = b""
        where = f"{pool.role} {url}"
        try:
            while True:
                try:
                    async with asyncio.timeout(limit_s):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    raise _LegFailed(f"{where} ended its stream before [DONE]", url) from None
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for raw in events:
                    if raw == SSE_DONE.strip():
                        if not delivered.finished:
                            raise _LegFailed(f"{where} ended before the answer did", url)
                        yield SSE_DONE
                        return
                    out = _rewrite(raw, delivered, where, url)
                    if out is not None:
                        yield out
        except (httpx.HTTPError, TimeoutError) as exc:
            reason = f"silent for {limit_s} s" if isinstance(exc, TimeoutError) else repr(exc)
            if isinstance(exc, TimeoutError) or is_lost_connection(exc):
                pool.mark_down(url, f"stream broke: {reason}")
            raise _LegFailed(f"{where} failed mid-stream: {reason}", url) from None
        finally:
            await response.aclose()


def _rewrite(raw: bytes, delivered: DeliveredStream, where: str, url: str) -> bytes | None:
    """One SSE event of a leg as the client gets it (None: nothing to send)."""
    if not raw.startswith(b"data: "):
        return raw + b"\n\n"  # a comment or a field without data: nothing to rewrite
    try:
        event: object = json.loads(raw[6:])
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise _LegFailed(f"{where} sent an event that is not a JSON object: {raw[:200]!r}", url)
    try:
        out = delivered.accept(event)
    except StreamBroken as exc:
        raise _LegFailed(f"{where} sent {exc}", url) from None
    return None if out is None else sse_event(out)


def _is_completion(answer: object) -> bool:
    """A completion answer with one choice and its text."""
    if not isinstance(answer, dict):
        return False
    choices = answer.get("choices")
    return (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)
            and isinstance(choices[0].get("text"), str))


def _unfinished(failures: list[str]) -> str:
    return ("after P's first token no backend could give the rest of the answer: "
            + "; then ".join(failures))
