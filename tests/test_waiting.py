"""The tests' one wait helper (``tests/waiting.py``): returns, retries and fails as documented."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.waiting import WaitTimeout, wait_until, wait_until_async


def test_returns_the_first_accepted_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter), 5.0, until=lambda n: n >= 3, interval_s=0) == 3


def test_a_timeout_names_what_was_awaited_and_the_last_value() -> None:
    with pytest.raises(WaitTimeout, match=r"waiting for the answer; last value: 'no'"):
        wait_until(lambda: "no", 0.05, until=lambda v: v == "yes", interval_s=0.01,
                   message="the answer")


def test_listed_exceptions_mean_not_yet_and_others_end_the_wait() -> None:
    attempts = iter([ConnectionError("down"), ConnectionError("down"), "up"])

    def probe() -> str:
        item = next(attempts)
        if isinstance(item, Exception):
            raise item
        return item

    assert wait_until(probe, 5.0, interval_s=0, retry_on=(ConnectionError,)) == "up"
    with pytest.raises(WaitTimeout, match="every probe raised"):
        wait_until(lambda: 1 / 0, 0.05, interval_s=0.01, retry_on=(ZeroDivisionError,))
    with pytest.raises(ZeroDivisionError):
        wait_until(lambda: 1 / 0, 5.0)


def test_the_async_twin_awaits_probes_and_cancels_one_that_hangs() -> None:
    async def main() -> None:
        counter = itertools.count()

        async def probe() -> int:
            await asyncio.sleep(0)
            return next(counter)

        assert await wait_until_async(probe, 5.0, until=lambda n: n == 2, interval_s=0) == 2

        async def hangs() -> int:
            await asyncio.sleep(60)
            return 0

        with pytest.raises(WaitTimeout, match="did not return"):
            await wait_until_async(hangs, 0.05)

    asyncio.run(main())
