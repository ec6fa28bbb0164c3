"""The serving half of a transfer agent: one session per accepted connection.

``serve_connection`` is the listener's connect handler (``agent.py`` passes it to
``UcxWorker.listen``). A session handshakes, then dispatches control messages
until the reader leaves, goes silent, or misbehaves. Any bad message ends only
that session (logged, typed ``Reject`` when there is something useful to say);
the agent goes on serving everyone else.

Serving one read (``ReadRequest`` with a grant)::

    check heads/layers/chunking -> wait (<= grant_wait_s) for a grant not issued yet
    -> fix its reader count from the Hello's topology -> grants.begin_read (pins it)
    -> DataHeader -> for each chunk i: wait for Credit > i, take a staging
    buffer, pack (executor thread), send on channel (xfer_id, i)
    -> grants.end_read

A direct read (block memory to block memory) of a grant already issued, the
usual case, is served without a task: the dispatcher checks it and posts every
chunk as it decodes the request (``_start_direct``); callbacks unpin the grant
when the sends end or their deadline passes (``_DirectSends``). A same-host
copy (``local_copy.py``) is answered with ``CopyGo`` the same way; the grant
stays pinned until the reader's ``CopyDone`` or the hold's end (``_CopyHold``).

The engine hands the grant token to D before its workers have issued it (the
token travels in the HTTP answer while the next engine step issues it), so a
read or done report naming an unknown token waits up to ``grant_wait_s`` for it.
The token a reader names is the grant table's own key (the engine's token is
issued as is, ``GrantTable.issue(token=...)``): no second namespace to map.
The number of readers to expect is only known once D's first reader says who it
is: each session computes it from its Hello (``num_expected_readers``) and fixes
it on every grant it touches that was issued without one.

Credits make the reader post its receive before the server sends, so a staging
buffer is never held waiting on a reader that is itself waiting for buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvbridge.errors import ConfigError
from kvbridge.kernels import pack
from kvbridge.topology import num_expected_readers
from kvbridge.transfer import grants as grant_errors
from kvbridge.transfer import wire
from kvbridge.transfer.clock import Clock
from kvbridge.transfer.config import AgentConfig, LocalKV, topology_from_info
from kvbridge.transfer.direct import MAX_RANGES_PER_CHUNK, block_ranges, head_span, num_planes
from kvbridge.transfer.errors import PeerClosedError, PeerTimeoutError, ProtocolError, TransferError
from kvbridge.transfer.grants import GrantTable
from kvbridge.transfer.handshake import Identity, recv_msg, reject, send_msg, serve_handshake
from kvbridge.transfer.iov import post_send_iov
from kvbridge.transfer.local_copy import ProbeCell
from kvbridge.transfer.staging import Buffer, BufferPool
from kvbridge.transfer.ucp_lib import UcpLibrary
from kvbridge.transfer.ucx import UcxConnection

logger = logging.getLogger(__name__)

R = wire.RejectReason
IovArray = npt.NDArray[np.uint64]  # ucp_dt_iov_t[n] (iov.iov_array)
_GRANT_POLL_S = 0.05  # a fallback: issue_grant wakes waiters at once
_GRANT_REASONS: list[tuple[type[Exception], wire.RejectReason]] = [
    (grant_errors.ExpiredGrantError, R.EXPIRED_GRANT),
    (grant_errors.UnknownGrantError, R.UNKNOWN_GRANT),
    (grant_errors.BlockNotGrantedError, R.NOT_GRANTED),
]


def channel_of(xfer_id: int, chunk: int) -> int:
    """UCX channel of one data chunk: ``[xfer_id : 20][chunk : 16]``."""
    return (xfer_id << 16) | chunk


@dataclass(slots=True)
class ServerContext:
    """What every session of one agent shares (owned by the agent)."""

    me: Identity
    local: LocalKV
    grants: GrantTable
    config: AgentConfig
    pool: BufferPool
    executor: Executor
    clock: Clock
    codec: wire.MessageCodec = field(default_factory=wire.MessageCodec)
    ucp: UcpLibrary = field(default_factory=UcpLibrary)
    reports: set[asyncio.Task[None]] = field(default_factory=set)  # done reports waiting
    # Set (and replaced) each time the engine issues a grant: see ``grant_issued``.
    issued: asyncio.Event = field(default_factory=asyncio.Event)
    sessions: set[Session] = field(default_factory=set)  # open sessions
    num_sessions_total: int = 0
    num_bytes_served: int = 0  # KV bytes of reads served to the end
    num_data_bytes_sent: int = 0  # KV bytes handed to UCX on data channels
    num_reads_served: int = 0
    # Same-host copies: offered in the handshake when set (see ``local_copy.py``).
    probe: ProbeCell | None = None
    host: wire.HostInfo | None = None
    num_holds: int = 0  # same-host copies pinned right now, sessions ended or not
    num_board_copies: int = 0  # same-host copies made on the grant board's word


@dataclass(eq=False, slots=True)
class Session:
    """What one open connection has in flight (registered in ``ServerContext.sessions``)."""

    reads: dict[int, _Read] = field(default_factory=dict)  # xfer id -> credit state
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # reads being served
    holds: dict[int, _CopyHold] = field(default_factory=dict)  # xfer id -> copy under way


class _Read:
    """Credit state of one read being served."""

    def __init__(self) -> None:
        self.credit = 0
        self.changed = asyncio.Event()

    def grant_credit(self, num_chunks: int) -> None:
        if num_chunks > self.credit:
            self.credit = num_chunks
            self.changed.set()

    async def wait_credit(self, num_chunks: int, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while self.credit < num_chunks:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise PeerTimeoutError(
                f"no credit for chunk {num_chunks - 1} in {timeout_s}s"
            ) from None


def _expected_readers(ctx: ServerContext, hello: wire.Hello) -> int:
    """Readers of the hello's engine that will report to this rank (1 without a topology).

    Raises:
        ConfigError: the reader's topology is invalid or cannot pair with ours.
    """
    if hello.topology is None:
        return 1
    try:
        reader = topology_from_info(hello.topology)
    except ValueError as exc:  # ConfigError is one; an unknown layout name another
        raise ConfigError(f"bad reader topology: {exc}") from None
    local = ctx.local
    return num_expected_readers(reader, local.topology, local.tp_rank, local.pp_rank)


def grant_issued(ctx: ServerContext) -> None:
    """Wake every read or report waiting for a grant (loop thread; the agent calls it)."""
    woken, ctx.issued = ctx.issued, asyncio.Event()
    woken.set()


async def _await_grant(ctx: ServerContext, token: str, num_readers: int) -> None:
    """Wait for grant ``token`` to be issued.

    Returns as soon as the table knows the token (live or released), else after
    ``grant_wait_s`` (the caller's grant call then raises ``UnknownGrantError``).
    A live grant issued without a reader count gets ``num_readers``. Woken by
    ``grant_issued``; it also looks every ``_GRANT_POLL_S`` (grants issued on the
    table directly, not through the agent, wake nobody).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.config.grant_wait_s
    while not ctx.grants.is_known(token) and (left_s := deadline - loop.time()) > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left_s, _GRANT_POLL_S)):
                await ctx.issued.wait()
    # unknown or released: the grant call that follows says so
    _fix_readers(ctx, token, num_readers)


