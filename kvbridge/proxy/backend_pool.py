"""One role's backends for the P/D proxy: round robin that skips unhealthy ones.

``kvbridge/proxy/app.py`` keeps one :class:`BackendPool` for its prefill and one for
its decode instances and sends every backend call through :meth:`BackendPool.post`
(``/v1/completions``, ``/v1/chat/completions``) or :meth:`BackendPool.get` (``/v1/models``).
A backend that says the server itself cannot serve is marked down for a
back-off: it could not be reached (connection refused, reset or dropped), did
not answer within the time limit, or answered 502, 503 or 504 (vLLM's
``/health`` answers 503 once its engine is dead; a gateway in front of a
backend answers 502 or 504). Round robin passes over it while the mark runs
and another backend of the role is usable. Any other 5xx (vLLM's 500 for one
request, e.g. a KV load that failed under ``kv_load_failure_policy`` "fail")
fails that request only and says nothing about the server: no mark. A down
backend gets no request before its ``/health`` answers 200: probed when its
back-off has run out, or at once when no other backend is left (a restarted
instance then serves without waiting)::

    healthy --unreachable, time-out, 502/503/504--> down (skipped)
       ^                                              |
       |                       back-off over, or no one else left
       |                                              v
       +------------------ ok ------------------ probe /health
                                                      | not ok
                                                      v
                                            down (a new back-off)

A call whose connection failed is retried once on another backend of the
role: for prefill and for a GET whenever no answer came (the client has received
nothing yet), for a decode only when the connection never opened (D cannot
have used P's blocks). Imports no torch (the proxy starts in a fraction of a second).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvbridge.http_common import ApiError

__all__ = ["BackendFailed", "BackendPool", "ClientErrorAnswer", "NoBackendError", "error_text",
           "is_lost_connection"]

logger = logging.getLogger(__name__)

#: Failures that leave no answer: the backend is marked down and the call may be retried.
_LOST_CONNECTION = (httpx.ConnectError, httpx.ConnectTimeout, httpx.NetworkError,
                    httpx.RemoteProtocolError)
#: Failures before the connection opened: the backend never saw the request.
_NOT_CONNECTED = (httpx.ConnectError, httpx.ConnectTimeout)
#: Answers that speak for the server, not for one request: the backend is marked down.
_UNAVAILABLE = frozenset({502, 503, 504})


class NoBackendError(Exception):
    """No backend of a role may be used now (the message says why, per backend)."""


class ClientErrorAnswer(Exception):
    """A backend answered 4xx (the client's mistake); ``response`` is read whole."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"backend answered {response.status_code}")
        self.response = response


class BackendFailed(ApiError):
    """A 502 for the client: the backend at ``url`` (a base URL) failed this call."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(502, message, "bad_gateway")
        self.url = url


class _Failed(Exception):
    """A call ended without an answer; ``opened``: the connection had been made."""

    def __init__(self, message: str, opened: bool) -> None:
        super().__init__(message)
        self.opened = opened


def is_lost_connection(exc: BaseException) -> bool:
    """True for a failure that says the backend is gone (refused, reset, dropped)."""
    return isinstance(exc, _LOST_CONNECTION)


def error_text(response: httpx.Response) -> str:
    """The message of an OpenAI-style error answer, else the start of its text."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


@dataclass(frozen=True, slots=True)
class _Down:
    until_s: float
    reason: str


class BackendPool:
    """Round robin over one role's base URLs, remembering which are down.

    Args:
        role: ``prefill`` or ``decode``; used in messages.
        urls: Base URLs, at least one.
        client: Pooled connections to the backends (owned by the caller).
        backoff_s: How long a failed backend is skipped before it is probed again.
        health_timeout_s: Limit on one ``/health`` probe.
        clock: Monotonic seconds (tests may pass their own).

    Raises:
        ValueError: no URLs, or a limit that is not positive.
    """

    def __init__(self, role: str, urls: Sequence[str], client: httpx.AsyncClient,
                 backoff_s: float, health_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ValueError(f"{role}: a backend pool needs at least one URL")
        if not (backoff_s > 0 and health_timeout_s > 0):
            raise ValueError(f"{role}: backoff_s and health_timeout_s must be > 0, got "
                             f"{backoff_s} and {health_timeout_s}")
        self.role = role
        self.urls = tuple(urls)
        self.backoff_s = backoff_s
        self.health_timeout_s = health_timeout_s
        self._client = client
        self._clock = clock
        self._cursor = 0
        self._down: dict[str, _Down] = {}

    def mark_down(self, url: str, reason: str) -> None:
        """Skip ``url`` for the back-off from now on (restarted if already down)."""
        if url not in self._down:
            logger.warning("%s %s marked unhealthy for %.1f s: %s", self.role, url,
                           self.backoff_s, reason)
        self._down[url] = _Down(self._clock() + self.backoff_s, reason)

    def mark_up(self, url: str) -> None:
        """Use ``url`` again at once."""
        if self._down.pop(url, None) is not None:
            logger.info("%s %s is healthy again", self.role, url)

    def is_down(self, url: str) -> bool:
        """True while ``url`` is marked down (also when its back-off is over but unprobed)."""
        return url in self._down

    def any_usable(self, exclude: Collection[str] = ()) -> bool:
        """True when some backend not in ``exclude`` is healthy or due for a probe."""
        now = self._clock()
        return any(not self._in_backoff(url, now) for url in self.urls if url not in exclude)

    async def pick(self, exclude: Collection[str] = (), advance: bool = True) -> str:
        """The next usable backend in round-robin order.

        A backend in back-off is passed over while another one is usable; when
        none is, those in back-off are probed too, so a restarted backend serves
        at once instead of after its back-off.

        Args:
            exclude: URLs not to pick (e.g. one that just failed this request).
            advance: Move the round-robin cursor past the pick (``False``: only check
                that some backend is usable).

        Returns:
            A base URL.

        Raises:
            NoBackendError: every backend is excluded, down or failed its probe.
        """
        num_urls = len(self.urls)
        order = [(self._cursor + offset) % num_urls for offset in range(num_urls)]
        order = [i for i in order if self.urls[i] not in exclude]
        now = self._clock()
        in_backoff = [i for i in order if self._in_backoff(self.urls[i], now)]
        for index in [i for i in order if i not in in_backoff] + in_backoff:
            url = self.urls[index]
            if url in self._down:  # ask before sending it a request
                problem = await self.probe(url)
                if problem is not None:
                    self.mark_down(url, f"health check: {problem}")
                    continue
                self.mark_up(url)
            if advance:
                self._cursor = index + 1
            return url
        raise NoBackendError(self.describe_unusable(exclude))

    def describe_unusable(self, exclude: Collection[str] = ()) -> str:
        """Why no backend may be used, one clause per backend."""
        now = self._clock()
        reasons = []
        for url in self.urls:
            down = self._down.get(url)
            if down is not None:
                left_s = max(0.0, down.until_s - now)
                reasons.append(f"{url}: {down.reason} (skipped for {left_s:.1f} s more)")
            elif url in exclude:
                reasons.append(f"{url}: already tried for this request")
        return f"no {self.role} backend is usable: " + "; ".join(reasons)

    def _in_backoff(self, url: str, now: float) -> bool:
        down = self._down.get(url)
        return down is not None and now < down.until_s

    async def probe(self, url: str) -> str | None:
        """``GET {url}/health``: ``None`` when it answers 200, else what went wrong."""
        limit_s = self.health_timeout_s
        try:
            async with asyncio.timeout(limit_s):
                response = await self._client.get(f"{url}/health")
        except TimeoutError:
            return f"no answer within {limit_s} s"
        except httpx.HTTPError as exc:
            return repr(exc)
        return None if response.status_code == 200 else error_text(response)

    async def post(self, body: dict[str, Any], request_id: str, timeout_s: float,
                   stream: bool, path: str = "/v1/completions", exclude: Collection[str] = ()
                   ) -> tuple[httpx.Response, str]:
        """POST ``body`` to ``path`` of the next usable backend not in ``exclude``.

        Retried once on another backend as the module docstring says. A streamed
        answer is returned unread (the caller closes it).

        Returns:
            The 2xx answer and the base URL of the backend that gave it.

        Raises:
            ApiError: 503 when no backend of the role is usable.
            BackendFailed: a failure, a time-out or a 5xx answer.
            ClientErrorAnswer: a 4xx answer.
        """
        return await self._call("POST", path, body, request_id, timeout_s, stream, exclude)

    async def get(self, path: str, request_id: str, timeout_s: float
                  ) -> tuple[httpx.Response, str]:
        """GET ``path`` of the next usable backend, read whole; as :meth:`post`, but
        retried once on another backend after any lost connection (it changes nothing)."""
        return await self._call("GET", path, None, request_id, timeout_s, False)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None,
                    request_id: str, timeout_s: float, stream: bool, exclude: Collection[str] = ()
                    ) -> tuple[httpx.Response, str]:
        tried = list(exclude)
        for attempt in range(2):
            try:
                url = await self.pick(exclude=tried)
            except NoBackendError as exc:
                raise ApiError(503, str(exc), "service_unavailable") from None
            tried.append(url)
            try:
                request = self._client.build_request(method, f"{url}{path}", json=body,
                                                     headers={"x-request-id": request_id})
                return await self._send(url, request, timeout_s, stream), url
            except _Failed as exc:
                may_retry = self.role == "prefill" or method == "GET" or not exc.opened
                if attempt == 0 and may_retry and any(u not in tried for u in self.urls):
                    logger.warning("%s: %s; retrying on another %s backend", request_id, exc,
                                   self.role)
                    continue
                if not self.any_usable(exclude=exclude):
                    raise ApiError(503, self.describe_unusable(exclude),
                                   "service_unavailable") from None
                raise BackendFailed(str(exc), url) from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _send(self, base_url: str, request: httpx.Request, timeout_s: float,
                    stream: bool) -> httpx.Response:
        """One call within ``timeout_s``; marks the backend down as the module docstring says.

        Raises:
            _Failed: no answer (connection refused, dropped or reset).
            BackendFailed: a time-out, another failure or a 5xx answer.
            ClientErrorAnswer: a 4xx answer.
        """
        url = str(request.url)
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._client.send(request, stream=stream)
        except TimeoutError:
            message = f"{self.role} {url} did not answer within {timeout_s} s"
            self.mark_down(base_url, message)
            raise BackendFailed(message, base_url) from None
        except httpx.HTTPError as exc:
            message = f"{self.role} {url} failed: {exc!r}"
            if not is_lost_connection(exc):
                raise BackendFailed(message, base_url) from None
            self.mark_down(base_url, message)
            raise _Failed(message, opened=not isinstance(exc, _NOT_CONNECTED)) from None
        if response.status_code < 400:
            return response
        if stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        if response.status_code < 500:
            raise ClientErrorAnswer(response)
        message = f"{self.role} {url} answered {response.status_code}: {error_text(response)}"
        if response.status_code in _UNAVAILABLE:
            self.mark_down(base_url, message)
        raise BackendFailed(message, base_url)
