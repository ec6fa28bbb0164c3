"""Serving a same-host copy: answer ``CopyGo`` and hold the grant while the reader copies.

A reader on this host copies the blocks out of this process itself
(``reading/same_host.py``); the server only checks the grant, pins it, says
where the blocks are (``CopyGo``) and for how long it holds them (``hold_s``),
and unpins on the reader's ``CopyDone`` or at the hold's end::

    reader: t0 send ReadRequest ........ copy ....... t1   keep iff t1 - t0 < hold_s
    server:      recv, pin ----------------- hold_s ------------> unpin

Started by ``session.py`` (at once, or in the read's task).
"""

from __future__ import annotations

import asyncio
import logging

from kvbridge.transfer.blocks.ranges import head_span
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.serving.checks import direct_nbytes, read_budget_s
from kvbridge.transfer.serving.context import ServerContext, Session
from kvbridge.transfer.ucx.connection import UcxConnection, ignore_outcome

__all__ = ["CopyHold"]

logger = logging.getLogger(__name__)


class CopyHold:
    """A same-host copy under way: ``CopyGo`` sent, the grant pinned until it ends.

    Ends exactly once: by the reader's ``CopyDone`` or by the hold's end
    (``checks.read_budget_s``, announced in ``CopyGo`` as ``hold_s``; the
    reader drops a copy that ended later). It outlives its session: a reader
    whose connection broke may still be copying, so only the clock unpins then.
    The caller pinned the grant; the hold registers itself in ``session.holds``.
    """

    def __init__(
        self, ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, grant: str,
        session: Session,
    ) -> None:
        self._ctx, self._req, self._grant, self._session = ctx, req, grant, session
        self._ended = False
        local = ctx.local
        span = head_span(local, req.head_start, req.head_end)
        assert span is not None  # check_request
        hold_s = read_budget_s(ctx.config, req)
        # Started before the reader can hear of it: the reader times from before it asked.
        self._timer = asyncio.get_running_loop().call_later(hold_s, self._late)
        session.holds[req.xfer_id] = self
        ctx.num_holds += 1
        origins = local.plane_origins(slice(req.layer_start, req.layer_end))
        go = wire.CopyGo(req.xfer_id, origins.tobytes(), local.plane_block_nbytes, span.offset,
                         span.nbytes, hold_s, local.place())
        try:
            conn.post_frame(ctx.codec.encode(go)).add_done_callback(ignore_outcome)
        except TransferError as exc:  # the connection is gone; the reader may not know yet
            logger.info("copy go %d for %s not sent: %s", req.xfer_id, conn.peer, exc)
        # The reader copies now, on this host's cores: spinning would take one from it.
        conn.stop_spinning()

    def _late(self) -> None:
        logger.info("same-host copy %d: no CopyDone within its hold", self._req.xfer_id)
        self.end(served=False)

    def end(self, *, served: bool) -> None:
        """Unpin the grant (once); ``served``: the reader copied it all."""
        if self._ended:
            return
        self._ended = True
        self._timer.cancel()
        ctx, req = self._ctx, self._req
        if served:
            ctx.num_bytes_served += direct_nbytes(ctx.local, req)
            ctx.num_reads_served += 1
        ctx.num_holds -= 1
        ctx.grants.end_read(self._grant)
        self._session.holds.pop(req.xfer_id, None)
        self._session.reads.pop(req.xfer_id, None)
