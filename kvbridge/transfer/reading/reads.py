"""Reads in flight on the reading side: one job per ``start_read``, run to its outcome.

``Reads`` lives on the agent's event loop (``agent.py`` submits jobs with
``call_soon_threadsafe``); the engine thread collects outcomes from
``Reads.outcomes`` (``outcomes.py``). Before a job is submitted, ``read_inline``
tries it on the caller's thread (``inline.py``: a same-host copy on the grant
board's word over a link and plan already cached); a job made there is only
recorded, and its done report sent by the loop (``done_reports.py``). One job =
one request from one remote engine::

    link to remote rank 0 (learn its topology) -> build_read_plan    (links.py)
    -> for each plan item, in parallel: link to that rank -> read (or notify only)
       (lease renewed while it runs long: renewal.py)
       -> ReadDone(ok) to that rank                                  (done_reports.py)
    -> outcome: done, or failed with every local block id of the request

A notify-only job (``ReadJob.notify_only``) plans the same way but only sends
``ReadDone`` to every planned rank; it has no outcome to collect. A job that
failed as a whole over cached links that never answered runs once more over new
ones (``LinkCache.drop_stale``).

When the job's plan is cached, has one item and its link is live (every read
from a peer after the first, with TP alike or D's TP a multiple of P's),
``submit`` begins that read on the spot: receives posted and request sent
before the job's task first runs; the task only awaits it.

The engine may cancel reads in flight (``cancel``: a load late at its
deadline, whose blocks it wants to recompute or free). A cancelled job ends
failed (``ReadCancelledError``, reported like any failure, once) after each of
its reads made sure nothing of it writes into our blocks any more: a direct
read withdraws its receives and lets chunks already landing land, a staged
one lets its unpack under way end, a same-host copy stops its copy threads
(``strategy.BegunRead.quiet``). Its servers are told it gave up
(``ReadDone(ok=False)``, not awaited: a stopped server must not hold the
cancel). ``cancel`` says which jobs ended so within its deadline; for the
others (a chunk that went on landing) the engine must keep the blocks until
their outcome comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvbridge.errors import KVBridgeError
from kvbridge.topology import RemoteRead
from kvbridge.transfer.errors import ReadCancelledError, TransferError
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.base import BegunRead, ItemResult, ReaderContext
from kvbridge.transfer.reading.done_reports import DoneReports
from kvbridge.transfer.reading.inline import InlineReader
from kvbridge.transfer.reading.jobs import ReadJob
from kvbridge.transfer.reading.link import PeerLink
from kvbridge.transfer.reading.links import CachedLinks, LinkCache
from kvbridge.transfer.reading.outcomes import Outcomes
from kvbridge.transfer.reading.renewal import LeaseRenewal
from kvbridge.transfer.ucx.worker import UcxWorker

__all__ = ["Reads"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Flight:
    """One job's task in flight, and what ``cancel`` needs to know of it."""

    task: asyncio.Task[None] | None = None
    started: tuple[PeerLink, BegunRead] | None = None  # begun by ``submit``, until it runs
    ran: bool = False  # the task has begun running (it owns ``started`` from then on)
    cancelled: bool = False  # by ``cancel`` (not by ``close``): record the failure
    quiet: bool = True  # no read of it may write into our blocks once it ended


