"""Reads in flight on the reading side: plans, links to remote ranks, outcomes.

``Reads`` lives on the agent's event loop (``agent.py`` submits jobs with
``call_soon_threadsafe``); the engine thread collects outcomes through the
``take_*`` methods, which are guarded by a lock. Before a job is submitted,
``read_inline`` tries it on the caller's thread (``inline.py``: a same-host copy
on the grant board's word over a link and plan this object already holds); a
job made there is only recorded here, and its done report sent by the loop: the
first at once, later ones every ``_REPORT_EVERY_S`` while they keep coming (waking
the loop from another thread costs the caller ~5-15 us, a cross-core wakeup). One
job = one request from one remote engine::

    link to remote rank 0 (learn its topology) -> build_read_plan
    -> for each plan item, in parallel: link to that rank -> read (or notify only)
       -> ReadDone(ok) to that rank
    -> outcome: done, or failed with every local block id of the request

A notify-only job (``ReadJob.notify_only``) plans the same way but only sends
``ReadDone`` to every planned rank; it has no outcome to collect.

A read that runs longer than ``renew_every_s`` renews its grant's lease every
``renew_every_s``, naming itself (its xfer id), while the server serves it (a
same-host copy on the grant board's word is not served: it renews nothing, see
``same_host.py``). If the server refuses because the grant expired, was revoked
or released meanwhile, that read fails with ``LeaseRefusedError`` once it ends;
other reads on the link are not touched. If it refuses because it serves no such
read (``NoReadServedError``: its half of the read ended first, or has not pinned
the grant yet), that renewal extended nothing and the read goes on (its own data
decides), renewing again ``renew_every_s`` later.

When the job's plan is cached, has one item and its link is live (every read
from a peer after the first, with TP alike or D's TP a multiple of P's),
``submit`` begins that read on the spot: receives posted and request sent
before the job's task first runs; the task only awaits it.

Links are cached per (engine, rank) and reopened, with a fresh handshake and
fresh metadata, after they die; concurrent jobs share one connection attempt.
Opening one first drops every cached link that died, whatever its engine.

A cached link may be stale without anyone knowing yet: its peer restarted at the
same address (maybe with another TP size, block size or layout) sooner than
heartbeats notice, and UCX reports no peer failure. Reads over it then fail on
the dead connection, or are planned from the old metadata and do not fit the
request. So when a job that used links cached before it started fails as a whole
and none of those links heard from its server meanwhile (a live server would at
least have answered the read), those links are dropped and the job runs once
more, from a new handshake and a plan made from the peer's fresh metadata::

    attempt 1: cached links (maybe stale) -> everything fails, not a word back
    attempt 2: new links, new handshake, new plan -> the outcome, whatever it is

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
import collections
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvbridge.errors import KVBridgeError
from kvbridge.topology import ReadPlan, RemoteRead, build_read_plan
from kvbridge.transfer.errors import (
    LeaseRefusedError,
    NoReadServedError,
    ReadCancelledError,
    RejectedError,
    TransferError,
)
from kvbridge.transfer.local_kv import topology_of
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.inline import InlineReader
from kvbridge.transfer.reading.jobs import ReadJob, ReadStats
from kvbridge.transfer.reading.link import PeerLink
from kvbridge.transfer.reading.strategy import BegunRead, ItemResult, ReaderContext
from kvbridge.transfer.ucx.worker import UcxWorker

__all__ = ["Reads"]

logger = logging.getLogger(__name__)

_REPORT_GRACE_S = 0.5  # close() lets done reports in flight finish this long
_REPORT_EVERY_S = 0.001  # done reports of inline reads go out in batches this often


#: Rejects that prove a live server judged this request or this reader.
_VERDICTS = frozenset({
    wire.RejectReason.UNKNOWN_GRANT, wire.RejectReason.EXPIRED_GRANT,
    wire.RejectReason.NOT_GRANTED, wire.RejectReason.PROMPT_MISMATCH,
    wire.RejectReason.VERSION, wire.RejectReason.COMPAT, wire.RejectReason.AUTH,
})


@dataclass(slots=True)
class _Flight:
    """One job's task in flight, and what ``cancel`` needs to know of it."""

    task: asyncio.Task[None] | None = None
    started: tuple[PeerLink, BegunRead] | None = None  # begun by ``submit``, until it runs
    ran: bool = False  # the task has begun running (it owns ``started`` from then on)
    cancelled: bool = False  # by ``cancel`` (not by ``close``): record the failure
    quiet: bool = True  # no read of it may write into our blocks once it ended


