"""Poll until something holds or time runs out: the tests' one way to wait.

A test that waits for another thread or process (a read to finish, a grant to be
released, a counter to reach a value) calls :func:`wait_until` instead of a loop
of its own::

    wait_until(lambda: getattr(agent.call("counters"), "num_copy_holds"), 2.0,
               until=lambda num: num == 0, message="copy holds to end")

``probe`` is called until ``until(value)`` is true (by default: until the value
is truthy) and that value is returned. After ``timeout_s`` the test fails with
:class:`WaitTimeout`, naming what was waited for and the last value seen, so a
hung wait says where it stood. Async tests use :func:`wait_until_async`, which
sleeps with ``asyncio.sleep`` and may await ``probe``'s result.

The probe runs at least once, and once more after the deadline passed, so a
slow machine never fails a wait whose condition came true during the last sleep.
A plain probe is not interrupted: one that may block needs a timeout of its own
(the child-process calls of ``tests/child_host.py`` have one).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

__all__ = ["WaitTimeout", "wait_until", "wait_until_async"]

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A wait ran out of time (an ``AssertionError``: the test fails with its message)."""


class _Waiter:
    """One wait's bookkeeping: the deadline, the last value, the failure message."""

    def __init__(self, timeout_s: float, until: Callable[[Any], object],
                 retry_on: tuple[type[Exception], ...]) -> None:
        self.timeout_s = timeout_s
        self.until = until
        self.retry_on = retry_on
        self.deadline = time.monotonic() + timeout_s
        self.seen = False
        self.last: Any = None
        self.last_error: Exception | None = None

    def done(self, value: Any) -> bool:
        self.seen, self.last, self.last_error = True, value, None
        return bool(self.until(value))

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def timed_out(self) -> bool:
        return time.monotonic() > self.deadline

    def failure(self, message: str, describe: Callable[[Any], object]) -> WaitTimeout:
        if self.seen:
            last = f"last value: {describe(self.last)}"
        else:
            last = f"every probe raised, last: {self.last_error!r}"
        return WaitTimeout(f"timed out after {self.timeout_s}s waiting for {message}; {last}")


def wait_until(
    probe: Callable[[], T],
    timeout_s: float,
    *,
    until: Callable[[T], object] = bool,
    interval_s: float = 0.02,
    message: str = "the condition",
    describe: Callable[[T], object] = repr,
    retry_on: tuple[type[Exception], ...] = (),
) -> T:
    """Call ``probe`` every ``interval_s`` until ``until(value)`` holds; return that value.

    Args:
        probe: Looks once (it may also act, e.g. step an engine); returns what it saw.
        timeout_s: How long to keep trying.
        until: Whether a value ends the wait (default: the value is truthy).
        interval_s: Sleep between probes.
        message: What is waited for, for the failure ("grant of r1 to be released").
        describe: Turns the last value into text for the failure (default ``repr``);
            it may look further, e.g. fetch a peer's error log.
        retry_on: Exceptions of ``probe`` that mean "not yet" (e.g. a server not
            listening yet); any other exception ends the wait at once.

    Returns:
        The first value of ``probe`` that ``until`` accepts.

    Raises:
        WaitTimeout: not within ``timeout_s`` (with ``message`` and the last value).
    """
    waiter = _Waiter(timeout_s, until, retry_on)
    while True:
        try:
            value = probe()
        except retry_on as exc:
            waiter.last_error = exc
        else:
            if waiter.done(value):
                return value
        if waiter.timed_out():
            raise waiter.failure(message, describe)
        time.sleep(interval_s)


@overload
async def wait_until_async(
    probe: Callable[[], Awaitable[T]], timeout_s: float, *,
    until: Callable[[T], object] = ..., interval_s: float = ..., message: str = ...,
    describe: Callable[[T], object] = ..., retry_on: tuple[type[Exception], ...] = ...,
) -> T: ...


@overload
async def wait_until_async(
    probe: Callable[[], T], timeout_s: float, *,
    until: Callable[[T], object] = ..., interval_s: float = ..., message: str = ...,
    describe: Callable[[T], object] = ..., retry_on: tuple[type[Exception], ...] = ...,
) -> T: ...


async def wait_until_async(
    probe: Callable[[], Any],
    timeout_s: float,
    *,
    until: Callable[[Any], object] = bool,
    interval_s: float = 0.01,
    message: str = "the condition",
    describe: Callable[[Any], object] = repr,
    retry_on: tuple[type[Exception], ...] = (),
) -> Any:
    """:func:`wait_until` for a coroutine: sleeps with ``asyncio.sleep``, awaits ``probe``.

    ``probe`` may be a plain function or a coroutine function; the event loop
    runs between probes (what is waited for often happens on it). An awaited
    probe still running when the time is up is cancelled and the wait fails.
    """
    waiter = _Waiter(timeout_s, until, retry_on)
    while True:
        try:
            value = probe()
            if inspect.isawaitable(value):
                try:
                    async with asyncio.timeout(max(waiter.remaining_s(), interval_s)):
                        value = await value
                except TimeoutError:
                    raise WaitTimeout(f"timed out after {timeout_s}s waiting for {message}; "
                                      f"the last probe did not return") from None
        except retry_on as exc:
            waiter.last_error = exc
        else:
            if waiter.done(value):
                return value
        if waiter.timed_out():
            raise waiter.failure(message, describe)
        await asyncio.sleep(interval_s)
