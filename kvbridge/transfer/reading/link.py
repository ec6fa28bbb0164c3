"""The reading half's connection to one remote rank: ``PeerLink``.

``links.py`` opens a link the first time a read needs a remote (engine, rank),
keeps it while it is healthy, and opens a new one (with a new handshake and
fresh metadata) once it died. A link runs two tasks: a dispatcher that
receives every control message and hands replies to their waiters, and a
heartbeat that pings when the link is idle. A link silent for three heartbeats,
a message no read can own (a connection-wide ``Reject``, an unknown kind), or
bytes that may be landing in our memory unasked kill the link: every read on it
fails at once. An answer that fits no read's expectations (a ``CopyGo`` for a
staged read, ...) or a refused lease renewal fails only the read concerned.

Waiters are keyed by ``(kind, xfer id)``: ``("data", x)`` for read ``x``'s
answer, ``("renew", x)`` for the answer to the renewal read ``x`` asked for. One
waiter per key: a second is refused (``ReplyPendingError``), never swapped in.

Reading one plan item: the link prepares it (``strategy.prepare``), has
``strategy.choose`` pick its strategy (staged, direct or same-host copy, one
module each) and from then on only drives it through the interface they share
(``base.BegunRead``: begin, finish or abandon). Strategies use the link's
messaging (``send``, ``post``, ``request``, ``expect``, ``claim``, ``forget``,
``fail``) and nothing else of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence

from kvbridge.topology import RemoteRead
from kvbridge.transfer.errors import (
    LeaseRefusedError,
    NoReadServedError,
    PeerClosedError,
    PeerTimeoutError,
    ProtocolError,
    RejectedError,
    ReplyPendingError,
    TransferError,
)
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import reader_handshake, recv_msg, send_msg
from kvbridge.transfer.reading.base import BegunRead, ItemResult, ReaderContext, ReadSetup
from kvbridge.transfer.reading.jobs import ReadJob
from kvbridge.transfer.reading.same_host import SameHostPeer
from kvbridge.transfer.reading.server_meta import check_server_meta
from kvbridge.transfer.reading.strategy import choose, prepare
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import UcxWorker

__all__ = ["PeerLink"]

logger = logging.getLogger(__name__)

ReplyKey = tuple[str, int]  # (kind, xfer id): see the module docstring


class PeerLink:
    """A handshaked connection to one remote rank. Create with :meth:`open`."""

    def __init__(self, ctx: ReaderContext, conn: UcxConnection, meta: wire.AgentMetadata) -> None:
        self._ctx = ctx
        self._conn = conn
        self.meta = meta
        self._waiters: dict[ReplyKey, asyncio.Future[wire.Message]] = {}
        self._xfer_ids = itertools.count(1)
        self._ping_seq = itertools.count(1)
        self._error: TransferError | None = None
        self.num_received = 0  # control messages from the server: proof of life
        # Set when the server is on this host and lets us copy from it (same_host.py).
        self.same_host = (SameHostPeer.open(meta, conn.peer)
                          if ctx.copier is not None else None)
        self._tasks = [
            asyncio.create_task(self._dispatch()),
            asyncio.create_task(self._heartbeat()),
        ]

    @classmethod
    async def open(
        cls, ctx: ReaderContext, worker: UcxWorker, host: str, port: int, engine_id: str, rank: int
    ) -> PeerLink:
        """Connect and handshake with ``engine_id`` rank ``rank`` at ``host:port``.

        Raises:
            PeerUnreachableError, PeerTimeoutError, RejectedError, ProtocolError
            (also: the server's metadata does not fit our cache, ``server_meta.py``).
        """
        cfg = ctx.config
        conn = await worker.connect(host, port, timeout_s=cfg.connect_timeout_s)
        try:
            meta = await reader_handshake(
                conn, ctx.codec, ctx.me, engine_id, rank,
                max_nbytes=cfg.max_frame_nbytes, timeout_s=cfg.handshake_timeout_s,
            )
            check_server_meta(meta, ctx.local, conn.peer)  # before anything is sized on it
        except BaseException:
            conn.abort()
            raise
        return cls(ctx, conn, meta)

    @property
    def peer(self) -> str:
        """The server's address, for logs."""
        return self._conn.peer

    @property
    def alive(self) -> bool:
        """False once the link failed or was closed."""
        return self._error is None and not self._conn.closed

    @property
    def ctx(self) -> ReaderContext:
        """What the agent's links share (for read strategies)."""
        return self._ctx

    @property
    def conn(self) -> UcxConnection:
        """The connection (for read strategies: data receives on it)."""
        return self._conn

    def fail(self, error: TransferError) -> TransferError:
        """Kill the link: every waiter fails, the connection is aborted. Idempotent.

        Returns the link's error: ``error``, or the one it failed with before.
        """
        if self._error is None:
            self._error = error
            logger.info("link to %s failed: %s", self._conn.peer, error)
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(self._error)
        self._waiters.clear()
        self._conn.abort()
        # Its maps of the server's memory (grant board, caches) are the dead server's
        # memory: let them go now, not when the last reference to this link does.
        self.same_host = None
        return self._error

    def drop_same_host(self) -> None:
        """The kernel refused a copy: this link reads through UCX from now on."""
        self.same_host = None

    async def _dispatch(self) -> None:
        cfg, codec = self._ctx.config, self._ctx.codec
        try:
            while True:
                msg = await recv_msg(self._conn, codec, cfg.max_frame_nbytes, 3 * cfg.heartbeat_s)
                self.num_received += 1
                match msg:
                    case wire.DataHeader(xfer_id=xfer_id) | wire.CopyGo(xfer_id=xfer_id):
                        self._resolve(("data", xfer_id), msg)
                    case (wire.Reject(renewal=True, xfer_id=xfer_id)
                          | wire.LeaseRenewed(xfer_id=xfer_id)):
                        self._resolve(("renew", xfer_id), msg)
                    case wire.Reject(xfer_id=0, reason=reason, message=text):
                        raise RejectedError(reason, text)  # the server drops us
                    case wire.Reject(xfer_id=xfer_id):
                        self._resolve(("data", xfer_id), msg)
                    case wire.Pong():
                        pass
                    case wire.Bye(reason=reason):
                        raise PeerClosedError(f"{self._conn.peer} said goodbye: {reason}")
                    case _:
                        raise ProtocolError(f"unexpected {type(msg).__name__} from a server")
        except TransferError as exc:
            self.fail(exc)

    def expect(self, key: ReplyKey) -> asyncio.Future[wire.Message]:
        """A new future, registered as the one waiter for the reply under ``key``.

        Raises:
            ReplyPendingError: as ``claim``.
        """
        future: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self.claim(key, future)
        return future

    def claim(self, key: ReplyKey, future: asyncio.Future[wire.Message]) -> None:
        """Register ``future`` as the one waiter under ``key``; the caller sends after.

        Raises:
            ReplyPendingError: another request still waits under ``key`` (the
                first waiter keeps it; nothing was sent).
        """
        waiting = self._waiters.get(key)
        if waiting is not None and not waiting.done():
            raise ReplyPendingError(f"a reply to {key[0]} {key[1]} from {self._conn.peer} "
                                    f"is already awaited")
        self._waiters[key] = future

    def forget(self, key: ReplyKey, future: asyncio.Future[wire.Message]) -> bool:
        """Drop ``future``'s registration under ``key`` (not a later waiter's).

        Returns whether it was still registered (no reply had come for it).
        """
        if self._waiters.get(key) is future:
            del self._waiters[key]
            return True
        return False

    def _resolve(self, key: ReplyKey, msg: wire.Message) -> None:
        future = self._waiters.pop(key, None)
        if future is None or future.done():
            logger.debug("no waiter for %s from %s", key, self._conn.peer)
            return
        future.set_result(msg)

    async def _heartbeat(self) -> None:
        cfg = self._ctx.config
        try:
            while self.alive:
                await asyncio.sleep(cfg.heartbeat_s)
                await self.send(wire.Ping(next(self._ping_seq)))
        except TransferError as exc:
            self.fail(exc)

    async def send(self, msg: wire.Message) -> None:
        """Send ``msg`` and wait for UCX to finish it (``reply_timeout_s``).

        Raises:
            TransferError: the link is dead, or the send failed.
        """
        if self._error is not None:
            raise self._error
        await send_msg(self._conn, self._ctx.codec, msg, self._ctx.config.reply_timeout_s)

    def post(self, msg: wire.Message) -> asyncio.Future[None]:
        """Send ``msg`` without waiting for UCX to finish it; a failure kills the link.

        For messages whose effect the caller waits for anyway (a read request:
        its data or refusal has a deadline) or need not wait for (a done report:
        the lease covers a lost one).

        Raises:
            TransferError: the link is already dead.
        """
        if self._error is not None:
            raise self._error
        sent = self._conn.post_frame(self._ctx.codec.encode(msg))
        sent.add_done_callback(self._on_posted)
        return sent

    def post_quietly(self, msg: wire.Message) -> None:
        """``post`` a message whose loss costs only time; a dead link drops it."""
        with contextlib.suppress(TransferError):
            self.post(msg)

    def _on_posted(self, sent: asyncio.Future[None]) -> None:
        if sent.cancelled():
            return
        error = sent.exception()
        if error is not None:
            self.fail(error if isinstance(error, TransferError)
                      else TransferError(f"send to {self._conn.peer}: {error}"))

    async def request(self, key: ReplyKey, msg: wire.Message) -> wire.Message:
        """Send ``msg`` and return the server's reply under ``key``.

        Raises:
            RejectedError: the reply is a ``Reject`` (the link goes on).
            ReplyPendingError: a reply under ``key`` is already awaited.
            PeerTimeoutError: no reply within ``reply_timeout_s`` (the link is failed).
            TransferError: the link is dead.
        """
        if self._error is not None:
            raise self._error
        future = self.expect(key)
        try:
            await self.send(msg)
            async with asyncio.timeout(self._ctx.config.reply_timeout_s):
                reply = await future
        except TimeoutError:
            raise self.fail(PeerTimeoutError(
                f"no reply to {type(msg).__name__} from {self._conn.peer}")) from None
        finally:
            self.forget(key, future)
        if isinstance(reply, wire.Reject):
            raise RejectedError(reply.reason, reply.message)
        return reply

    async def notify(self, grant: str, reader_id: str, ok: bool) -> None:
        """Tell the server this reader is done with ``grant`` (``ok=False``: gave up)."""
        await self.send(wire.ReadDone(grant, reader_id, ok))

    def notify_nowait(self, grant: str, reader_id: str, copied_nbytes: int = 0
                      ) -> asyncio.Future[None]:
        """Report a successful read without waiting; the future ends with the send.

        A lost report costs only time: the server frees at lease expiry.
        ``copied_nbytes``: what the read copied on the grant board's word.

        Raises:
            TransferError: the link is already dead.
        """
        return self.post(wire.ReadDone(grant, reader_id, True, copied_nbytes))

    async def renew(self, grant: str, lease_s: float, xfer_id: int) -> float:
        """Extend the grant's lease for read ``xfer_id``; return the seconds the server grants.

        Raises:
            LeaseRefusedError: the server refused (grant unknown, expired or being
                released): read ``xfer_id`` should fail; the link goes on.
            NoReadServedError: (a ``LeaseRefusedError``) the server serves no read
                ``xfer_id`` of this grant and extended nothing; the read's own
                outcome stands.
            ReplyPendingError: a renewal for read ``xfer_id`` is already waiting.
            ProtocolError: the answer is not a ``LeaseRenewed``.
            PeerTimeoutError, PeerClosedError: no answer (the link is failed).
        """
        renewal = wire.RenewLease(grant, lease_s, xfer_id)
        try:
            reply = await self.request(("renew", xfer_id), renewal)
        except RejectedError as exc:
            refused = (NoReadServedError if exc.reason == wire.RejectReason.NO_READ
                       else LeaseRefusedError)
            raise refused(exc.reason, f"renewal for read {xfer_id} refused: {exc}") from None
        if not isinstance(reply, wire.LeaseRenewed):  # the dispatcher sends nothing else
            raise ProtocolError(f"{type(reply).__name__} from {self._conn.peer} answers a "
                                f"lease renewal")
        return reply.remaining_s

    async def read(
        self,
        item: RemoteRead,
        grant: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        num_tokens: int,
        first_token: int = 0,
        prompt_digest: bytes = b"",
    ) -> ItemResult:
        """Pull one plan item's heads and layers of the request into the local cache.

        Tokens ``[first_token, first_token + num_tokens)`` are read; the remote
        blocks covering them are sent whole and the tokens before ``first_token``
        in the first of them are skipped on unpack (see ``tokens.TokenWindow``).
        When both caches store the blocks alike, the read is direct (or a copy
        from a server on this host). Same as ``finish(begin(...))``.

        Raises:
            ConfigError: the remote block ids do not cover the tokens.
            RejectedError: the server refused the read (grant unknown/expired, ...).
            ProtocolError: the server's sizes disagree with ours (link killed).
            PeerTimeoutError, PeerClosedError: the server went silent or away.
        """
        setup = prepare(self.meta, self._ctx, self._xfer_ids, item, grant, remote_block_ids,
                        local_block_ids, num_tokens, first_token, prompt_digest)
        return await self.finish(self.begin(setup))

    def prepare(self, item: RemoteRead, job: ReadJob) -> ReadSetup:
        """``job``'s read of ``item`` as a strategy takes it (``strategy.prepare``), with
        a fresh xfer id of this link. Any thread (``inline.py`` calls it off the loop).

        Raises:
            ConfigError: as ``read``.
        """
        return prepare(self.meta, self._ctx, self._xfer_ids, item, job.grant,
                       job.remote_block_ids, job.local_block_ids, job.num_tokens,
                       job.first_token, job.prompt_digest)

    def new_xfer_id(self) -> int:
        """A read id not used on this link before."""
        return next(self._xfer_ids)

    def begin(self, setup: ReadSetup) -> BegunRead:
        """The part of ``read`` that needs no waiting; pass the result to ``finish``.

        A direct read is under way when this returns (receives posted or a copy
        asked for, request sent). Whoever calls ``begin`` must call ``finish`` or
        ``abandon``.

        Raises:
            TransferError: as ``read``.
        """
        return choose(setup, self._ctx, self.same_host).begin(self, setup)

    def finished_now(self, begun: BegunRead) -> ItemResult | None:
        """The result of a begun read that needs no more waiting, else None.

        That is a copy on the grant board's word which ``begin`` copied whole
        (the board still says the same). None: ``finish`` it as usual (which
        also reports what went wrong, if anything did).
        """
        result = begun.finished_now()
        return None if result is None else begun.stamped(result)

    async def finish(self, begun: BegunRead) -> ItemResult:
        """Wait for a begun read to land (and unpack it); the rest of ``read``."""
        return begun.stamped(await begun.finish())

    def abandon(self, begun: BegunRead) -> None:
        """Give up a begun read that will never be finished (its job was cancelled)."""
        begun.abandon()

    def abort(self) -> None:
        """Drop the link now; reads on it fail. Idempotent."""
        for task in self._tasks:
            task.cancel()
        self.fail(PeerClosedError("link aborted locally"))

    async def close(self) -> None:
        """Say goodbye and close. Idempotent."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._error is None:
            self._error = PeerClosedError("link closed locally")
        await self._conn.close(self._ctx.codec.encode(wire.Bye("closing")), timeout_s=0.5)