def _fix_readers(ctx: ServerContext, token: str, num_readers: int) -> None:
    """Give a live grant issued without a reader count this session's (else nothing)."""
    with contextlib.suppress(grant_errors.GrantError):
        ctx.grants.set_expected_readers(token, num_readers)


async def serve_connection(ctx: ServerContext, conn: UcxConnection) -> None:
    """Run one session to its end; never raises (failures are logged)."""
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
            num_readers = _expected_readers(ctx, hello)
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
                    reads[msg.xfer_id] = _Read()
                    if not _start_direct(ctx, conn, msg, session, num_readers):
                        task = asyncio.create_task(
                            _serve_read(ctx, conn, msg, session, num_readers)
                        )
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                case wire.Credit(xfer_id=xfer_id, num_chunks=num_chunks):
                    if xfer_id in reads:  # else: a read that already failed
                        reads[xfer_id].grant_credit(num_chunks)
                case wire.CopyDone(xfer_id=xfer_id, ok=ok):
                    hold = session.holds.get(xfer_id)
                    if hold is not None:  # else: its hold already ended
                        hold.end(served=ok)
                case wire.ReadDone(grant=token, reader_id=reader_id, ok=ok):
                    if msg.copied_nbytes:  # a copy on the board's word: counted only
                        ctx.num_board_copies += 1
                        ctx.num_reads_served += 1
                        ctx.num_bytes_served += msg.copied_nbytes
                    # Not cancelled with the session: a reader may say goodbye right
                    # after its report, and the report must still count.
                    report = asyncio.create_task(
                        _reader_done(ctx, token, reader_id, ok, num_readers)
                    )
                    ctx.reports.add(report)
                    report.add_done_callback(ctx.reports.discard)
                case wire.RenewLease(grant=token, lease_s=lease_s, xfer_id=xfer_id):
                    await _renew(ctx, conn, token, lease_s, xfer_id)
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
    ctx: ServerContext, token: str, reader_id: str, ok: bool, num_readers: int
) -> None:
    await _await_grant(ctx, token, num_readers)
    try:
        if ok:
            ctx.grants.reader_done(token, reader_id)
        else:
            ctx.grants.reader_failed(token, reader_id)
    except grant_errors.GrantError as exc:  # e.g. a long-forgotten grant: nothing to do
        logger.info("done report from %s ignored: %s", reader_id, exc)


