"""The serving half of a transfer agent: one session per accepted connection.

``serve_connection`` is the listener's connect handler (``agent.py`` passes it to
``UcxWorker.listen``). A session handshakes, then dispatches control messages
until the reader leaves, goes silent, or misbehaves. Any bad message ends only
that session (logged, typed ``Reject`` when there is something useful to say);
the agent goes on serving everyone else.

Serving one read (``ReadRequest`` with a grant)::

    check heads/layers/chunking (checks.py) -> wait (<= grant_wait_s) for a grant
    not issued yet -> fix its reader count from the Hello's topology
    -> grants.begin_read (pins it; the read's deadline: checks.read_budget_s)
    -> send, one way of three, ended by that deadline at the latest:
         staged.py      DataHeader, then per credited chunk: pack, send
         direct.py      every chunk straight from the cache blocks
         copy_hold.py   CopyGo: the reader on this host copies the blocks itself
    -> grants.end_read

While the read is served (and only then) the reader may renew the grant's
lease for it (``RenewLease`` naming its xfer id), never past its deadline
(``_renew``).

A direct read or same-host copy of a grant already issued, the usual case, is
served without a task: the dispatcher checks it and starts it as it decodes the
request (``_start_at_once``); callbacks unpin the grant when it ends. Anything
else (a staged read, a grant to wait for, a problem to reject) runs in a
task (``_serve_read``), which checks everything again and answers.

The grant a reader names is the grant table's own key (the engine's grant
string is issued as is, ``GrantTable.issue(grant=...)``): no second namespace
to map.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvbridge.errors import ConfigError
from kvbridge.transfer.errors import PeerTimeoutError, ProtocolError, TransferError
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import recv_msg, reject, send_msg, serve_handshake
from kvbridge.transfer.serving import grants as grant_errors
from kvbridge.transfer.serving.checks import (
    grant_reason,
    num_chunks,
    pin,
    problem,
    read_budget_s,
)
from kvbridge.transfer.serving.context import (
    ServedRead,
    ServerContext,
    Session,
    await_grant,
    expected_readers,
    fix_readers,
)
from kvbridge.transfer.serving.copy_hold import CopyHold
from kvbridge.transfer.serving.direct import DirectSends
from kvbridge.transfer.serving.staged import send_chunks
from kvbridge.transfer.ucx.connection import UcxConnection

__all__ = ["serve_connection"]

logger = logging.getLogger(__name__)

R = wire.RejectReason


async def serve_connection(ctx: ServerContext, conn: UcxConnection) -> None:
    """Run one session to its end; never raises (failures are logged).

    A connection beyond ``AgentConfig.max_sessions`` open ones is refused at once
    (``Reject(BUSY)`` instead of a ``Challenge``), so a flood of connections takes
    neither memory nor tasks beyond the cap; one that fails the handshake is
    closed as soon as it is told why.
    """
    if len(ctx.sessions) >= ctx.config.max_sessions:
        ctx.num_sessions_refused += 1
        await reject(conn, ctx.codec, R.BUSY,
                     f"this agent serves {len(ctx.sessions)} connections, its max_sessions: "
                     f"retry later, or raise AgentConfig.max_sessions on the server")
        conn.abort()
        return
    session = Session()
    ctx.sessions.add(session)
    ctx.num_sessions_total += 1
    reads, tasks = session.reads, session.tasks
    cfg = ctx.config
    try:
        metadata = ctx.local.metadata(ctx.me.engine_id, None, ctx.host)
        hello = await serve_handshake(
            conn, ctx.codec, ctx.me, metadata,
            max_nbytes=cfg.max_frame_nbytes, timeout_s=cfg.handshake_timeout_s,
        )
        if hello is None:
            return
        try:
            num_readers = expected_readers(ctx, hello)
        except ConfigError as exc:
            await reject(conn, ctx.codec, R.BAD_REQUEST, str(exc))
            return
        logger.debug("session with %s rank %d on %s (%d readers)", hello.engine_id,
                     hello.rank, conn.peer, num_readers)
        while True:
            msg = await recv_msg(conn, ctx.codec, cfg.max_frame_nbytes, cfg.server_idle_timeout_s)
            match msg:
                case wire.ReadRequest():
                    if msg.xfer_id in reads:
                        raise ProtocolError(f"xfer id {msg.xfer_id} reused while in flight")
                    reads[msg.xfer_id] = ServedRead(msg.grant)
                    if not _start_at_once(ctx, conn, msg, session, num_readers):
                        task = asyncio.create_task(
                            _serve_read(ctx, conn, msg, session, num_readers)
                        )
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                case wire.Credit(xfer_id=xfer_id, num_chunks=credited):
                    if xfer_id in reads:  # else: a read that already failed
                        reads[xfer_id].grant_credit(credited)
                case wire.CopyDone(xfer_id=xfer_id, ok=ok):
                    hold = session.holds.get(xfer_id)
                    if hold is not None:
                        hold.end(served=ok)
                    elif xfer_id in reads:  # not pinned yet: the reader copied on the board
                        reads[xfer_id].withdrawn = True  # word meanwhile; never pin it
                    # else: its hold already ended
                case wire.ReadDone(grant=grant, reader_id=reader_id, ok=ok):
                    if msg.copied_nbytes:  # a copy on the board's word: counted only
                        ctx.num_board_copies += 1
                        ctx.num_reads_served += 1
                        ctx.num_bytes_served += msg.copied_nbytes
                    # Not cancelled with the session: a reader may say goodbye right
                    # after its report, and the report must still count.
                    report = asyncio.create_task(
                        _reader_done(ctx, grant, reader_id, ok, num_readers)
                    )
                    ctx.reports.add(report)
                    report.add_done_callback(ctx.reports.discard)
                case wire.RenewLease():
                    await _renew(ctx, conn, session, msg)
                case wire.Ping(seq=seq):
                    await send_msg(conn, ctx.codec, wire.Pong(seq), cfg.reply_timeout_s)
                case wire.Bye():
                    return
                case _:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from a reader")
    except ProtocolError as exc:
        logger.warning("dropping %s: %s", conn.peer, exc)
        await reject(conn, ctx.codec, R.BAD_REQUEST, str(exc))
    except TransferError as exc:
        logger.info("session with %s ended: %s", conn.peer, exc)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        conn.abort()
        ctx.sessions.discard(session)


async def _reader_done(
    ctx: ServerContext, grant: str, reader_id: str, ok: bool, num_readers: int
) -> None:
    await await_grant(ctx, grant, num_readers)
    try:
        if ok:
            ctx.grants.reader_done(grant, reader_id)
        else:
            ctx.grants.reader_failed(grant, reader_id)
    except grant_errors.GrantError as exc:  # e.g. a long-forgotten grant: nothing to do
        logger.info("done report from %s ignored: %s", reader_id, exc)


async def _renew(
    ctx: ServerContext, conn: UcxConnection, session: Session, msg: wire.RenewLease
) -> None:
    """Renew the grant for the reader's read ``msg.xfer_id``; the answer names that read.

    Only for a read of that grant this session serves, its grant pinned, and
    never past that read's deadline (``GrantTable.renew``): a reader that is not
    reading, or copies on the grant board's word (the server never hears of
    such copies), cannot keep the blocks held. A refusal never ends the
    connection (``Reject(renewal=True)``): a grant that is gone (unknown,
    expired, being released; checked first) fails that read on the reader's
    side; ``NO_READ`` extends nothing and leaves the read to its own outcome.
    """
    grant, xfer_id = msg.grant, msg.xfer_id
    read = session.reads.get(xfer_id)
    try:
        # ``read.grant`` came from this same peer: comparing it with == leaks nothing.
        if read is None or read.deadline is None or read.grant != grant:
            ctx.grants.validate_read(grant, ())  # a grant that is gone says so first
            raise grant_errors.NoReadInFlightError(
                f"this connection serves no read {xfer_id} of the grant: a lease is renewed "
                f"only for a read in flight, up to that read's deadline"
            )
        expires_at = ctx.grants.renew(grant, msg.lease_s, until=read.deadline)
    except grant_errors.GrantError as exc:
        await reject(conn, ctx.codec, grant_reason(exc), str(exc), xfer_id, renewal=True)
        return
    remaining = max(0.0, expires_at - ctx.clock.now())
    reply = wire.LeaseRenewed(grant, remaining, xfer_id)
    await send_msg(conn, ctx.codec, reply, ctx.config.reply_timeout_s)


async def _serve_read(
    ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, session: Session,
    num_readers: int,
) -> None:
    reads = session.reads
    bad = problem(ctx, req)
    if bad is not None:
        reads.pop(req.xfer_id, None)
        await reject(conn, ctx.codec, R.BAD_REQUEST, bad, req.xfer_id)
        return
    grant = req.grant
    early, started = not ctx.grants.is_known(grant), time.monotonic()
    await await_grant(ctx, grant, num_readers)
    if early:  # a read before its grant: how long it waited counts (the timeline)
        ctx.grant_waits.append(time.monotonic() - started)
    read = reads[req.xfer_id]
    if read.withdrawn:  # the reader copied on the grant board's word: nothing to answer
        reads.pop(req.xfer_id, None)
        return
    refusal = pin(ctx, grant, req, read)
    if refusal is not None:
        reads.pop(req.xfer_id, None)
        if refusal[0] is R.PROMPT_MISMATCH:
            logger.warning("read %d from %s names another prompt than its grant", req.xfer_id,
                           conn.peer)
        await reject(conn, ctx.codec, *refusal, req.xfer_id)
        return
    if req.local_copy:
        CopyHold(ctx, conn, req, grant, session)
        return
    if req.direct:
        DirectSends(ctx, conn, req, grant, reads)
        return
    try:
        await _send_staged(ctx, conn, req, read)
        ctx.num_reads_served += 1
    except TransferError as exc:
        logger.info("read %d for %s failed: %s", req.xfer_id, conn.peer, exc)
        conn.abort()  # the reader may hold posted receives for chunks we never send
    finally:
        ctx.grants.end_read(grant)
        reads.pop(req.xfer_id, None)


async def _send_staged(
    ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, read: ServedRead
) -> None:
    """``send_chunks`` within the read's budget (each wait of it has its own deadline too).

    Raises:
        PeerTimeoutError: the read outlived its budget (``read_budget_s``).
        TransferError: as ``send_chunks``.
    """
    budget_s = read_budget_s(ctx.config, req)
    try:
        async with asyncio.timeout(budget_s):
            await send_chunks(ctx, conn, req, read)
    except TimeoutError:
        raise PeerTimeoutError(f"staged read {req.xfer_id} not done in its {budget_s:.1f}s "
                               f"({num_chunks(req)} chunks x chunk_timeout_s, at most "
                               f"read_timeout_s)") from None


def _start_at_once(
    ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, session: Session,
    num_readers: int,
) -> bool:
    """Serve a direct read at once, without a task, if nothing about it needs waiting.

    The common case: a good request naming a grant this table already knows.
    Posts every chunk now and finishes in ``DirectSends`` callbacks (a
    same-host copy: answers ``CopyGo`` and pins in a ``CopyHold``). Returns
    False, with nothing pinned (at most the grant's reader count fixed, as
    ``_serve_read`` would), when ``_serve_read`` must take the request (not
    direct, a problem to reject, a grant to wait for or to refuse); that
    path checks everything again and answers.
    """
    if not req.direct:
        return False
    if problem(ctx, req) is not None:
        return False
    grant = req.grant
    if not ctx.grants.is_known(grant):
        return False
    fix_readers(ctx, grant, num_readers)
    if pin(ctx, grant, req, session.reads[req.xfer_id]) is not None:
        return False
    if req.local_copy:
        CopyHold(ctx, conn, req, grant, session)
    else:
        DirectSends(ctx, conn, req, grant, session.reads)
    return True