class Reads:
    """Jobs in flight and their outcomes (see the module docstring).

    Args:
        ctx: what every link of the agent shares.
        worker: the agent's UCX worker (links connect through it).
        reader_id: this reader, as servers count it (``engine id:global rank``).
        on_outcome: called after every outcome is recorded (``Outcomes``).
    """

    def __init__(
        self, ctx: ReaderContext, worker: UcxWorker, reader_id: str,
        on_outcome: Callable[[], None] | None = None,
    ) -> None:
        self._ctx = ctx
        self._links = LinkCache(ctx, worker)
        self._inline = InlineReader()
        self.reader_id = reader_id
        self.outcomes = Outcomes(ctx.local.topology.block_size, worker.stop_spinning,
                                 on_outcome)
        self._reports = DoneReports(asyncio.get_running_loop(), reader_id)
        self._jobs: set[asyncio.Task[None]] = set()
        self._flights: dict[str, _Flight] = {}  # reads in flight (not notices), by request

    # ---------------------------------------------------------------- any thread
    def read_inline(self, job: ReadJob) -> bool:
        """Make ``job``'s read on this thread if the server's board allows it (``inline.py``).

        True: done, its outcome recorded and its done report handed to the loop.
        False: nothing recorded; ``submit`` it. Any thread.
        """
        route = self._links.single_route(job)
        if route is None:
            return False
        try:
            result = self._inline.read(*route, job)
        except (TransferError, KVBridgeError):  # the usual path reports it
            return False
        if result is None:
            return False
        self.outcomes.record_inline(job, result)
        self._reports.add_inline(route[0], job.grant, result.nbytes)
        return True

    # ---------------------------------------------------------------- loop thread
    def submit(self, job: ReadJob) -> None:
        cached = self._links.cached(job.engine_id)  # before begin: it may kill a link
        started = self._begin_at_once(job)
        if started is not None:
            done = started[0].finished_now(started[1])
            if done is not None:  # a same-host copy that ``begin`` made whole
                self.outcomes.record(job, [done], [], 1)
                self._report_later(started[0], job, done)
                return
        flight = _Flight(started=started)
        task = asyncio.create_task(self._run(job, cached, flight))
        flight.task = task
        self._jobs.add(task)
        if not job.notify_only:
            self._flights[job.request_id] = flight
        task.add_done_callback(lambda _: self._ended(job, flight))

    def _ended(self, job: ReadJob, flight: _Flight) -> None:
        """A job's task is done; one cancelled before it first ran lets go of its read."""
        assert flight.task is not None
        self._jobs.discard(flight.task)
        if self._flights.get(job.request_id) is flight:
            del self._flights[job.request_id]
        if flight.ran or flight.started is None:
            return
        link, begun = flight.started
        link.abandon(begun)
        flight.quiet = begun.quiet
        if flight.cancelled:
            self.outcomes.record(job, [], [_cancelled(job)], 1)

    async def cancel(self, request_ids: Collection[str], timeout_s: float) -> set[str]:
        """Cancel the reads of ``request_ids`` in flight; wait until nothing of them
        writes into our blocks any more, ``timeout_s`` at most (see the module docstring).

        Returns:
            The ids sure to write nothing more: each cancelled job that ended in
            time with every read quiet, and each id with no read in flight (ended
            before, made inline, or never started). The others' jobs end later,
            failed; their blocks must stay theirs until then.
        """
        flights = {}
        for request_id in request_ids:
            flight = self._flights.get(request_id)
            if flight is not None and flight.task is not None and not flight.task.done():
                flight.cancelled = True
                flight.task.cancel()
                flights[request_id] = flight
        tasks = [flight.task for flight in flights.values() if flight.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return {request_id for request_id in request_ids
                if (flight := flights.get(request_id)) is None
                or (flight.task is not None and flight.task.done() and flight.quiet)}

    def _begin_at_once(self, job: ReadJob) -> tuple[PeerLink, BegunRead] | None:
        """Begin the read now, before its task first runs, if nothing needs awaiting.

        The common case (a one-item plan over a live cached link) then has its
        receives posted and its request on the wire one event-loop pass sooner.
        None: the task does everything, as for any other job.
        """
        route = self._links.single_route(job)
        if route is None:
            return None
        link, item = route
        try:
            begun = link.begin(link.prepare(item, job))
        except (TransferError, KVBridgeError):  # the task runs it again and reports
            return None
        return link, begun

    async def _run(self, job: ReadJob, cached: CachedLinks, flight: _Flight) -> None:
        flight.ran = True
        started = flight.started
        results: list[ItemResult] = []
        errors: list[BaseException] = []
        num_ranks = 0
        try:
            async with asyncio.timeout(self._ctx.config.read_timeout_s):
                try:
                    num_ranks, outcomes = await self._attempt(job, flight, started)
                except (TransferError, KVBridgeError) as exc:  # planning failed
                    outcomes = [exc]
                if self._links.drop_stale(job, cached, outcomes):
                    num_ranks, outcomes = await self._attempt(job, flight)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    errors.append(outcome)
                elif outcome is not None:
                    results.append(outcome)
        except (TransferError, KVBridgeError, TimeoutError) as exc:
            errors.append(exc)
        except asyncio.CancelledError:
            if not flight.cancelled:  # the agent closes: no outcome
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            errors.append(_cancelled(job))
        except Exception as exc:  # a bug must still end the request, never hang it
            logger.exception("read %s crashed", job.request_id)
            errors.append(exc)
        finally:
            if started is not None:  # cancelled before it was awaited: let go of it
                started[0].abandon(started[1])
                flight.quiet = flight.quiet and started[1].quiet
        self.outcomes.record(job, results, errors, num_ranks)

    async def _attempt(
        self, job: ReadJob, flight: _Flight, started: tuple[PeerLink, BegunRead] | None = None
    ) -> tuple[int, list[ItemResult | None | BaseException]]:
        """Plan from rank 0's metadata and run every item: ``(num_ranks, outcomes)``.

        ``started``: the job's only item, begun by ``submit`` (its plan is cached).
        """
        if started is not None:
            try:
                return 1, [await self._run_item(job, flight, started[1].item, started)]
            except Exception as exc:  # what gather(return_exceptions=True) would collect
                return 1, [exc]
        plan = await self._links.plan(job)
        if len(plan.items) == 1:  # the common case: no gather (it costs a task per item)
            try:
                outcomes: list[ItemResult | None | BaseException] = [
                    await self._run_item(job, flight, plan.items[0])
                ]
            except Exception as exc:  # what gather(return_exceptions=True) would collect
                outcomes = [exc]
        else:
            outcomes = await asyncio.gather(
                *(self._run_item(job, flight, item) for item in plan.items),
                return_exceptions=True,
            )
        return len(plan.items), outcomes

    async def _run_item(
        self, job: ReadJob, flight: _Flight, item: RemoteRead,
        started: tuple[PeerLink, BegunRead] | None = None,
    ) -> ItemResult | None:
        link = (started[0] if started is not None
                else await self._links.link(job, item.remote_rank))
        if job.notify_only or not item.read:
            await link.notify(job.grant, self.reader_id, job.ok)
            return None
        renewal: LeaseRenewal | None = None
        begun: BegunRead | None = None
        try:
            begun = started[1] if started is not None else link.begin(link.prepare(item, job))
            renewal = LeaseRenewal(link, job.grant, begun, self._ctx.config)
            result = await link.finish(begun)
            refused = renewal.refusal()
            if refused is not None:
                raise refused
        except asyncio.CancelledError:
            if link.alive:  # not awaited: a stopped server must not hold the cancel
                link.post_quietly(wire.ReadDone(job.grant, self.reader_id, False))
            raise
        except BaseException:
            if link.alive:
                with contextlib.suppress(TransferError):
                    await link.notify(job.grant, self.reader_id, False)
            raise
        finally:
            if begun is not None and not begun.quiet:
                flight.quiet = False
            if renewal is not None:
                renewal.stop()
        self._report_later(link, job, result)
        return result

    def _report_later(self, link: PeerLink, job: ReadJob, result: ItemResult) -> None:
        """The data is here: report it without waiting, once the job's outcome is
        recorded (a few returns up, or just before): the engine first."""
        self._reports.send_soon(link, job.grant, result.nbytes if result.unasked else 0)

    def abort_all(self) -> None:
        """Cancel every job and drop every link without goodbyes."""
        for task in list(self._jobs):
            task.cancel()
        self._reports.abort()
        self._links.abort_all()

    async def close(self) -> None:
        """Cancel jobs, let done reports go out (briefly), then close every link gracefully."""
        for task in list(self._jobs):
            task.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)
        await self._reports.close()
        await self._links.close()


def _cancelled(job: ReadJob) -> ReadCancelledError:
    return ReadCancelledError(f"read {job.request_id} from {job.engine_id} cancelled by "
                              f"this engine (a load late at its deadline)")