async def _renew(
    ctx: ServerContext, conn: UcxConnection, token: str, lease_s: float, xfer_id: int
) -> None:
    """Renew ``token`` for the reader's read ``xfer_id``; the answer names that read.

    A refusal (grant unknown, expired or being released) fails that read alone
    on the reader's side, never the connection (``Reject(renewal=True)``).
    """
    try:
        expires_at = ctx.grants.renew(token, lease_s)
    except grant_errors.GrantError as exc:
        await reject(conn, ctx.codec, _grant_reason(exc), str(exc), xfer_id, renewal=True)
        return
    remaining = max(0.0, expires_at - ctx.clock.now())
    reply = wire.LeaseRenewed(token, remaining, xfer_id)
    await send_msg(conn, ctx.codec, reply, ctx.config.reply_timeout_s)


def _grant_reason(exc: Exception) -> wire.RejectReason:
    for kind, reason in _GRANT_REASONS:
        if isinstance(exc, kind):
            return reason
    return R.BAD_REQUEST


def _problem(ctx: ServerContext, req: wire.ReadRequest) -> str | None:
    """Return what is wrong with ``req`` for this server, or None."""
    if req.local_copy:
        if ctx.host is None:
            return "this server offers no same-host copies"
        if not req.direct:
            return "a same-host copy must be a direct read"
        num_origins = (req.layer_end - req.layer_start) * num_planes(ctx.local)
        if num_origins > wire.MAX_COPY_ORIGINS:
            return f"same-host copy of {num_origins} planes > limit {wire.MAX_COPY_ORIGINS}"
    return _check_request(ctx.local, req, 4 * ctx.config.chunk_nbytes)


def _check_request(local: LocalKV, req: wire.ReadRequest, max_chunk_nbytes: int) -> str | None:
    """Return what is wrong with ``req`` for this rank, or None."""
    if not 0 <= req.head_start < req.head_end <= local.num_heads:
        return f"heads [{req.head_start}, {req.head_end}) outside [0, {local.num_heads})"
    if not 0 <= req.layer_start < req.layer_end <= len(local.layers):
        return f"layers [{req.layer_start}, {req.layer_end}) outside [0, {len(local.layers)})"
    bad = [b for b in req.block_ids if b >= local.num_blocks]
    if bad:
        return f"block ids {bad[:8]} outside [0, {local.num_blocks})"
    chunk_nbytes = req.chunk_blocks * _block_nbytes(local, req)
    if req.chunk_blocks > 1 and chunk_nbytes > max_chunk_nbytes:
        return f"chunk of {chunk_nbytes} bytes > limit {max_chunk_nbytes}"
    if math.ceil(len(req.block_ids) / req.chunk_blocks) > wire.MAX_CHUNKS:
        return f"more than {wire.MAX_CHUNKS} chunks"
    if req.direct:
        if head_span(local, req.head_start, req.head_end) is None:
            return (f"heads [{req.head_start}, {req.head_end}) of this {local.topology.layout} "
                    f"cache are not one run per block: read them staged")
        num_ranges = req.chunk_blocks * (req.layer_end - req.layer_start) * num_planes(local)
        if num_ranges > MAX_RANGES_PER_CHUNK:
            return f"direct chunk of {num_ranges} ranges > limit {MAX_RANGES_PER_CHUNK}"
    return None


