"""Telling servers a read succeeded (``ReadDone``) without waiting: ``DoneReports``.

A read's data is in our blocks before its server hears of it: the report is
posted after the job's outcome is recorded (the engine first) and never
awaited. A lost report costs only time: the server frees the blocks when the
lease expires; the read itself already succeeded.

Reads made inline (``inline.py``, on the thread calling ``start_read``) hand
their reports to the agent's loop in batches: the first at once, later ones
every ``_REPORT_EVERY_S`` while they keep coming, since waking the loop from
another thread costs the caller a cross-core wakeup per read.

Used by ``reads.py``; ``close`` lets reports in flight finish, briefly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.reading.link import PeerLink

__all__ = ["DoneReports"]

logger = logging.getLogger(__name__)

_REPORT_GRACE_S = 0.5  # close() lets done reports in flight finish this long
_REPORT_EVERY_S = 0.001  # done reports of inline reads go out in batches this often


class DoneReports:
    """The done reports of one reader, being sent or waiting for the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reader_id: str) -> None:
        self._loop = loop
        self._reader_id = reader_id
        self._sending: set[asyncio.Future[None]] = set()
        # Reports of inline reads not sent yet, and whether the loop will look.
        self._unreported: collections.deque[tuple[PeerLink, str, int]] = collections.deque()
        self._armed = False

    def add_inline(self, link: PeerLink, grant: str, copied_nbytes: int) -> None:
        """Queue the report of a read made inline; the loop sends it. Any thread."""
        self._unreported.append((link, grant, copied_nbytes))
        if not self._armed:  # else the loop looks within _REPORT_EVERY_S
            self._armed = True
            with contextlib.suppress(RuntimeError):  # the loop closed: the lease ends it
                self._loop.call_soon_threadsafe(self._send_unreported)

    def _send_unreported(self) -> None:
        """Send the inline reads' reports; look again soon while they keep coming."""
        if not self._unreported:
            self._armed = False
            if not self._unreported:  # a read appended before it saw the flag down
                return
            self._armed = True
        while self._unreported:
            self.send(*self._unreported.popleft())
        self._loop.call_later(_REPORT_EVERY_S, self._send_unreported)

    def send_soon(self, link: PeerLink, grant: str, copied_nbytes: int) -> None:
        """``send`` on the loop's next pass: once the job's outcome is recorded (a few
        returns up, or just before), so the engine hears first. On the loop."""
        self._loop.call_soon(self.send, link, grant, copied_nbytes)

    def send(self, link: PeerLink, grant: str, copied_nbytes: int) -> None:
        """Report a successful read of ``grant`` to ``link``'s server, not waiting for the
        send. ``copied_nbytes``: what the read copied on the grant board's word. On the loop.
        """
        try:
            sent = link.notify_nowait(grant, self._reader_id, copied_nbytes)
        except TransferError as exc:
            logger.info("done report to %s not delivered: %s", link.peer, exc)
            return
        self._sending.add(sent)
        sent.add_done_callback(self._sending.discard)

    def abort(self) -> None:
        """Cancel every report being sent."""
        for sent in list(self._sending):
            sent.cancel()

    async def close(self) -> None:
        """Send what waits, let reports in flight finish (briefly), cancel the rest."""
        while self._unreported:
            self.send(*self._unreported.popleft())
        if self._sending:
            await asyncio.wait(list(self._sending), timeout=_REPORT_GRACE_S)
        for sent in list(self._sending):
            sent.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
