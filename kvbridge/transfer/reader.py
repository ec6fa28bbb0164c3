"""The reading half of a transfer agent: one ``PeerLink`` per remote rank.

``agent.py`` opens a link the first time it reads from a remote (engine, rank),
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

Reading one plan item (``read``)::

    ReadRequest -> DataHeader (sizes checked) -> take window buffers
    -> post receives for chunks 0..w-1 -> Credit(w)
    -> for each chunk i: wait; unpack (executor thread, overlaps the next
       chunk on the wire); repost the buffer for chunk i+w; Credit(i+w+1)

A direct read (both caches store blocks alike) skips all of that: receives go
straight into our blocks (``_begin_direct``), or, when the server is on this
host and offered it, we copy its blocks ourselves (``_begin_copy``,
``local_copy.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from kvbridge.errors import ConfigError
from kvbridge.kernels import WireFormat, unpack
from kvbridge.layout import KVLayout
from kvbridge.topology import EngineTopology, RemoteRead
from kvbridge.transfer import wire
from kvbridge.transfer.config import AgentConfig, LocalKV
from kvbridge.transfer.direct import (
    MAX_RANGES_PER_CHUNK,
    HeadSpan,
    block_offsets,
    block_ranges,
    head_span,
    num_planes,
    plane_ranges,
)
from kvbridge.transfer.errors import (
    LeaseRefusedError,
    PeerClosedError,
    PeerTimeoutError,
    ProtocolError,
    RejectedError,
    ReplyPendingError,
    TransferError,
)
from kvbridge.transfer.grant_board import BoardSpot
from kvbridge.transfer.handshake import Identity, reader_handshake, recv_msg, send_msg
from kvbridge.transfer.iov import post_recv_iov
from kvbridge.transfer.local_copy import (
    Copier,
    CopyRefusedError,
    CopyRun,
    CopySource,
    IovArray,
)
from kvbridge.transfer.server import channel_of
from kvbridge.transfer.staging import Buffer, BufferPool
from kvbridge.transfer.ucp_lib import UcpLibrary
from kvbridge.transfer.ucx import UcxConnection, UcxWorker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ReaderContext:
    """What every link of one agent shares (owned by the agent)."""

    me: Identity
    local: LocalKV
    config: AgentConfig
    pool: BufferPool
    executor: Executor
    codec: wire.MessageCodec = field(default_factory=wire.MessageCodec)
    ucp: UcpLibrary = field(default_factory=UcpLibrary)
    copier: Copier | None = None  # None: no same-host copies


@dataclass(slots=True)
class ItemResult:
    """Counters of one finished plan item."""

    nbytes: int
    num_messages: int
    direct: bool = False  # block memory to block memory, no staging
    local_copy: bool = False  # copied out of the server's memory by us (same host)
    unasked: bool = False  # ... on the server's grant board's word (``grant_board.py``)


class PeerLink:
    """A handshaked connection to one remote rank. Create with :meth:`open`."""

    def __init__(self, ctx: ReaderContext, conn: UcxConnection, meta: wire.AgentMetadata) -> None:
        self._ctx = ctx
        self._conn = conn
        self.meta = meta
        self._waiters: dict[tuple[str, int], asyncio.Future[wire.Message]] = {}
        self._xfer_ids = itertools.count(1)
        self._ping_seq = itertools.count(1)
        self._error: TransferError | None = None
        self.num_received = 0  # control messages from the server: proof of life
        # Set when the server is on this host and lets us copy from it (local_copy.py).
        self.copy_source = (CopySource.open(meta.host, conn.peer)
                            if ctx.copier is not None else None)
        self._copy_gos: dict[tuple[int, int, int, int], wire.CopyGo] = {}  # the last, by shape
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
            PeerUnreachableError, PeerTimeoutError, RejectedError, ProtocolError.
        """
        cfg = ctx.config
        conn = await worker.connect(host, port, timeout_s=cfg.connect_timeout_s)
        try:
            meta = await reader_handshake(
                conn, ctx.codec, ctx.me, engine_id, rank,
                max_nbytes=cfg.max_frame_nbytes, timeout_s=cfg.handshake_timeout_s,
            )
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

    def _fail(self, error: TransferError) -> None:
        if self._error is None:
            self._error = error
            logger.info("link to %s failed: %s", self._conn.peer, error)
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(self._error)
        self._waiters.clear()
        self._conn.abort()

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
            self._fail(exc)

    def _expect(self, key: tuple[str, int]) -> asyncio.Future[wire.Message]:
        """A new future, registered as the one waiter for the reply under ``key``."""
        future: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self._claim(key, future)
        return future

    def _claim(self, key: tuple[str, int], future: asyncio.Future[wire.Message]) -> None:
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

    def _forget(self, key: tuple[str, int], future: asyncio.Future[wire.Message]) -> None:
        """Drop ``future``'s registration under ``key`` (not a later waiter's)."""
        if self._waiters.get(key) is future:
            del self._waiters[key]

    def _resolve(self, key: tuple[str, int], msg: wire.Message) -> None:
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
                await self._send(wire.Ping(next(self._ping_seq)))
        except TransferError as exc:
            self._fail(exc)

    async def _send(self, msg: wire.Message) -> None:
        if self._error is not None:
            raise self._error
        await send_msg(self._conn, self._ctx.codec, msg, self._ctx.config.reply_timeout_s)

    def _post(self, msg: wire.Message) -> asyncio.Future[None]:
        """Send ``msg`` without waiting for UCX to finish it; a failure kills the link.

        For messages whose effect the caller waits for anyway (a read request:
        its data or refusal has a deadline) or need not wait for (a done report:
        the lease covers a lost one).
        """
        if self._error is not None:
            raise self._error
        sent = self._conn.post_frame(self._ctx.codec.encode(msg))
        sent.add_done_callback(self._on_posted)
        return sent

    def _on_posted(self, sent: asyncio.Future[None]) -> None:
        if sent.cancelled():
            return
        error = sent.exception()
        if error is not None:
            self._fail(error if isinstance(error, TransferError)
                       else TransferError(f"send to {self._conn.peer}: {error}"))

    async def _request(self, key: tuple[str, int], msg: wire.Message) -> wire.Message:
        if self._error is not None:
            raise self._error
        future = self._expect(key)
        try:
            await self._send(msg)
            async with asyncio.timeout(self._ctx.config.reply_timeout_s):
                reply = await future
        except TimeoutError:
            self._fail(PeerTimeoutError(f"no reply to {type(msg).__name__} from {self._conn.peer}"))
            raise self._error from None  # type: ignore[misc]
        finally:
            self._forget(key, future)
        if isinstance(reply, wire.Reject):
            raise RejectedError(reply.reason, reply.message)
        return reply

    async def notify(self, grant: str, reader_id: str, ok: bool) -> None:
        """Tell the server this reader is done with ``grant`` (``ok=False``: gave up)."""
        await self._send(wire.ReadDone(grant, reader_id, ok))

    def notify_nowait(self, grant: str, reader_id: str, copied_nbytes: int = 0
                      ) -> asyncio.Future[None]:
        """Report a successful read without waiting; the future ends with the send.

        A lost report costs only time: the server frees at lease expiry.
        ``copied_nbytes``: what the read copied on the grant board's word.

        Raises:
            TransferError: the link is already dead.
        """
        return self._post(wire.ReadDone(grant, reader_id, True, copied_nbytes))

    async def renew(self, grant: str, lease_s: float, xfer_id: int) -> float:
        """Extend the grant's lease for read ``xfer_id``; return the seconds the server grants.

        Raises:
            LeaseRefusedError: the server refused (grant unknown, expired or being
                released): read ``xfer_id`` should fail; the link goes on.
            ReplyPendingError: a renewal for read ``xfer_id`` is already waiting.
            ProtocolError: the answer is not a ``LeaseRenewed``.
            PeerTimeoutError, PeerClosedError: no answer (the link is failed).
        """
        renewal = wire.RenewLease(grant, lease_s, xfer_id)
        try:
            reply = await self._request(("renew", xfer_id), renewal)
        except RejectedError as exc:
            raise LeaseRefusedError(exc.reason, f"renewal for read {xfer_id} refused: {exc}"
                                    ) from None
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
        in the first of them are skipped on unpack (see ``_TokenWindow``). When
        both caches store the blocks alike, the read is direct (``_begin_direct``,
        or ``_begin_copy`` from a server on this host). Same as ``finish(begin(...))``.

        Raises:
            ConfigError: the remote block ids do not cover the tokens.
            RejectedError: the server refused the read (grant unknown/expired, ...).
            ProtocolError: the server's sizes disagree with ours (link killed).
            PeerTimeoutError, PeerClosedError: the server went silent or away.
        """
        begun = self.begin(item, grant, remote_block_ids, local_block_ids, num_tokens,
                           first_token, prompt_digest)
        return await self.finish(begun)

    def begin(
        self,
        item: RemoteRead,
        grant: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        num_tokens: int,
        first_token: int = 0,
        prompt_digest: bytes = b"",
    ) -> BegunRead:
        """The part of ``read`` that needs no waiting; pass the result to ``finish``.

        A direct read is under way when this returns (receives posted or a copy
        asked for, request sent). Whoever calls ``begin`` must call ``finish`` or
        ``abandon``.

        Raises:
            ConfigError, TransferError: as ``read``.
        """
        ctx, meta = self._ctx, self.meta
        wire_fmt = WireFormat(
            layout=KVLayout.parse(meta.layout), block_size=meta.block_size,
            num_heads=len(item.remote_heads), head_dim=meta.head_dim,
            elem_nbytes=meta.elem_nbytes, num_layers=len(item.remote_layers), is_mla=meta.is_mla,
            fused_kv=meta.fused_kv,
        )
        fused = ctx.local.topology.fused_kv
        if fused and first_token % meta.block_size:
            raise ConfigError(
                f"a fused K/V cache (K transposed in each block) is read in whole blocks: "
                f"first token {first_token} is inside a block of {meta.block_size} tokens"
            )
        tokens = _TokenWindow(first_token, num_tokens, meta.block_size, ctx.local.topology,
                              whole_blocks=fused)
        block_ids = list(remote_block_ids[tokens.first_remote_block : tokens.end_remote_block])
        num_blocks = len(block_ids)
        if num_blocks != tokens.end_remote_block - tokens.first_remote_block:
            raise ConfigError(
                f"{len(remote_block_ids)} remote block ids of {meta.block_size} tokens do not "
                f"cover tokens [{first_token}, {first_token + num_tokens})"
            )
        chunk_blocks = max(1, ctx.config.chunk_nbytes // wire_fmt.block_nbytes)
        xfer_id = next(self._xfer_ids) % wire.MAX_XFER_ID + 1
        request = wire.ReadRequest(
            xfer_id, grant, block_ids, item.remote_heads.start, item.remote_heads.stop,
            item.remote_layers.start, item.remote_layers.stop, chunk_blocks,
            prompt_digest=prompt_digest,
        )
        local_span = self._direct_span(item, tokens)
        begun = BegunRead(item, request, wire_fmt, tokens, local_block_ids)
        if local_span is not None:
            local_ids = local_block_ids[tokens.first_local_block :][:num_blocks]
            nbytes = num_blocks * len(item.local_layers) * num_planes(ctx.local) * local_span.nbytes
            if self.copy_source is not None and nbytes >= ctx.config.local_copy_min_nbytes:
                begun.copy = self._begin_copy(request, item, local_ids, local_span, nbytes)
            else:
                begun.direct = self._begin_direct(request, item, local_ids, local_span)
        return begun

    def finished_now(self, begun: BegunRead) -> ItemResult | None:
        """The result of a begun read that needs no more waiting, else None.

        That is a copy on the grant board's word which ``begin`` copied whole
        (the board still says the same). None: ``finish`` it as usual (which
        also reports what went wrong, if anything did).
        """
        copy = begun.copy
        if copy is None or copy.spot is None or copy.early is None or not copy.early.exhausted:
            return None
        copy.early.wait_idle()
        try:
            if copy.early.error is not None or not copy.source.check(copy.spot):
                return None
        except TransferError:
            return None
        copy.early = None
        copy.result.unasked = True
        return copy.result

    async def finish(self, begun: BegunRead) -> ItemResult:
        """Wait for a begun read to land (and unpack it); the rest of ``read``."""
        if begun.direct is not None:
            return await self._finish_direct(begun.direct)
        if begun.copy is not None:
            return await self._finish_copy(begun.copy)
        ctx = self._ctx
        item, request, wire_fmt, tokens = begun.item, begun.request, begun.wire_fmt, begun.tokens
        xfer_id, chunk_blocks = request.xfer_id, request.chunk_blocks
        num_blocks = len(request.block_ids)
        num_chunks = math.ceil(num_blocks / chunk_blocks)
        header = await self._request(("data", xfer_id), request)
        if not isinstance(header, wire.DataHeader):  # nothing is posted yet: this read only
            if isinstance(header, wire.CopyGo):  # the server pinned the grant: let it go
                self._copy_done(xfer_id, False)
            raise ProtocolError(f"{type(header).__name__} from {self._conn.peer} answers "
                                f"staged read {xfer_id}")
        if (header.num_chunks, header.total_nbytes) != (num_chunks, wire_fmt.nbytes(num_blocks)):
            error = ProtocolError(
                f"server plans {header.num_chunks} chunks / {header.total_nbytes} bytes, "
                f"expected {num_chunks} / {wire_fmt.nbytes(num_blocks)}"
            )
            self._fail(error)
            raise error
        window = min(ctx.config.window_chunks, num_chunks, ctx.pool.num_buffers)
        chunk_nbytes = chunk_blocks * wire_fmt.block_nbytes
        bufs = await ctx.pool.acquire(chunk_nbytes, window, timeout_s=ctx.config.chunk_timeout_s)
        receiver = _ChunkReceiver(self, ctx, xfer_id, wire_fmt, bufs, num_blocks, chunk_blocks)
        try:
            await receiver.run(item, begun.local_block_ids, tokens)
        except BaseException:
            receiver.give_back(broken=True)
            raise
        receiver.give_back(broken=False)
        return ItemResult(wire_fmt.nbytes(num_blocks), 3 + 2 * num_chunks)

    def _direct_span(self, item: RemoteRead, tokens: _TokenWindow) -> HeadSpan | None:
        """Our heads' run in a block plane if this item can be read direct, else None."""
        meta, local = self.meta, self._ctx.local
        topo = local.topology
        alike = (
            meta.is_mla == topo.is_mla and meta.fused_kv == topo.fused_kv
            and KVLayout.parse(meta.layout) is topo.layout
            and meta.block_size == topo.block_size and meta.elem_nbytes == local.elem_nbytes
            and meta.head_dim == local.head_dim and tokens.skip == 0
            and tokens.local_offset == 0
        )
        if not alike or not self._ctx.config.direct_reads:
            return None
        heads = item.remote_heads
        remote_run = meta.is_mla or topo.layout is KVLayout.HND or len(heads) == meta.num_heads
        local_span = head_span(local, item.local_head_offset, item.local_head_offset + len(heads))
        return local_span if remote_run else None

    def _direct_request(
        self, request: wire.ReadRequest, item: RemoteRead, local_copy: bool
    ) -> wire.ReadRequest:
        """``request`` made direct, its chunks within the ranges one message may list."""
        per_block = len(item.local_layers) * num_planes(self._ctx.local)
        chunk_blocks = max(1, min(request.chunk_blocks, MAX_RANGES_PER_CHUNK // per_block))
        return msgspec.structs.replace(request, chunk_blocks=chunk_blocks, direct=True,
                                       local_copy=local_copy)

    def _begin_copy(
        self, request: wire.ReadRequest, item: RemoteRead, local_ids: Sequence[int],
        span: HeadSpan, nbytes: int,
    ) -> _CopyRead:
        """Start a same-host copy: on the board's word, or asked for (at once if we can).

        Where an earlier go of this shape (layers, heads) told where the blocks
        sit, the copy starts now: without asking at all if the server's grant
        board says the grant is live and holds the blocks (``grant_board.py``),
        else while the server checks, since the blocks of a grant it is about to
        confirm have not changed since the grant was issued (they change only
        after its release): such a copy is kept if the go places the blocks where
        it copied from (``_finish_copy``).
        """
        ctx, source = self._ctx, self.copy_source
        assert source is not None and ctx.copier is not None
        request = self._direct_request(request, item, local_copy=True)
        ids = np.asarray(local_ids, dtype=np.int64)
        layers = slice(item.local_layers.start, item.local_layers.stop)
        offsets = block_offsets(ids, ctx.local.plane_block_nbytes, span.offset)
        local_iov = plane_ranges(ctx.local.plane_origins(layers), offsets, span.nbytes)
        result = ItemResult(nbytes, 3, direct=True, local_copy=True)
        guess = self._copy_gos.get(_copy_shape(request))
        reply: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        copy = _CopyRead(("data", request.xfer_id), reply, time.monotonic(), request, source,
                         local_iov, span, result, guess)
        if guess is not None:
            copy.spot = source.find_grant(request.grant, request.block_ids,
                                          request.prompt_digest, guess.place)
            if copy.spot is not None:
                copy.early = ctx.copier.start(source, local_iov, self._remote_ranges(copy, guess))
                return copy
        # Ask first, unless helper threads can start copying while we ask.
        ask_first = guess is None or ctx.copier.num_parts(nbytes) == 1
        self._claim(copy.key, reply)
        try:
            if ask_first:
                self._post(request)
            if guess is not None:
                copy.early = ctx.copier.start(
                    source, local_iov, self._remote_ranges(copy, guess),
                    meanwhile=None if ask_first else lambda: self._post(request),
                )
        except BaseException:
            self._forget(copy.key, reply)
            raise
        return copy

    def _ask(self, copy: _CopyRead) -> None:
        """Ask the server for ``copy`` after all (the board's word did not hold)."""
        self._claim(copy.key, copy.reply)
        copy.spot = None
        copy.started = time.monotonic()
        try:
            self._post(copy.request)
        except BaseException:
            self._forget(copy.key, copy.reply)
            raise

    async def _finish_copy(self, copy: _CopyRead) -> ItemResult:
        """Finish the early copy or copy after the go; check the hold; say ``CopyDone``.

        A copy on the board's word is kept if the board still says the same
        after it (else the server is asked). The bytes of an early copy are kept
        only if the go places the blocks where it copied from; nothing else is
        kept without a go.
        """
        ctx = self._ctx
        assert ctx.copier is not None
        ok = False
        try:
            copied = None
            if copy.early is not None:
                with contextlib.suppress(ProtocolError):  # memory gone: copy after the go
                    early, copy.early = copy.early, None
                    if early.helpers:  # our helpers copy on: spinning would take their core
                        self._conn.stop_spinning()
                    if await ctx.copier.finish(early, copy.spot):
                        copied = copy.guess
            if copy.spot is not None:
                if copied is not None:
                    ok = True
                    copy.result.unasked = True
                    return copy.result
                self._ask(copy)  # the grant changed meanwhile, or the copy failed
            go = await self._copy_go(copy)
            if copied is None or _place(go) != _place(copied):  # new shape, or blocks moved
                await ctx.copier.copy(copy.source, copy.local_iov, self._remote_ranges(copy, go))
            took_s = time.monotonic() - copy.started
            if took_s >= go.hold_s:  # the server may have handed the blocks back
                raise PeerTimeoutError(f"same-host copy from {self._conn.peer} took "
                                       f"{took_s:.3f}s, past the server's hold of {go.hold_s}s")
            self._copy_gos[_copy_shape(copy.request)] = go
            ok = True
        except CopyRefusedError:
            self.copy_source = None  # the kernel said no: this link reads through UCX now
            raise
        except (PeerClosedError, ProtocolError) as exc:
            self._fail(exc)
            raise
        finally:
            if copy.spot is None:
                self._forget(copy.key, copy.reply)
                # After the outcome is recorded (a few returns up). Also when we gave
                # up before the go came: it may still come, pinning the grant until
                # its hold.
                if copy.answered or not ok:
                    asyncio.get_running_loop().call_soon(self._copy_done, copy.request.xfer_id,
                                                         ok)
        return copy.result

    def _copy_done(self, xfer_id: int, ok: bool) -> None:
        """Let the server unpin (else it does at the hold's end: a lost one costs only time)."""
        with contextlib.suppress(TransferError):
            self._post(wire.CopyDone(xfer_id, ok))

    async def _copy_go(self, copy: _CopyRead) -> wire.CopyGo:
        """The server's go for ``copy`` (its copy-only fields checked).

        Raises:
            RejectedError: the server refused (nothing is pinned).
            PeerTimeoutError: no answer in time (the link is failed).
            ProtocolError: not a go, or one that does not fit the request.
        """
        try:
            async with asyncio.timeout(self._ctx.config.reply_timeout_s):
                reply = await copy.reply
        except TimeoutError:
            self._fail(PeerTimeoutError(f"no answer to a same-host copy from {self._conn.peer}"))
            raise self._error from None  # type: ignore[misc]
        if isinstance(reply, wire.Reject):
            raise RejectedError(reply.reason, reply.message)
        copy.answered = True
        if not isinstance(reply, wire.CopyGo):
            raise ProtocolError(f"unexpected {type(reply).__name__} for a same-host copy")
        self._check_go(copy, reply)
        return reply

    def _check_go(self, copy: _CopyRead, go: wire.CopyGo) -> None:
        """Raise ``ProtocolError`` unless ``go`` fits the read we asked for."""
        req = copy.request
        num_origins = (req.layer_end - req.layer_start) * num_planes(self._ctx.local)
        if len(go.origins) != 8 * num_origins or go.span_nbytes != copy.span.nbytes:
            raise ProtocolError(
                f"copy go for {len(go.origins) // 8} planes of {go.span_nbytes}-byte spans, "
                f"asked for {num_origins} of {copy.span.nbytes}"
            )

    def _remote_ranges(self, copy: _CopyRead, go: wire.CopyGo) -> IovArray:
        """The server's ranges for ``copy`` per ``go`` (checked), row for row with ours."""
        req = copy.request
        origins = np.frombuffer(go.origins, dtype=np.uint64)
        offsets = block_offsets(np.asarray(req.block_ids, dtype=np.int64), go.block_stride,
                                go.span_offset)
        return plane_ranges(origins, offsets, go.span_nbytes)

    def _begin_direct(
        self, request: wire.ReadRequest, item: RemoteRead, local_ids: Sequence[int],
        span: HeadSpan,
    ) -> _DirectRead:
        """Start receiving the item's blocks straight into ours: post receives, ask."""
        ctx = self._ctx
        layers = slice(item.local_layers.start, item.local_layers.stop)
        per_block = len(item.local_layers) * num_planes(ctx.local)
        request = self._direct_request(request, item, local_copy=False)
        chunk_blocks = request.chunk_blocks
        ids = np.asarray(local_ids, dtype=np.int64)
        num_chunks = math.ceil(ids.size / chunk_blocks)
        channels = [channel_of(request.xfer_id, chunk) for chunk in range(num_chunks)]

        def post(chunk: int) -> asyncio.Future[None]:
            chunk_ids = ids[chunk * chunk_blocks : (chunk + 1) * chunk_blocks]
            iov = block_ranges(ctx.local, chunk_ids, layers, span)
            return post_recv_iov(ctx.ucp, self._conn, iov, channels[chunk])

        key = ("data", request.xfer_id)
        refusal = self._expect(key)
        result = ItemResult(ids.size * per_block * span.nbytes, 1 + num_chunks, direct=True)
        direct = _DirectRead(key, refusal, [], channels, result)
        try:
            direct.arrivals.append(post(0))
            # Ask once the first chunk's receive is posted and post the others while
            # the server prepares: each lands long after the one before it.
            self._post(request)
            direct.arrivals.extend(post(chunk) for chunk in range(1, num_chunks))
        except BaseException as exc:
            self._settle(direct, exc)
            raise
        return direct

    async def _finish_direct(self, direct: _DirectRead) -> ItemResult:
        """Await every chunk of a begun direct read, or the server's refusal.

        One wait for the lot (``chunk_timeout_s`` per chunk, as the server's):
        the chunks and the refusal resolve one future through callbacks.
        """
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[None] = loop.create_future()
        left = [len(direct.arrivals)]

        def arrived(future: asyncio.Future[None]) -> None:
            if outcome.done():
                return
            error = PeerClosedError("chunk cancelled") if future.cancelled() else future.exception()
            if error is not None:
                outcome.set_exception(error)
            else:
                left[0] -= 1
                if not left[0]:
                    outcome.set_result(None)

        def refused(future: asyncio.Future[wire.Message]) -> None:
            if outcome.done():
                return
            error = future.exception() if not future.cancelled() else PeerClosedError("cancelled")
            reply = None if error is not None else future.result()
            if isinstance(reply, wire.Reject):
                error = RejectedError(reply.reason, reply.message)
            elif error is None:
                error = ProtocolError(f"unexpected {type(reply).__name__} for a direct read")
            outcome.set_exception(error)

        for future in direct.arrivals:
            future.add_done_callback(arrived)
        direct.refusal.add_done_callback(refused)
        timeout_s = self._ctx.config.chunk_timeout_s * len(direct.arrivals)
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await outcome
            except TimeoutError:
                raise PeerTimeoutError(
                    f"direct read from {self._conn.peer}: not all in within {timeout_s}s"
                ) from None
        except BaseException as exc:
            self._settle(direct, exc)
            raise
        self._settle(direct, None)
        return direct.result

    def _settle(self, direct: _DirectRead, error: BaseException | None) -> None:
        """End a direct read once: on failure unpost what is left, or give up the link."""
        if direct.settled:
            return
        direct.settled = True
        self._forget(direct.key, direct.refusal)
        if error is None:
            return
        for arrived in direct.arrivals:
            arrived.add_done_callback(_ignore_outcome)
        if isinstance(error, RejectedError) and self.alive:  # nothing was sent: unpost
            for channel, arrived in zip(direct.channels, direct.arrivals, strict=False):
                if not arrived.done():
                    self._conn.cancel_recv(channel)
        else:  # bytes may still be landing in our blocks: the link is done
            self._fail(error if isinstance(error, TransferError) else
                       PeerClosedError("direct read abandoned with receives posted"))

    def abandon(self, begun: BegunRead) -> None:
        """Give up a begun read that will never be finished (its job was cancelled)."""
        if begun.direct is not None:
            self._settle(begun.direct, PeerClosedError("read abandoned before it was awaited"))
        copy = begun.copy
        if copy is not None and copy.early is not None:
            Copier.abandon(copy.early)  # it writes into our blocks: wait for it
        if copy is not None and self._waiters.get(copy.key) is copy.reply:
            self._forget(copy.key, copy.reply)
            with contextlib.suppress(TransferError):  # the server may unpin at once
                self._post(wire.CopyDone(copy.request.xfer_id, False))

    def abort(self) -> None:
        """Drop the link now; reads on it fail. Idempotent."""
        for task in self._tasks:
            task.cancel()
        self._fail(PeerClosedError("link aborted locally"))

    async def close(self) -> None:
        """Say goodbye and close. Idempotent."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._error is None:
            self._error = PeerClosedError("link closed locally")
        await self._conn.close(self._ctx.codec.encode(wire.Bye("closing")), timeout_s=0.5)


@dataclass(slots=True)
class _DirectRead:
    """A direct read under way: its receives, the server's possible refusal, its end."""

    key: tuple[str, int]  # of the refusal in the link's waiters
    refusal: asyncio.Future[wire.Message]
    arrivals: list[asyncio.Future[None]]  # one per chunk, in order
    channels: list[int]
    result: ItemResult
    settled: bool = False


@dataclass(slots=True)
class _CopyRead:
    """A same-host copy asked for: the go to wait for, and what to copy into."""

    key: tuple[str, int]  # of the reply in the link's waiters
    reply: asyncio.Future[wire.Message]
    started: float  # time.monotonic() before the request was sent
    request: wire.ReadRequest
    source: CopySource
    local_iov: IovArray
    span: HeadSpan
    result: ItemResult
    guess: wire.CopyGo | None = None  # an earlier go of this shape, copied from early
    early: CopyRun | None = None  # that copy, started by ``_begin_copy``
    spot: BoardSpot | None = None  # where the board said yes: copied without asking
    answered: bool = False  # the server pinned the grant for us: say CopyDone


def _place(go: wire.CopyGo) -> tuple[bytes, int, int, int]:
    """Where a go says the blocks are (all of it but the read's id and hold)."""
    return go.origins, go.block_stride, go.span_offset, go.span_nbytes


def _copy_shape(req: wire.ReadRequest) -> tuple[int, int, int, int]:
    """What a go's fields depend on besides the server's memory: layers and heads."""
    return req.layer_start, req.layer_end, req.head_start, req.head_end


@dataclass(slots=True)
class BegunRead:
    """What ``PeerLink.begin`` prepared (and, for a direct read, started)."""

    item: RemoteRead
    request: wire.ReadRequest
    wire_fmt: WireFormat
    tokens: _TokenWindow
    local_block_ids: Sequence[int]
    direct: _DirectRead | None = None
    copy: _CopyRead | None = None


class _TokenWindow:
    """Where the read tokens sit in the received buffer and in the local blocks.

    The buffer holds whole remote blocks from ``first_remote_block`` on; buffer
    token ``u`` is request token ``first_remote_block * remote_bs + u``::

        request tokens  0 ............ first ................. end
        buffer          |  r  |  r  |  r  |  r  |             (whole remote blocks)
                                 <skip>^
        local blocks    |  l  |  l  |  l  |  l  |  l  |  l  | (local_block_ids)

    Buffer tokens ``[skip, skip + num_tokens)`` are written, to local position
    ``first - first_local_block * local_bs + (u - skip)`` of the local blocks
    from ``first_local_block`` on. ``whole_blocks`` (fused K/V caches, whose
    rows are not tokens) writes the last block whole, as a direct read does:
    its slots past the prompt are unused.
    """

    def __init__(
        self, first_token: int, num_tokens: int, remote_block_size: int, local: EngineTopology,
        *, whole_blocks: bool = False,
    ) -> None:
        end = first_token + num_tokens
        self.first_remote_block = first_token // remote_block_size
        self.end_remote_block = -(-end // remote_block_size)
        if whole_blocks:
            num_tokens = self.end_remote_block * remote_block_size - first_token
        self.num_tokens = num_tokens
        self.skip = first_token - self.first_remote_block * remote_block_size
        self.first_local_block = first_token // local.block_size
        self.local_offset = first_token - self.first_local_block * local.block_size

    def in_chunk(self, first_buffer_token: int, num_buffer_tokens: int) -> tuple[int, int, int]:
        """``(src_token_offset, num_tokens, token_offset)`` for one chunk's unpack."""
        low = max(first_buffer_token, self.skip)
        high = min(first_buffer_token + num_buffer_tokens, self.skip + self.num_tokens)
        return low - first_buffer_token, max(0, high - low), self.local_offset + low - self.skip


class _ChunkReceiver:
    """Posts, awaits and unpacks the chunks of one read through a window of buffers."""

    def __init__(
        self, link: PeerLink, ctx: ReaderContext, xfer_id: int, wire_fmt: WireFormat,
        bufs: list[Buffer], num_blocks: int, chunk_blocks: int,
    ) -> None:
        self.link, self.ctx, self.xfer_id, self.wire_fmt = link, ctx, xfer_id, wire_fmt
        self.bufs, self.num_blocks, self.chunk_blocks = bufs, num_blocks, chunk_blocks
        self.num_chunks = math.ceil(num_blocks / chunk_blocks)

    def _blocks_in(self, chunk: int) -> int:
        return min(self.chunk_blocks, self.num_blocks - chunk * self.chunk_blocks)

    def _post(self, chunk: int) -> asyncio.Future[None]:
        buf = self.bufs[chunk % len(self.bufs)]
        nbytes = self.wire_fmt.nbytes(self._blocks_in(chunk))
        return self.link._conn.post_recv(buf[:nbytes], channel_of(self.xfer_id, chunk))

    async def run(
        self, item: RemoteRead, local_block_ids: Sequence[int], tokens: _TokenWindow
    ) -> None:
        cfg, local = self.ctx.config, self.ctx.local
        window = len(self.bufs)
        posted = {chunk: self._post(chunk) for chunk in range(window)}
        await self.link._send(wire.Credit(self.xfer_id, window))
        layers = local.layers[item.local_layers.start : item.local_layers.stop]
        local_ids = list(local_block_ids[tokens.first_local_block :])
        block_tokens = self.chunk_blocks * self.wire_fmt.block_size
        loop = asyncio.get_running_loop()
        for chunk in range(self.num_chunks):
            arrived = posted.pop(chunk)
            await self.link._conn.wait(arrived, timeout_s=cfg.chunk_timeout_s, what="chunk")
            buf = self.bufs[chunk % window]
            blocks = self._blocks_in(chunk)
            src_offset, chunk_tokens, token_offset = tokens.in_chunk(
                chunk * block_tokens, blocks * self.wire_fmt.block_size
            )
            staged = torch.from_numpy(buf[: self.wire_fmt.nbytes(blocks)])
            await loop.run_in_executor(
                self.ctx.executor, _unpack, staged, self.wire_fmt, blocks, layers, local_ids,
                local.topology.layout, item.local_head_offset, chunk_tokens, token_offset,
                src_offset,
            )
            following = chunk + window
            if following < self.num_chunks:
                posted[following] = self._post(following)
                await self.link._send(wire.Credit(self.xfer_id, following + 1))

    def give_back(self, *, broken: bool) -> None:
        for buf in self.bufs:
            if broken:
                self.ctx.pool.discard()  # a receive may still land in it
            else:
                self.ctx.pool.release(buf)
        if broken:
            self.link._fail(PeerClosedError("read abandoned with receives posted"))


def _ignore_outcome(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def _unpack(
    staged: torch.Tensor, wire_fmt: WireFormat, num_blocks: int, layers: list[torch.Tensor],
    local_ids: list[int], layout: KVLayout, head_offset: int, num_tokens: int, token_offset: int,
    src_token_offset: int,
) -> None:
    if num_tokens == 0:
        return
    unpack(
        staged, wire_fmt, num_blocks, layers, local_ids, layout,
        head_offset=head_offset, num_tokens=num_tokens, token_offset=token_offset,
        src_token_offset=src_token_offset,
    )