def _block_nbytes(local: LocalKV, req: wire.ReadRequest) -> int:
    num_heads = req.head_end - req.head_start
    per_layer = local.block_nbytes * num_heads // local.num_heads
    return per_layer * (req.layer_end - req.layer_start)


async def _serve_read(
    ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, session: Session,
    num_readers: int,
) -> None:
    reads = session.reads
    problem = _problem(ctx, req)
    if problem is not None:
        reads.pop(req.xfer_id, None)
        await reject(conn, ctx.codec, R.BAD_REQUEST, problem, req.xfer_id)
        return
    token = req.grant
    await _await_grant(ctx, token, num_readers)
    refusal = _pin(ctx, token, req)
    if refusal is not None:
        reads.pop(req.xfer_id, None)
        if refusal[0] is R.PROMPT_MISMATCH:
            logger.warning("read %d from %s names another prompt than its grant", req.xfer_id,
                           conn.peer)
        await reject(conn, ctx.codec, *refusal, req.xfer_id)
        return
    if req.local_copy:
        try:
            if ctx.config.test_chunk_delay_s:  # test-only knob (see AgentConfig)
                await asyncio.sleep(ctx.config.test_chunk_delay_s * _num_chunks(req))
        except BaseException:
            ctx.grants.end_read(token)
            reads.pop(req.xfer_id, None)
            raise
        _CopyHold(ctx, conn, req, token, session)
        return
    try:
        if req.direct:
            await _send_direct(ctx, conn, req)
        else:
            await _send_chunks(ctx, conn, req, reads[req.xfer_id])
        ctx.num_reads_served += 1
    except TransferError as exc:
        logger.info("read %d for %s failed: %s", req.xfer_id, conn.peer, exc)
        conn.abort()  # the reader may hold posted receives for chunks we never send
    finally:
        ctx.grants.end_read(token)
        reads.pop(req.xfer_id, None)


def _pin(ctx: ServerContext, token: str, req: wire.ReadRequest) -> tuple[R, str] | None:
    """Pin grant ``token`` for ``req`` (``begin_read``), or say why the read may not go on.

    Returns None with the grant pinned (the caller must ``end_read`` it), else
    ``(reason, message)`` for the ``Reject`` with nothing pinned.
    """
    try:
        grant = ctx.grants.begin_read(token, req.block_ids)
    except grant_errors.GrantError as exc:
        return _grant_reason(exc), str(exc)
    if grant.prompt_digest is not None and not hmac.compare_digest(
        grant.prompt_digest, req.prompt_digest
    ):
        ctx.grants.end_read(token)
        return R.PROMPT_MISMATCH, "the grant holds the KV of another prompt"
    return None


async def _send_chunks(
    ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, state: _Read
) -> None:
    cfg, local = ctx.config, ctx.local
    block_nbytes = _block_nbytes(local, req)
    num_blocks = len(req.block_ids)
    num_chunks = math.ceil(num_blocks / req.chunk_blocks)
    header = wire.DataHeader(req.xfer_id, num_chunks, num_blocks * block_nbytes)
    await send_msg(conn, ctx.codec, header, cfg.reply_timeout_s)
    layers = local.layers[req.layer_start : req.layer_end]
    loop = asyncio.get_running_loop()
    sends: list[asyncio.Task[None]] = []
    try:
        for chunk in range(num_chunks):
            if cfg.test_chunk_delay_s:  # test-only knob (see AgentConfig)
                await asyncio.sleep(cfg.test_chunk_delay_s)
            await state.wait_credit(chunk + 1, cfg.chunk_timeout_s)
            ids = req.block_ids[chunk * req.chunk_blocks : (chunk + 1) * req.chunk_blocks]
            nbytes = len(ids) * block_nbytes
            [buf] = await ctx.pool.acquire(nbytes, timeout_s=cfg.chunk_timeout_s)
            staging = torch.from_numpy(buf)
            try:
                await loop.run_in_executor(
                    ctx.executor, _pack, layers, ids, req, local, staging
                )
            except BaseException:
                ctx.pool.release(buf)
                raise
            sends.append(asyncio.create_task(_send_one(ctx, conn, buf, nbytes, req.xfer_id, chunk)))
        await asyncio.gather(*sends)
    finally:
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
    ctx.num_bytes_served += num_blocks * block_nbytes


