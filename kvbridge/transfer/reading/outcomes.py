"""Outcomes of reads for the engine thread: finished ids, failed blocks, stats.

``Reads`` (``reads.py``) records each job's outcome here on the agent's loop
(``record``), and a read made inline records its own on the caller's thread
(``record_inline``); the engine thread collects them through ``TransferAgent``
(``take_finished``, ``take_failed``, ``take_stats``) or sleeps until one comes
(``wait_finished``). Every method takes one lock; none does I/O under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvbridge.transfer.reading.base import ItemResult
from kvbridge.transfer.reading.jobs import ReadJob, ReadStats

__all__ = ["Outcomes"]

logger = logging.getLogger(__name__)


class Outcomes:
    """What reads ended with, until the engine thread takes it.

    Args:
        block_size: our cache's tokens per block (a failed read fails the blocks
            from its first read token on).
        stop_spinning: called after a job's outcome is recorded on the loop, so
            that another thread of this process gets the GIL (``UcxWorker.stop_spinning``).
        on_outcome: called after every outcome is recorded (the agent wakes its
            engine thread).
    """

    def __init__(self, block_size: int, stop_spinning: Callable[[], None],
                 on_outcome: Callable[[], None] | None = None) -> None:
        self._block_size = block_size
        self._stop_spinning = stop_spinning
        self._on_outcome = on_outcome
        self._lock = threading.Lock()
        self._outcome = threading.Condition(self._lock)  # notified when _finished grows
        self._num_waiting = 0  # threads in wait_finished (under _lock): none, no notify
        self._finished: set[str] = set()
        self._failed: dict[str, set[int]] = {}
        # ReadStats, or (request id, bytes, seconds, messages, ended at) of an inline read,
        # made into one by ``take_stats``: a frozen ReadStats costs its time off the read's
        # path.
        self._stats: list[ReadStats | tuple[str, int, float, int, float]] = []

    def take_finished(self) -> set[str]:
        """Request ids whose reads ended (ok or failed) since the last call."""
        with self._lock:
            finished, self._finished = self._finished, set()
            return finished

    def wait_finished(self, timeout_s: float) -> bool:
        """Block until an outcome waits in ``take_finished`` (True) or ``timeout_s`` ends."""
        with self._lock:
            self._num_waiting += 1
            try:
                return self._outcome.wait_for(lambda: bool(self._finished), timeout_s)
            finally:
                self._num_waiting -= 1

    def take_failed(self) -> dict[str, set[int]]:
        """Local block ids of each failed read since the last call, by request id."""
        with self._lock:
            failed, self._failed = self._failed, {}
            return failed

    def take_stats(self) -> list[ReadStats]:
        """What each read that ended since the last call cost."""
        with self._lock:
            stats, self._stats = self._stats, []
        return [s if isinstance(s, ReadStats) else _inline_stats(*s) for s in stats]

    def record(
        self, job: ReadJob, results: list[ItemResult], errors: list[BaseException], num_ranks: int
    ) -> None:
        """The outcome of ``job`` (failed if any of ``errors``); on the agent's loop.

        A notify-only job has no outcome: only a failure to deliver is logged.
        """
        ok = not errors
        if job.notify_only:
            if errors:
                logger.info("done notice for %s to %s not delivered: %s",
                            job.request_id, job.engine_id, errors[0])
            return
        if errors:
            logger.warning("read %s from %s failed: %s", job.request_id, job.engine_id, errors[0])
        now = time.monotonic()
        queue_s = grant_s = copy_s = 0.0
        if ok and results and all(r.landed_at for r in results):
            began = min(r.began_at for r in results)
            granted = max(r.granted_at for r in results)
            landed = max(r.landed_at for r in results)
            queue_s = max(0.0, began - job.submitted_at)
            grant_s = max(0.0, granted - began)
            copy_s = max(0.0, landed - granted)
        stats = ReadStats(
            request_id=job.request_id,
            ok=ok,
            nbytes=sum(r.nbytes for r in results),
            duration_s=now - job.submitted_at,
            num_messages=sum(r.num_messages for r in results) + num_ranks,
            num_remote_ranks=num_ranks,
            error="" if ok else f"{type(errors[0]).__name__}: {errors[0]}",
            num_direct=sum(r.direct for r in results),
            num_local_copies=sum(r.local_copy for r in results),
            queue_s=queue_s, grant_s=grant_s, copy_s=copy_s, ended_at=now,
        )
        with self._lock:
            self._finished.add(job.request_id)
            if not ok:
                # blocks holding read tokens; earlier ones were not touched
                first_block = job.first_token // self._block_size
                self._failed[job.request_id] = set(job.local_block_ids[first_block:])
            self._stats.append(stats)
            if self._num_waiting:
                self._outcome.notify_all()
        # The outcome is for another thread of this process: let it have the GIL.
        self._stop_spinning()
        if self._on_outcome is not None:
            self._on_outcome()

    def record_inline(self, job: ReadJob, result: ItemResult) -> None:
        """``record`` of an inline read that succeeded, on the caller's thread: the same
        stats (a direct copy from one rank, as ``InlineReader`` makes every read it
        returns), kept as a tuple until ``take_stats``, and no loop to stop spinning (this
        thread has the GIL and is the one that looks at the outcome)."""
        now = time.monotonic()
        stats = (job.request_id, result.nbytes, now - job.submitted_at,
                 result.num_messages + 1, now)
        with self._lock:
            self._finished.add(job.request_id)
            self._stats.append(stats)
            if self._num_waiting:
                self._outcome.notify_all()
        if self._on_outcome is not None:
            self._on_outcome()


def _inline_stats(request_id: str, nbytes: int, duration_s: float, num_messages: int,
                  ended_at: float) -> ReadStats:
    """The ReadStats of an inline read that succeeded: one rank, direct, copied here (on
    the caller's thread: no queue; the board's yes is one read of it, counted as copy)."""
    return ReadStats(request_id, True, nbytes, duration_s, num_messages, 1,
                     num_direct=1, num_local_copies=1, copy_s=duration_s, ended_at=ended_at)
