"""How a staged chunk's pack or unpack runs, and how the agent's loop learns it ended.

Used by both halves of a staged read: ``serving/staged.py`` packs each chunk
into a staging buffer before UCX sends it, ``reading/staged.py`` unpacks each
chunk received before its buffer takes another. Two ways
(``AgentConfig.staged_launch``, resolved by :func:`launch_mode`)::

    thread  the agent's copy thread runs the kernel and waits for the device
            (``kernels.on_device``); the loop awaits the thread's future.
    loop    the loop's own thread launches the kernel (no thread hop, no
            wait) and records a CUDA event after it; the loop polls the event
            (``_EventWatch``) while its other tasks go on. On CPU tensors the
            copy is done when the call returns, having held the loop meanwhile,
            which is why "auto" picks "thread" for CPU caches.

Either way the caller gets a :class:`Launch`, whose ``finished`` future
resolves once nothing of the work writes any more (or fails with its error).
Only a thread's work can wait to begin (behind another in the copy thread's
queue); ``Launch.withdraw`` drops it then. A kernel launched on the loop has
begun: the device writes until its event passes, whoever still waits.

Everything here is called on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Literal, ParamSpec, Protocol

import torch

from kvbridge.kernels import on_device
from kvbridge.transfer.agent_config import StagedLaunch

__all__ = [
    "Completion", "Launch", "LaunchMode", "ended", "launch", "launch_mode", "retrieved", "watch",
]

LaunchMode = Literal["thread", "loop"]
P = ParamSpec("P")

# Polling a CUDA event from the loop: callbacks back to back (as the UCX driver's
# spin, ``ucx/worker.py``) for _SPIN_S, which covers one chunk's kernel on an idle
# device (~50 us for 16 MiB on an H200), then timed ones, doubling from
# _FIRST_SLEEP_S up to _MAX_SLEEP_S, for a device busy with other work. The
# selector rounds a wait up to a millisecond when nothing else wakes the loop.
_SPIN_S = 200e-6
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 500e-6


def launch_mode(setting: StagedLaunch, device: torch.device) -> LaunchMode:
    """The way to run kernels on ``device``'s tensors: ``setting``, with "auto" resolved."""
    if setting == "auto":
        return "loop" if device.type == "cuda" else "thread"
    return setting


class Completion(Protocol):
    """What :func:`watch` polls: ``torch.cuda.Event`` (``query``: the device passed it)."""

    def query(self) -> bool: ...


@dataclass(eq=False, slots=True)
class Launch:
    """One pack or unpack begun by :func:`launch`.

    Attributes:
        finished: resolved once the work writes no more; fails with its error.
            Awaiting it directly lets a cancel through to it (a thread's work
            not begun is then dropped; the loop's kernel runs on, unwatched).
        queued: a thread's work, which may not have begun (None: the loop's).
    """

    finished: asyncio.Future[None]
    queued: concurrent.futures.Future[None] | None = None

    @property
    def over(self) -> bool:
        """Nothing of it writes any more (ended, failed, or dropped before it began)."""
        return self.finished.done() or (self.queued is not None and self.queued.done())

    def withdraw(self) -> bool:
        """Drop the work if it has not begun; True when it writes no more."""
        if self.queued is not None:
            self.queued.cancel()  # False once running: it ends by itself
        return self.over


def launch(
    mode: LaunchMode, executor: Executor, on: torch.Tensor, work: Callable[P, None],
    *args: P.args, **kwargs: P.kwargs,
) -> Launch:
    """Start ``work(*args, **kwargs)``, a kernel call on ``on``'s device, the ``mode`` way.

    Returns at once (``"thread"``), or once the kernel is queued (``"loop"``, CUDA)
    or done (``"loop"``, CPU). An error ``work`` raises fails ``finished``, as
    it would on the thread. Must be called on the running loop.
    """
    call = functools.partial(work, *args, **kwargs)
    if mode == "thread":
        queued = executor.submit(_waited, on, call)
        return Launch(asyncio.wrap_future(queued), queued)
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    try:
        event = _run_here(on, call)
    except Exception as exc:  # the work's outcome, as a thread's future would hold it
        finished.set_exception(exc)
        return Launch(finished)
    if event is None:
        finished.set_result(None)
    else:
        loop.call_soon(_EventWatch(loop, event, finished))
    return Launch(finished)


def watch(event: Completion) -> asyncio.Future[None]:
    """A future of the running loop resolved once ``event.query()`` says True.

    Polled as a CUDA event after a launch (module docstring); cancelling the
    future stops the polling.
    """
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    loop.call_soon(_EventWatch(loop, event, finished))
    return finished


async def ended(launch: Launch) -> None:
    """Wait for ``launch`` to end; cancelled meanwhile, wait on until it writes no more.

    A thread's work that has not begun is dropped; work under way (a thread's
    copy, a kernel on the device) is waited for. Then the cancel goes on.

    Raises:
        Exception: the work's own error.
        asyncio.CancelledError: cancelled (after the work stopped writing; a
            second cancel of the wait stops waiting: check ``Launch.over``).
    """
    try:
        await asyncio.shield(launch.finished)
    except asyncio.CancelledError:
        launch.finished.add_done_callback(retrieved)
        if not launch.withdraw():
            await asyncio.wait([launch.finished])
        raise


def retrieved(future: asyncio.Future[None]) -> None:
    """A launch nobody awaits any more: its error is not news."""
    if not future.cancelled():
        future.exception()


def _waited(on: torch.Tensor, work: Callable[[], None]) -> None:
    with on_device(on):  # done on the device before the loop hears of it
        work()


def _run_here(on: torch.Tensor, work: Callable[[], None]) -> torch.cuda.Event | None:
    """Run ``work`` on this thread; for CUDA tensors, the event that marks its end."""
    if not on.is_cuda:
        work()
        return None
    with torch.cuda.device(on.device):
        work()
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()  # the current stream: where ``work`` queued its kernels
    return event


class _EventWatch:
    """Polls an event from the loop (a callback that reschedules itself) until it passed."""

    __slots__ = ("_event", "_finished", "_loop", "_sleep_s", "_spin_until")

    def __init__(self, loop: asyncio.AbstractEventLoop, event: Completion,
                 finished: asyncio.Future[None]) -> None:
        self._loop, self._event, self._finished = loop, event, finished
        self._spin_until = time.perf_counter() + _SPIN_S
        self._sleep_s = _FIRST_SLEEP_S

    def __call__(self) -> None:
        if self._finished.done():  # its waiter gave up: nobody to tell
            return
        try:
            passed = self._event.query()
        except Exception as exc:  # a device error: the work's outcome
            self._finished.set_exception(exc)
            return
        if passed:
            self._finished.set_result(None)
        elif time.perf_counter() < self._spin_until:
            self._loop.call_soon(self)
        else:
            self._loop.call_later(self._sleep_s, self)
            self._sleep_s = min(2 * self._sleep_s, _MAX_SLEEP_S)
