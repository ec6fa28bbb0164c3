"""The reading side's links to remote ranks, cached, and the read plan of each engine.

``Reads`` (``reads.py``) asks ``LinkCache`` for the link to a remote (engine,
rank) and for the read plan of a job (``build_read_plan`` from rank 0's
metadata, made once per link: a link's metadata never changes). Links are
cached per (engine, rank) and reopened, with a fresh handshake and fresh
metadata, after they die; concurrent jobs share one connection attempt.
Opening one first drops every cached link that died, whatever its engine.

A cached link may be stale without anyone knowing yet: its peer restarted at the
same address (maybe with another TP size, block size or layout) sooner than
heartbeats notice, and UCX reports no peer failure. Reads over it then fail on
the dead connection, or are planned from the old metadata and do not fit the
request. So when a job that used links cached before it started fails as a whole
and none of those links heard from its server meanwhile (a live server would at
least have answered the read), ``drop_stale`` drops those links and the job runs
once more, from a new handshake and a plan made from the peer's fresh metadata::

    attempt 1: cached links (maybe stale) -> everything fails, not a word back
    attempt 2: new links, new handshake, new plan -> the outcome, whatever it is

All on the agent's loop, except ``single_route``, which the thread making a
read inline (``inline.py``) also calls: it only looks.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from kvbridge.errors import KVBridgeError
from kvbridge.topology import ReadPlan, RemoteRead, build_read_plan
from kvbridge.transfer.errors import RejectedError, TransferError
from kvbridge.transfer.local_kv import topology_of
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.base import ItemResult, ReaderContext
from kvbridge.transfer.reading.jobs import ReadJob
from kvbridge.transfer.reading.link import PeerLink
from kvbridge.transfer.ucx.worker import UcxWorker

__all__ = ["CachedLinks", "LinkCache"]

logger = logging.getLogger(__name__)

#: Rejects that prove a live server judged this request or this reader.
_VERDICTS = frozenset({
    wire.RejectReason.UNKNOWN_GRANT, wire.RejectReason.EXPIRED_GRANT,
    wire.RejectReason.NOT_GRANTED, wire.RejectReason.PROMPT_MISMATCH,
    wire.RejectReason.VERSION, wire.RejectReason.COMPAT, wire.RejectReason.AUTH,
})

#: Live links to one engine when a job started, by key, with their received-message counts.
CachedLinks = dict[tuple[str, int], tuple[PeerLink, int]]


class LinkCache:
    """Links by (engine id, rank), and each rank-0 link's read plan."""

    def __init__(self, ctx: ReaderContext, worker: UcxWorker) -> None:
        self._ctx = ctx
        self._worker = worker
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._opening: dict[tuple[str, int], asyncio.Task[PeerLink]] = {}
        self._plans: weakref.WeakKeyDictionary[PeerLink, ReadPlan] = weakref.WeakKeyDictionary()

    async def link(self, job: ReadJob, rank: int) -> PeerLink:
        """The live link to ``job``'s engine rank ``rank``, opened if there is none.

        Raises:
            MissingPortError: ``job`` has no port for ``rank``.
            As ``PeerLink.open``.
        """
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

    async def plan(self, job: ReadJob) -> ReadPlan:
        """``job``'s read plan, from its engine's rank 0 metadata (made once per link).

        Raises:
            As ``link``; KVBridgeError: the topologies do not fit (``build_read_plan``).
        """
        first = await self.link(job, 0)
        plan = self._plans.get(first)  # a link's metadata never changes: plan once
        if plan is None:
            local = self._ctx.local
            plan = build_read_plan(local.topology, local.tp_rank, local.pp_rank,
                                   topology_of(first.meta), job.engine_id)
            self._plans[first] = plan
        return plan

    def single_route(self, job: ReadJob) -> tuple[PeerLink, RemoteRead] | None:
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

    def _forget_dead_links(self) -> None:
        """Drop every link that died. A server that comes back as another engine (vLLM
        makes up an engine id at each start) is never named again: its link, and what
        it holds, would be kept for good."""
        for key in [key for key, link in self._links.items() if not link.alive]:
            del self._links[key]

    def cached(self, engine_id: str) -> CachedLinks:
        """Live links to ``engine_id`` by key, with their received-message counts."""
        return {key: (link, link.num_received) for key, link in self._links.items()
                if key[0] == engine_id and link.alive}

    def drop_stale(
        self, job: ReadJob, cached: CachedLinks,
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

    def abort_all(self) -> None:
        """Drop every link without goodbyes."""
        for link in self._links.values():
            link.abort()

    async def close(self) -> None:
        """Close every link gracefully."""
        await asyncio.gather(*(link.close() for link in self._links.values()))