def _start_direct(
    ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, session: Session,
    num_readers: int,
) -> bool:
    """Serve a direct read at once, without a task, if nothing about it needs waiting.

    The common case: a good request naming a grant this table already knows.
    Posts every chunk now and finishes in ``_DirectSends`` callbacks (a
    same-host copy: answers ``CopyGo`` and pins in a ``_CopyHold``). Returns
    False, with nothing pinned (at most the grant's reader count fixed, as
    ``_serve_read`` would), when ``_serve_read`` must take the request (not
    direct, a test delay, a problem to reject, a grant to wait for or to
    refuse); that path checks everything again and answers.
    """
    if not req.direct or ctx.config.test_chunk_delay_s:
        return False
    if _problem(ctx, req) is not None:
        return False
    token = req.grant
    if not ctx.grants.is_known(token):
        return False
    _fix_readers(ctx, token, num_readers)
    if _pin(ctx, token, req) is not None:
        return False
    if req.local_copy:
        _CopyHold(ctx, conn, req, token, session)
    else:
        _DirectSends(ctx, conn, req, token, session.reads)
    return True


class _DirectSends:
    """One direct read served by callbacks: chunks posted, then one deadline for all.

    Ends exactly once, by the sends completing or failing or by the deadline
    (``chunk_timeout_s`` per chunk, which aborts the connection); then the grant
    is unpinned and the read forgotten.
    """

    def __init__(
        self, ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, token: str,
        reads: dict[int, _Read],
    ) -> None:
        self._ctx, self._conn, self._req, self._token, self._reads = ctx, conn, req, token, reads
        self._ended = False
        self._timer: asyncio.TimerHandle | None = None
        sends: list[asyncio.Future[None]] = []
        try:
            for channel, iov in _direct_chunks(ctx.local, req):
                sends.append(_post_chunk(ctx, conn, iov, channel))
        except Exception as exc:  # UCX refused (typed), or a bug: this read fails, alone
            if not isinstance(exc, TransferError):
                logger.exception("direct read %d for %s crashed", req.xfer_id, conn.peer)
            for sent in sends:
                sent.add_done_callback(_ignore_outcome)
            self._end(exc)
            return
        all_sent: asyncio.Future[Any] = asyncio.gather(*sends) if len(sends) > 1 else sends[0]
        all_sent.add_done_callback(self._sent)
        self._timer = asyncio.get_running_loop().call_later(
            ctx.config.chunk_timeout_s * len(sends), self._late
        )

    def _sent(self, all_sent: asyncio.Future[Any]) -> None:
        if all_sent.cancelled():
            self._end(PeerClosedError("iov send cancelled"))
        else:
            self._end(all_sent.exception())

    def _late(self) -> None:
        self._end(PeerTimeoutError(f"iov send to {self._conn.peer}: no completion in time"))

    def _end(self, error: BaseException | None) -> None:
        if self._ended:
            return
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
        ctx, req = self._ctx, self._req
        if error is None:
            ctx.num_bytes_served += _direct_nbytes(ctx.local, req)
            ctx.num_reads_served += 1
        else:
            logger.info("read %d for %s failed: %s", req.xfer_id, self._conn.peer, error)
            self._conn.abort()  # the reader may hold posted receives for chunks we never send
        ctx.grants.end_read(self._token)
        self._reads.pop(req.xfer_id, None)


class _CopyHold:
    """A same-host copy under way: ``CopyGo`` sent, the grant pinned until it ends.

    Ends exactly once: by the reader's ``CopyDone`` or by the hold's end
    (``chunk_timeout_s`` per chunk, announced in ``CopyGo`` as ``hold_s``; the
    reader drops a copy that ended later). It outlives its session: a reader
    whose connection broke may still be copying, so only the clock unpins then.
    """

    def __init__(
        self, ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest, token: str,
        session: Session,
    ) -> None:
        self._ctx, self._req, self._token, self._session = ctx, req, token, session
        self._ended = False
        local = ctx.local
        span = head_span(local, req.head_start, req.head_end)
        assert span is not None  # _check_request
        hold_s = ctx.config.chunk_timeout_s * _num_chunks(req)
        # Started before the reader can hear of it: the reader times from before it asked.
        self._timer = asyncio.get_running_loop().call_later(hold_s, self._late)
        session.holds[req.xfer_id] = self
        ctx.num_holds += 1
        origins = local.plane_origins(slice(req.layer_start, req.layer_end))
        go = wire.CopyGo(req.xfer_id, origins.tobytes(), local.plane_block_nbytes, span.offset,
                         span.nbytes, hold_s, local.place())
        try:
            conn.post_frame(ctx.codec.encode(go)).add_done_callback(_ignore_outcome)
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
            ctx.num_bytes_served += _direct_nbytes(ctx.local, req)
            ctx.num_reads_served += 1
        ctx.num_holds -= 1
        ctx.grants.end_read(self._token)
        self._session.holds.pop(req.xfer_id, None)
        self._session.reads.pop(req.xfer_id, None)