class Reads:
    """Jobs in flight and their outcomes (see the module docstring)."""

    def __init__(
        self, ctx: ReaderContext, worker: UcxWorker, reader_id: str,
        on_outcome: Callable[[], None] | None = None,
    ) -> None:
        self._ctx = ctx
        self._on_outcome = on_outcome
        self._worker = worker
        self._loop = asyncio.get_running_loop()
        self._inline = InlineReader()
        self.reader_id = reader_id
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._opening: dict[tuple[str, int], asyncio.Task[PeerLink]] = {}
        self._jobs: set[asyncio.Task[None]] = set()
        self._flights: dict[str, _Flight] = {}  # reads in flight (not notices), by request
        self._plans: weakref.WeakKeyDictionary[PeerLink, ReadPlan] = weakref.WeakKeyDictionary()
        self._reports: set[asyncio.Future[None]] = set()  # done reports being sent
        # Done reports of inline reads not sent yet, and whether the loop will look.
        self._unreported: collections.deque[tuple[PeerLink, str, int]] = collections.deque()
        self._reporter_armed = False
        self._lock = threading.Lock()
        self._outcome = threading.Condition(self._lock)  # notified when _finished grows
        self._num_waiting = 0  # threads in wait_finished (under _lock): none, no notify
        self._finished: set[str] = set()
        self._failed: dict[str, set[int]] = {}
        # ReadStats, or (request id, bytes, seconds, messages) of an inline read, made
        # into one by ``take_stats``: off the read's path (a frozen ReadStats is ~1 us)
        self._stats: list[ReadStats | tuple[str, int, float, int]] = []

    # ---------------------------------------------------------------- engine thread
    def take_finished(self) -> set[str]:
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
        with self._lock:
            failed, self._failed = self._failed, {}
            return failed

    def take_stats(self) -> list[ReadStats]:
        with self._lock:
            stats, self._stats = self._stats, []
        return [s if isinstance(s, ReadStats) else _inline_stats(*s) for s in stats]

    def read_inline(self, job: ReadJob) -> bool:
        """Make ``job``'s read on this thread if the server's board allows it (``inline.py``).

        True: done, its outcome recorded and its done report handed to the loop.
        False: nothing recorded; ``submit`` it. Any thread.
        """
        route = self._single_route(job)
        if route is None:
            return False
        try:
            result = self._inline.read(*route, job)
        except (TransferError, KVBridgeError):  # the usual path reports it
            return False
        if result is None:
            return False
        self._record_inline(job, result)
        self._unreported.append((route[0], job.grant, result.nbytes))
        if not self._reporter_armed:  # else the loop looks within _REPORT_EVERY_S
            self._reporter_armed = True
            with contextlib.suppress(RuntimeError):  # the loop closed: the lease ends it
                self._loop.call_soon_threadsafe(self._send_unreported)
        return True

    def _send_unreported(self) -> None:
        """Send the inline reads' done reports; look again soon while they keep coming."""
        if not self._unreported:
            self._reporter_armed = False
            if not self._unreported:  # a read appended before it saw the flag down
                return
            self._reporter_armed = True
        while self._unreported:
            self._notify_later(*self._unreported.popleft())
        self._loop.call_later(_REPORT_EVERY_S, self._send_unreported)

    def _single_route(self, job: ReadJob) -> tuple[PeerLink, RemoteRead] | None:
        """The live link and plan item of a job whose cached plan has one item to read."""
        first = self._links.get((job.engine_id, 0))
        plan = self._plans.get(first) if first is not None and first.alive else None
        if job.notify_only or plan is None or len(plan.items) != 1 or not plan.items[0].read:
            return None
        item = plan.items[0]
        link = self._links.get((job.engine_id, item.remote_rank))
        if link is None or not link.alive or not job.has_port(item.remote_rank):
            return None
        return link, item

    # ---------------------------------------------------------------- loop thread
    def submit(self, job: ReadJob) -> None:
        cached = self._cached_links(job.engine_id)  # before begin: it may kill a link
        started = self._begin_at_once(job)
        if started is not None:
            done = started[0].finished_now(started[1])
            if done is not None:  # a same-host copy that ``begin`` made whole
                self._record(job, [done], [], 1)
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
            self._record(job, [], [_cancelled(job)], 1)

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
        route = self._single_route(job)
        if route is None:
            return None
        link, item = route
        try:
            begun = link.begin(link.prepare(item, job))
        except (TransferError, KVBridgeError):  # the task runs it again and reports
            return None
        return link, begun

    async def _link(self, job: ReadJob, rank: int) -> PeerLink:
        port = job.port_of(rank)  # a job without the rank's port fails, link cached or not
        key = (job.engine_id, rank)
        link = self._links.get(key)
        if link is not None and link.alive:
            return link
        opening = self._opening.get(key)
        if opening is None:
            self._forget_dead_links()  # a new link: maybe to a server that replaced one
            opening = asyncio.create_task(
                PeerLink.open(self._ctx, self._worker, job.host, port, job.engine_id, rank)
            )
            self._opening[key] = opening
            opening.add_done_callback(lambda _: self._opening.pop(key, None))
        link = await asyncio.shield(opening)
        self._links[key] = link
        return link

    def _forget_dead_links(self) -> None:
        """Drop every link that died. A server that comes back as another engine (vLLM
        makes up an engine id at each start) is never named again: its link, and what
        it holds, would be kept for good."""
        for key in [key for key, link in self._links.items() if not link.alive]:
            del self._links[key]

    async def _run(
        self, job: ReadJob, cached: dict[tuple[str, int], tuple[PeerLink, int]],
        flight: _Flight,
    ) -> None:
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
                if self._drop_stale(job, cached, outcomes):
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
        self._record(job, results, errors, num_ranks)

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
        first = await self._link(job, 0)
        plan = self._plans.get(first)  # a link's metadata never changes: plan once
        if plan is None:
            plan = build_read_plan(
                self._ctx.local.topology, self._ctx.local.tp_rank, self._ctx.local.pp_rank,
                topology_of(first.meta), job.engine_id,
            )
            self._plans[first] = plan
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

    def _cached_links(self, engine_id: str) -> dict[tuple[str, int], tuple[PeerLink, int]]:
        """Live links to ``engine_id`` by key, with their received-message counts."""
        return {key: (link, link.num_received) for key, link in self._links.items()
                if key[0] == engine_id and link.alive}

    def _drop_stale(
        self, job: ReadJob, cached: dict[tuple[str, int], tuple[PeerLink, int]],
        outcomes: list[ItemResult | None | BaseException],
    ) -> bool:
        """Whether to try ``job`` again: all of it failed over cached, silent links.

        Such links are aborted, so the next attempt handshakes anew. Not when a
        cached link heard from its server during the job (it is alive), nor when
        a server gave a verdict (grant or handshake reject: new links would hear
        the same).
        """
        failures = [o for o in outcomes if isinstance(o, TransferError | KVBridgeError)
                    and not (isinstance(o, RejectedError) and o.reason in _VERDICTS)]
        silent = {key: link for key, (link, num_received) in cached.items()
                  if link.num_received == num_received}
        if (not silent or len(silent) != len(cached) or not outcomes
                or len(failures) != len(outcomes)):
            return False
        logger.warning("read %s: links to %s found stale (%s); handshaking again",
                       job.request_id, job.engine_id, failures[0])
        for key, link in silent.items():
            link.abort()
            if self._links.get(key) is link:
                del self._links[key]
        return True

    async def _run_item(
        self, job: ReadJob, flight: _Flight, item: RemoteRead,
        started: tuple[PeerLink, BegunRead] | None = None,
    ) -> ItemResult | None:
        link = started[0] if started is not None else await self._link(job, item.remote_rank)
        if job.notify_only or not item.read:
            await link.notify(job.grant, self.reader_id, job.ok)
            return None
        # The lease covers most reads: start renewing only once one runs that long.
        renewer: list[asyncio.Task[None]] = []
        due: asyncio.TimerHandle | None = None
        begun: BegunRead | None = None
        try:
            begun = started[1] if started is not None else link.begin(link.prepare(item, job))
            due = asyncio.get_running_loop().call_later(
                self._ctx.config.renew_every_s,
                lambda: renewer.append(asyncio.create_task(
                    self._renew_while_reading(link, job.grant, begun))),
            )
            result = await link.finish(begun)
            refused = _refusal(renewer)
            if refused is not None:
                # The read ran to its end (a pinned grant outlives its lease until its
                # reads end), but the server no longer stands behind the grant.
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
            if due is not None:
                due.cancel()
            for task in renewer:
                task.cancel()
                if task.done() and not task.cancelled():
                    task.exception()  # a refusal the read's own failure made moot
        self._report_later(link, job, result)
        return result

    def _report_later(self, link: PeerLink, job: ReadJob, result: ItemResult) -> None:
        """The data is here: report it without waiting, once the job's outcome is
        recorded (a few returns up, or just before): the engine first."""
        asyncio.get_running_loop().call_soon(self._notify_later, link, job.grant,
                                             result.nbytes if result.unasked else 0)

    def _notify_later(self, link: PeerLink, grant: str, copied_nbytes: int) -> None:
        """Report a successful read to the server without waiting for the send.

        If the report is lost (link died), the server frees the blocks when the
        lease expires; the read itself already succeeded.
        """
        try:
            sent = link.notify_nowait(grant, self.reader_id, copied_nbytes)
        except TransferError as exc:
            logger.info("done report to %s not delivered: %s", link.peer, exc)
            return
        self._reports.add(sent)
        sent.add_done_callback(self._reports.discard)

    async def _renew_while_reading(self, link: PeerLink, grant: str, begun: BegunRead) -> None:
        """Renew now, then every ``renew_every_s`` (started once ``begun`` ran that long),
        while the server serves it (``begun.asked``: else that round is skipped).

        Raises:
            LeaseRefusedError: the server refused (the grant is gone); the read
                fails when it ends (``_refusal``). A ``NoReadServedError`` is no
                verdict on the read (the server's half of it is over, or not
                pinned yet): the next round asks again. Any other failure ends
                the renewals only: a dead link fails the read by itself.
        """
        cfg = self._ctx.config
        xfer_id = begun.request.xfer_id
        while True:
            try:
                if begun.asked:
                    remaining = await link.renew(grant, cfg.lease_s, xfer_id)
                    logger.debug("renewed grant of read %d for %.1fs", xfer_id, remaining)
            except NoReadServedError as exc:
                logger.debug("lease renewal of read %d extended nothing: %s", xfer_id, exc)
            except LeaseRefusedError as exc:
                logger.info("lease renewal of read %d refused: %s", xfer_id, exc)
                raise
            except TransferError as exc:
                logger.info("lease renewal of read %d failed: %s", xfer_id, exc)
                return
            await asyncio.sleep(cfg.renew_every_s)

    def _record(
        self, job: ReadJob, results: list[ItemResult], errors: list[BaseException], num_ranks: int
    ) -> None:
        ok = not errors
        if job.notify_only:
            if errors:
                logger.info("done notice for %s to %s not delivered: %s",
                            job.request_id, job.engine_id, errors[0])
            return
        if errors:
            logger.warning("read %s from %s failed: %s", job.request_id, job.engine_id, errors[0])
        stats = ReadStats(
            request_id=job.request_id,
            ok=ok,
            nbytes=sum(r.nbytes for r in results),
            duration_s=time.monotonic() - job.submitted_at,
            num_messages=sum(r.num_messages for r in results) + num_ranks,
            num_remote_ranks=num_ranks,
            error="" if ok else f"{type(errors[0]).__name__}: {errors[0]}",
            num_direct=sum(r.direct for r in results),
            num_local_copies=sum(r.local_copy for r in results),
        )
        with self._lock:
            self._finished.add(job.request_id)
            if not ok:
                # blocks holding read tokens; earlier ones were not touched
                first_block = job.first_token // self._ctx.local.topology.block_size
                self._failed[job.request_id] = set(job.local_block_ids[first_block:])
            self._stats.append(stats)
            if self._num_waiting:
                self._outcome.notify_all()
        # The outcome is for another thread of this process: let it have the GIL.
        self._worker.stop_spinning()
        if self._on_outcome is not None:
            self._on_outcome()

    def _record_inline(self, job: ReadJob, result: ItemResult) -> None:
        """``_record`` of an inline read that succeeded, on the caller's thread: the same
        stats (a direct copy from one rank, as ``InlineReader`` makes every read it
        returns), kept as a tuple until ``take_stats``, and no loop to stop spinning
        (this thread has the GIL and is the one that looks at the outcome)."""
        stats = (job.request_id, result.nbytes, time.monotonic() - job.submitted_at,
                 result.num_messages + 1)
        with self._lock:
            self._finished.add(job.request_id)
            self._stats.append(stats)
            if self._num_waiting:
                self._outcome.notify_all()
        if self._on_outcome is not None:
            self._on_outcome()

    def abort_all(self) -> None:
        """Cancel every job and drop every link without goodbyes."""
        for pending in (*self._jobs, *self._reports):
            pending.cancel()
        for link in self._links.values():
            link.abort()

    async def close(self) -> None:
        """Cancel jobs, let done reports go out (briefly), then close every link gracefully."""
        for task in list(self._jobs):
            task.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)
        while self._unreported:
            self._notify_later(*self._unreported.popleft())
        if self._reports:
            await asyncio.wait(list(self._reports), timeout=_REPORT_GRACE_S)
        for report in list(self._reports):
            report.cancel()
        await asyncio.gather(*self._reports, return_exceptions=True)
        await asyncio.gather(*(link.close() for link in self._links.values()))


def _cancelled(job: ReadJob) -> ReadCancelledError:
    return ReadCancelledError(f"read {job.request_id} from {job.engine_id} cancelled by "
                              f"this engine (a load late at its deadline)")


def _refusal(renewer: list[asyncio.Task[None]]) -> LeaseRefusedError | None:
    """The server's refusal to renew a read's grant, if its renewals ended so."""
    for task in renewer:
        if task.done() and not task.cancelled():
            error = task.exception()
            if isinstance(error, LeaseRefusedError):
                return error
    return None


def _inline_stats(request_id: str, nbytes: int, duration_s: float, num_messages: int) -> ReadStats:
    """The ReadStats of an inline read that succeeded: one rank, direct, copied here."""
    return ReadStats(request_id, True, nbytes, duration_s, num_messages, 1,
                     num_direct=1, num_local_copies=1)
