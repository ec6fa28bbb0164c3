"""How staged packs and unpacks run and end (``transfer/blocks/launching.py``), unit by unit.

The CUDA event of a "loop" launch is stood in for by an object with ``query``
(what ``watch`` polls); the thread's launches run on a real one-thread executor.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvbridge.kernels import KernelInputError
from kvbridge.transfer.blocks.launching import ended, launch, watch

CPU = torch.zeros(8, dtype=torch.uint8)


class Counted:
    """Passes at its ``passes_at``-th query (a CUDA event on a device at work)."""

    def __init__(self, passes_at: int, error: Exception | None = None) -> None:
        self.passes_at, self.error, self.num_queries = passes_at, error, 0

    def query(self) -> bool:
        self.num_queries += 1
        if self.error is not None:
            raise self.error
        return self.num_queries >= self.passes_at


def test_a_watched_event_resolves_once_it_passed_and_not_before() -> None:
    async def run() -> None:
        event = Counted(passes_at=50)  # past the spin: some polls are timed ones
        await asyncio.wait_for(watch(event), 5.0)
        assert event.num_queries == 50

    asyncio.run(run())


def test_a_watch_given_up_stops_polling_and_a_device_error_fails_it() -> None:
    async def run() -> None:
        event = Counted(passes_at=10**9)
        watched = watch(event)
        await asyncio.sleep(0.01)
        watched.cancel()
        await asyncio.sleep(0.01)
        seen = event.num_queries
        await asyncio.sleep(0.01)
        assert 0 < seen == event.num_queries
        with pytest.raises(RuntimeError, match="illegal address"):
            await watch(Counted(1, RuntimeError("an illegal address")))

    asyncio.run(run())


def test_a_loop_launch_on_cpu_is_done_when_it_returns() -> None:
    async def run() -> None:
        out = torch.zeros(4)

        def fill(value: float) -> None:
            out.fill_(value)

        done = launch("loop", ThreadPoolExecutor(1), CPU, fill, 2.0)
        assert done.over and done.queued is None and torch.equal(out, torch.full((4,), 2.0))

        def bad() -> None:
            raise KernelInputError("block_ids span [0, 99]")

        failed = launch("loop", ThreadPoolExecutor(1), CPU, bad)
        assert failed.over
        with pytest.raises(KernelInputError, match="span"):
            await failed.finished

    asyncio.run(run())


def test_a_cancelled_wait_lets_the_thread_copy_end_and_drops_one_not_begun() -> None:
    """What a staged read does when cancelled: the copy under way ends first,
    the one queued behind it never runs."""
    executor = ThreadPoolExecutor(1)
    release, ran = threading.Event(), []

    def running() -> None:
        release.wait(5.0)
        ran.append("running")

    async def run() -> None:
        first = launch("thread", executor, CPU, running)
        second = launch("thread", executor, CPU, ran.append, "queued")
        waiter = asyncio.create_task(ended(first))
        await asyncio.sleep(0.05)
        waiter.cancel()
        await asyncio.sleep(0.05)
        assert not waiter.done()  # still waiting for the copy under way
        assert second.withdraw() and second.over  # never begun: dropped
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert first.over

    asyncio.run(run())
    executor.shutdown(wait=True)
    assert ran == ["running"]