def _num_chunks(req: wire.ReadRequest) -> int:
    return math.ceil(len(req.block_ids) / req.chunk_blocks)


def _direct_chunks(local: LocalKV, req: wire.ReadRequest) -> list[tuple[int, IovArray]]:
    """``(channel, iov)`` of each chunk of a direct read, in order."""
    span = head_span(local, req.head_start, req.head_end)
    assert span is not None  # _check_request
    layers = slice(req.layer_start, req.layer_end)
    ids = np.asarray(req.block_ids, dtype=np.int64)
    chunks = []
    for chunk in range(math.ceil(ids.size / req.chunk_blocks)):
        chunk_ids = ids[chunk * req.chunk_blocks : (chunk + 1) * req.chunk_blocks]
        iov = block_ranges(local, chunk_ids, layers, span)
        chunks.append((channel_of(req.xfer_id, chunk), iov))
    return chunks


def _post_chunk(
    ctx: ServerContext, conn: UcxConnection, iov: IovArray, channel: int
) -> asyncio.Future[None]:
    ctx.num_data_bytes_sent += int(iov[:, 1].sum())
    return post_send_iov(ctx.ucp, conn, iov, channel)


def _direct_nbytes(local: LocalKV, req: wire.ReadRequest) -> int:
    span = head_span(local, req.head_start, req.head_end)
    assert span is not None  # _check_request
    num_layers = req.layer_end - req.layer_start
    return len(req.block_ids) * num_layers * num_planes(local) * span.nbytes


async def _send_direct(ctx: ServerContext, conn: UcxConnection, req: wire.ReadRequest) -> None:
    """Send each chunk as one message straight from the cache blocks (see ``direct.py``).

    Every chunk is posted at once (the reader posted the first chunk's receive
    before asking and posts the others right after, long before they land), then
    awaited under one deadline of ``chunk_timeout_s`` per chunk. ``_start_direct``
    is the same without a task; this one waits for grants and honours the test delay.
    """
    cfg = ctx.config
    sends: list[asyncio.Future[None]] = []
    try:
        for channel, iov in _direct_chunks(ctx.local, req):
            if cfg.test_chunk_delay_s:  # test-only knob (see AgentConfig)
                await asyncio.sleep(cfg.test_chunk_delay_s)
            sends.append(_post_chunk(ctx, conn, iov, channel))
        all_sent = asyncio.gather(*sends) if len(sends) > 1 else sends[0]
        await conn.wait(all_sent, timeout_s=cfg.chunk_timeout_s * len(sends), what="iov send")
    finally:
        for sent in sends:
            if not sent.done():
                sent.add_done_callback(_ignore_outcome)
    ctx.num_bytes_served += _direct_nbytes(ctx.local, req)


def _ignore_outcome(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def _pack(
    layers: list[torch.Tensor], ids: list[int], req: wire.ReadRequest, local: LocalKV,
    staging: torch.Tensor,
) -> None:
    pack(layers, ids, req.head_start, req.head_end, local.topology.layout, out=staging)


async def _send_one(
    ctx: ServerContext, conn: UcxConnection, buf: Buffer, nbytes: int, xfer_id: int, chunk: int
) -> None:
    try:
        channel = channel_of(xfer_id, chunk)
        ctx.num_data_bytes_sent += nbytes
        await conn.send(buf[:nbytes], channel, timeout_s=ctx.config.chunk_timeout_s)
    except BaseException:
        ctx.pool.discard()  # UCX may still read it: never reuse
        raise
    ctx.pool.release(buf)
