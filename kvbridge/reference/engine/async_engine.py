"""``AsyncEngine``: an ``LLMEngine`` stepped by a background thread, for asyncio callers.

The HTTP server calls :meth:`AsyncEngine.generate_stream` per request and
iterates the outputs; the engine thread owns the ``LLMEngine`` (nothing else
touches it): it takes new requests and aborts from an inbox, steps while there
is work (requests, or blocks held for remote readers), and hands each output to
the request's asyncio queue on the caller's event loop. A stream closed early
(client gone) aborts its request.

While only KV transfers are in flight a step has nothing to run, so the thread
sleeps on the engine's ``Wakeup`` until a worker's transfer agent reports an
ended read or a released grant (or a new request arrives), stepping at once
then; a slow periodic step is only the safety net.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from kvbridge.errors import KVBridgeError
from kvbridge.reference.engine.engine import EngineStats, InvalidRequestError, LLMEngine
from kvbridge.reference.engine.engine_config import EngineConfig
from kvbridge.reference.engine.request import EngineRequest, RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError"]

logger = logging.getLogger(__name__)

#: Waits of the engine thread after steps that ran nothing (only transfers in flight):
#: workers wake it when a transfer ends, so these only bound a missed wake-up.
_MIN_IDLE_WAIT_S = 0.001
_MAX_IDLE_WAIT_S = 0.05
#: Wait of the engine thread when it has no work at all (woken by new requests).
_SLEEP_WAIT_S = 0.1


class EngineDeadError(KVBridgeError, RuntimeError):
    """The engine thread stopped (shutdown or a worker failure); no request can run."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Runs an ``LLMEngine`` in a thread and streams outputs to asyncio tasks.

    Args:
        config: Engine configuration (the engine and its workers start here).

    Raises:
        ConfigError, WorkerError: as ``LLMEngine``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._lock = threading.Lock()
        self._inbox: deque[Callable[[], None]] = deque()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = self.engine.wakeup  # set by _post and by the workers' agents
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvbridge-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """Whether the engine thread still serves requests."""
        return self._thread.is_alive() and not self._stop.is_set()

    # ------------------------------------------------------------ callers

    async def generate_stream(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        kv_transfer_params: object | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until the finished one.

        Leaving the iteration early aborts the request.

        Raises:
            InvalidRequestError: a bad request or an id already streaming
                (raised at the first iteration, before anything is queued).
            EngineDeadError: the engine stopped before the request finished.
        """
        request = self.engine.make_request(request_id, prompt, params, kv_transfer_params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._post(lambda: self._submit(request))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        kv_transfer_params: object | None = None,
    ) -> RequestOutput:
        """Run a request to completion; ``new_token_ids`` holds the whole completion.

        Raises:
            As :meth:`generate_stream`.
        """
        token_ids: list[int] = []
        last: RequestOutput | None = None
        async for out in self.generate_stream(request_id, prompt, params, kv_transfer_params):
            token_ids += out.new_token_ids
            last = out
        assert last is not None
        return dataclasses.replace(last, new_token_ids=token_ids)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or when the engine stopped). Any thread."""
        with contextlib.suppress(EngineDeadError):
            self._post(lambda: self._abort(request_id))

    async def get_stats(self) -> EngineStats:
        """Engine figures, read on the engine thread.

        Raises:
            EngineDeadError: the engine thread stopped.
        """
        future: concurrent.futures.Future[EngineStats] = concurrent.futures.Future()

        def read() -> None:
            try:
                future.set_result(self.engine.get_stats())
            except Exception as exc:  # report to the caller, keep serving
                future.set_exception(exc)

        self._post(read)
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread, fail open streams and stop the workers. Idempotent."""
        self._stop.set()
        self._wakeup.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self.engine.shutdown()

    # ------------------------------------------------------- engine thread

    def _post(self, command: Callable[[], None]) -> None:
        if self._error is not None or self._stop.is_set():
            raise EngineDeadError(f"engine is not running: {self._error or 'shut down'}")
        with self._lock:
            self._inbox.append(command)
        self._wakeup.set()

    def _submit(self, request: EngineRequest) -> None:
        try:
            self.engine.submit(request)
        except InvalidRequestError as exc:
            self._deliver(request.request_id, exc)

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _run(self) -> None:
        engine = self.engine
        idle_wait_s = _MIN_IDLE_WAIT_S
        try:
            while not self._stop.is_set():
                self._wakeup.clear()  # before reading the inbox: no post is missed
                with self._lock:
                    commands, self._inbox = self._inbox, deque()
                for command in commands:
                    command()
                if not (engine.has_unfinished() or engine.has_pending_transfers()):
                    self._wakeup.wait(_SLEEP_WAIT_S)
                    continue
                for out in engine.step():
                    self._deliver(out.request_id, out)
                if engine.last_step_num_tokens:
                    idle_wait_s = _MIN_IDLE_WAIT_S
                else:
                    # Only transfers in flight: sleep until a worker reports one ended
                    # (or a request arrives); poll rarely in case a wake-up was missed.
                    woken = self._wakeup.wait(idle_wait_s)
                    # The step after a wake-up often only learns the news (a load
                    # finished); the one after it runs the request: no wait between.
                    idle_wait_s = 0.0 if woken else min(
                        max(2 * idle_wait_s, _MIN_IDLE_WAIT_S), _MAX_IDLE_WAIT_S)
        except Exception as exc:
            logger.exception("engine thread failed")
            self._error = exc
        finally:
            self._stop.set()
            dead = EngineDeadError(f"engine stopped: {self._error or 'shut down'}")
            with self._lock:
                request_ids = list(self._streams)
            for request_id in request_ids:
                self._deliver(request_id, dead)
