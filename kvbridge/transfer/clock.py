"""Clocks for leases and deadlines, passed explicitly to whoever needs time.

The grant table (``serving/grants.py``) and the transfer agent read time only through a
``Clock``, never through ``time`` directly, so tests drive leases and deadlines
by hand instead of sleeping. Time is monotonic seconds: it never jumps when the
wall clock is adjusted, and it means nothing outside the process that read it
(send a *duration* to a peer, never a ``now()`` value).

Example::

    from kvbridge.transfer.clock import ManualClock, MonotonicClock

    clock = MonotonicClock()          # production: time.monotonic()
    deadline = clock.now() + 5.0

    test_clock = ManualClock(start=100.0)
    test_clock.advance(2.5)
    assert test_clock.now() == 102.5
"""

from __future__ import annotations

import math
import time
from typing import Protocol


class Clock(Protocol):
    """Source of monotonic time in seconds."""

    def now(self) -> float:
        """Return the current monotonic time in seconds."""
        ...


class MonotonicClock:
    """The process's monotonic clock (``time.monotonic``)."""

    def now(self) -> float:
        """Return ``time.monotonic()``."""
        return time.monotonic()


class ManualClock:
    """A clock that moves only when a test calls ``advance``.

    Args:
        start: the initial reading in seconds.

    Raises:
        ValueError: ``start`` is not finite.
    """

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"ManualClock start must be finite, got {start}")
        self._now = float(start)

    def now(self) -> float:
        """Return the current reading."""
        return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward.

        Args:
            seconds: how far to move; ``0`` is allowed.

        Returns:
            The new reading.

        Raises:
            ValueError: ``seconds`` is negative or not finite (the clock is monotonic).
        """
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"ManualClock can only advance by a finite amount >= 0, got {seconds}")
        self._now += seconds
        return self._now
