"""The same-host copy: we copy the server's blocks out of its memory ourselves.

For direct reads (``direct.py``'s conditions) from a server on this host that
offered it (``protocol/host.py``), of ``AgentConfig.local_copy_min_nbytes`` (0:
any size) and more. One copy beats UCX's shared memory, where the server copies
every byte into a FIFO and the reader out of it; and it costs the server's process
no CPU per byte. The copy itself is ``copier.py``'s (out of ``copy_source.py``'s
server). Most such reads never get here: ``inline.py`` makes them on the
caller's thread on the grant board's word; this module serves those it cannot
(no board, a grant not on it, a large read).

The server still decides what may be read: the reader asks as for any direct
read, and the server checks the grant, pins it and answers ``CopyGo`` (where
the read's blocks sit, and for how long it holds them: ``hold_s``). It unpins
when the reader says ``CopyDone`` or when ``hold_s`` has passed. The reader
keeps the bytes only if its copy ended within ``hold_s`` of sending the
request (the server's hold started later), so it never keeps a block the
server may have handed back to its engine::

    reader: t0 send ReadRequest ........ copy ....... t1   keep iff t1 - t0 < hold_s
    server:      recv, pin ----------------- hold_s ------------> unpin

Without asking: a round trip through the server's loop costs time, and on a
busy host the server may wait for a core until the reader's own copy threads
leave one. So the server also publishes its live grants on a *grant board* in
its memory (``protocol/grant_board.py``): once the handshake's map of the
server's planes or a go of the read's shape told where the blocks sit, a reader
that finds its grant on the board copies without asking at all, and keeps the
bytes if the board still says the same after the copy (a sequence lock: the
server takes a grant off before it hands its blocks back). Most such reads are
made before they reach this module, on the caller's thread (``inline.py``).

Nothing is copied before the board or a go said yes (an earlier version copied
while the server checked): a grant for another prompt, or without one of the
blocks, must not land a byte in the reader's cache even if the read then fails.
The serving half is ``serving/copy_hold.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvbridge.topology import KVLayout, planes_per_block
from kvbridge.transfer.blocks.ranges import (
    HeadSpan,
    block_offsets,
    num_planes,
    plane_ranges,
    span_of,
)
from kvbridge.transfer.errors import (
    PeerClosedError,
    PeerTimeoutError,
    ProtocolError,
    RejectedError,
    TransferError,
)
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.grant_board import BoardSpot
from kvbridge.transfer.reading.base import BegunRead, ItemResult, ReadSetup
from kvbridge.transfer.reading.copier import Copier, CopyRun
from kvbridge.transfer.reading.copy_source import CopyRefusedError, CopySource
from kvbridge.transfer.reading.direct import direct_request
from kvbridge.transfer.reading.libc import IovArray, zero_rows

if TYPE_CHECKING:
    from kvbridge.transfer.reading.link import PeerLink

__all__ = ["CopyShape", "SameHostCopy", "SameHostPeer", "copy_shape", "local_ranges",
           "remote_ranges"]

CopyShape = tuple[int, int, int, int]  # layers and heads of a read (``copy_shape``)

# A read that missed the grant board looks again after this long, then twice as long,
# up to the second figure, until the server answers (``SameHostCopy._board_or_go``).
_BOARD_POLL_S = 0.0005
_BOARD_POLL_MAX_S = 0.008


@dataclass(slots=True)
class SameHostPeer:
    """A link's server as a process on this host we may copy from (one per link)."""

    source: CopySource
    meta: wire.AgentMetadata
    gos: dict[CopyShape, wire.CopyGo] = field(default_factory=dict)  # the last, by shape

    @classmethod
    def open(cls, meta: wire.AgentMetadata, peer: str) -> SameHostPeer | None:
        """The server ``meta`` describes if it offers copies and we can copy from it,
        else None (see ``CopySource``)."""
        source = CopySource.open(meta.host, peer)
        return cls(source, meta) if source is not None else None

    def go_for(self, req: wire.ReadRequest) -> wire.CopyGo | None:
        """Where ``req``'s blocks sit as far as we know: the last go of its shape, else
        the handshake's map of the server's planes (``HostInfo.origins``); None: ask.

        Only a guess until the server's grant board or its go confirms the place
        (a copy by it is kept only then). Any thread may call it.
        """
        shape = copy_shape(req)
        go = self.gos.get(shape)
        if go is None:
            go = _handshake_go(self.meta, req)
            if go is not None:
                go = self.gos.setdefault(shape, go)
        return go


class SameHostCopy(BegunRead):
    """A same-host copy asked for: the go to wait for, and what to copy into."""

    def __init__(
        self, link: PeerLink, setup: ReadSetup, peer: SameHostPeer, local_iov: IovArray,
        span: HeadSpan, result: ItemResult,
    ) -> None:
        super().__init__(link, setup)
        self.key = ("data", setup.request.xfer_id)  # of the reply in the link's waiters
        self.reply: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self.started = time.monotonic()  # before the request was sent
        self.peer = peer
        self.source = peer.source
        self.local_iov = local_iov
        self.span = span
        self.result = result
        self.early: CopyRun | None = None  # a copy on the board's word, started by ``begin``
        self.spot: BoardSpot | None = None  # where the board said yes: copied without asking
        self.answered = False  # the server pinned the grant for us: say CopyDone

    @classmethod
    def begin(cls, link: PeerLink, setup: ReadSetup) -> SameHostCopy:
        """Start a same-host copy: on the board's word, or asked for.

        Where the handshake or an earlier go of this shape (layers, heads) told
        where the blocks sit and the server's grant board says the grant is
        live and holds the blocks, the copy starts now, without asking at all.
        Otherwise the server is asked and the copy waits for its go.
        """
        ctx, item, span, peer = link.ctx, setup.item, setup.span, link.same_host
        assert span is not None and peer is not None and ctx.copier is not None
        nbytes = setup.direct_nbytes(ctx.local)
        request = direct_request(ctx, setup.request, item, local_copy=True)
        setup.request = request
        local_iov = local_ranges(ctx.local, setup, span)
        result = ItemResult(nbytes, 3, direct=True, local_copy=True)
        guess = peer.go_for(request)
        copy = cls(link, setup, peer, local_iov, span, result)
        if guess is not None and copy._board_says_yes(guess):
            return copy
        # Not on the board: ask, and copy only after the go. Never copy before someone
        # said yes: a grant for another prompt (or other blocks) must not land a byte.
        link.claim(copy.key, copy.reply)
        try:
            link.post(request)
        except BaseException:
            link.forget(copy.key, copy.reply)
            raise
        return copy

    def _board_says_yes(self, guess: wire.CopyGo) -> bool:
        """Look at the server's grant board: on its yes, start the copy on its word."""
        req, copier = self.request, self.link.ctx.copier
        assert copier is not None
        spot = self.source.find_grant(req.grant, req.block_ids, req.prompt_digest, guess.place)
        if spot is None:
            return False
        self.grant_seen()
        self.spot = spot
        self.early = copier.start(self.source, self.local_iov, self._remote_ranges(guess))
        return True

    @property
    def asked(self) -> bool:
        """False while copying on the board's word: the server does not know of the
        copy, pins nothing for it and renews nothing for it (the board's seq lock
        keeps it safe: a copy that outlives the grant is dropped)."""
        return self.spot is None

    def finished_now(self) -> ItemResult | None:
        """The result if ``begin`` copied it whole on the board's word (still valid)."""
        if self.spot is None or self.early is None or not self.early.exhausted:
            return None
        self.early.wait_idle()
        try:
            if self.early.error is not None or not self.source.check(self.spot):
                return None
        except TransferError:
            return None
        self.early = None
        self.result.unasked = True
        return self.result

    async def finish(self) -> ItemResult:
        """Finish the copy on the board's word, or copy after the go; check the hold;
        say ``CopyDone``.

        A copy on the board's word is kept if the board still says the same
        after it (else the server is asked); nothing else is copied without a go.
        """
        link = self.link
        copier = link.ctx.copier
        assert copier is not None
        ok = False
        left_s: float | None = None  # of the wait for the go
        try:
            if self.early is None:  # asked: the board may say yes before the server
                left_s = await self._board_or_go()
            if self.early is not None:  # on the board's word
                with contextlib.suppress(ProtocolError):  # memory gone: copy after the go
                    early, self.early = self.early, None
                    if early.helpers:  # our helpers copy on: spinning would take their core
                        link.conn.stop_spinning()
                    if await copier.finish(early, self.spot):
                        ok = True
                        self.result.unasked = True
                        return self.result
            if self.spot is not None:
                zero_rows(self.local_iov)  # not kept: leave none of it behind
                self._ask()  # the grant changed meanwhile, or the copy failed
                left_s = None
            go = await self._copy_go(left_s)
            self.grant_seen()
            await copier.copy(self.source, self.local_iov, self._remote_ranges(go))
            took_s = time.monotonic() - self.started
            if took_s >= go.hold_s:  # the server may have handed the blocks back
                raise PeerTimeoutError(f"same-host copy from {link.peer} took "
                                       f"{took_s:.3f}s, past the server's hold of {go.hold_s}s")
            self.peer.gos[copy_shape(self.request)] = go
            ok = True
        except CopyRefusedError:
            link.drop_same_host()  # the kernel said no: this link reads through UCX now
            raise
        except (PeerClosedError, ProtocolError) as exc:
            link.fail(exc)
            raise
        finally:
            if self.spot is None:
                link.forget(self.key, self.reply)
                # After the outcome is recorded (a few returns up). Also when we gave
                # up before the go came: it may still come, pinning the grant until
                # its hold.
                if self.answered or not ok:
                    asyncio.get_running_loop().call_soon(
                        link.post_quietly, wire.CopyDone(self.request.xfer_id, ok))
        return self.result

    def abandon(self) -> None:
        if self.early is not None:
            Copier.abandon(self.early)  # it writes into our blocks: wait for it
        if self.link.forget(self.key, self.reply):
            # the server may unpin at once
            self.link.post_quietly(wire.CopyDone(self.request.xfer_id, False))

    async def _board_or_go(self) -> float | None:
        """Wait for the server's answer, looking at its grant board meanwhile.

        A read that missed the board is asked for, but the server's answer
        needs its interpreter, which a forward pass may hold for long; the
        grant appears on the board the moment it is issued. So the board is
        looked at again (``_BOARD_POLL_S``, doubling) until the answer comes:
        on its yes the copy starts on its word and the ask is withdrawn
        (``CopyDone(ok=False)``: a server that pinned unpins, one still waiting
        for the grant never pins: ``serving/session.py``). Returns when
        either came (the answer is read by ``_copy_go``), or at the reply
        timeout (``_copy_go`` then fails the link), with the seconds left of
        that timeout (None: not looked, the whole timeout is left).
        """
        guess = self.peer.go_for(self.request)
        if guess is None:  # nowhere to look: the server's go says where the blocks are
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.link.ctx.config.reply_timeout_s
        pause = _BOARD_POLL_S
        while (left_s := deadline - loop.time()) > 0:
            await asyncio.wait((self.reply,), timeout=min(pause, left_s))
            if self.reply.done() or self._board_says_yes(guess):
                break
            pause = min(2 * pause, _BOARD_POLL_MAX_S)
        if self.spot is not None:
            self._withdraw()
        return max(0.0, deadline - loop.time())

    def _withdraw(self) -> None:
        """Take back the ask of a read now copied on the board's word (its own xfer id:
        a later ask gets a new one, the server may still hold this one)."""
        link = self.link
        if link.forget(self.key, self.reply):
            link.post_quietly(wire.CopyDone(self.request.xfer_id, False))
        self.setup.request = msgspec.structs.replace(self.request, xfer_id=link.new_xfer_id())
        self.key = ("data", self.request.xfer_id)
        self.reply = asyncio.get_running_loop().create_future()

    def _ask(self) -> None:
        """Ask the server after all (the board's word did not hold)."""
        link = self.link
        link.claim(self.key, self.reply)
        self.spot = None
        self.started = time.monotonic()
        try:
            link.post(self.request)
        except BaseException:
            link.forget(self.key, self.reply)
            raise

    async def _copy_go(self, timeout_s: float | None = None) -> wire.CopyGo:
        """The server's go (its copy-only fields checked), within ``timeout_s`` (None:
        ``reply_timeout_s``).

        Raises:
            RejectedError: the server refused (nothing is pinned).
            PeerTimeoutError: no answer in time (the link is failed).
            ProtocolError: not a go, or one that does not fit the request.
        """
        link = self.link
        try:
            async with asyncio.timeout(
                    link.ctx.config.reply_timeout_s if timeout_s is None else timeout_s):
                reply = await self.reply
        except TimeoutError:
            raise link.fail(PeerTimeoutError(
                f"no answer to a same-host copy from {link.peer}")) from None
        if isinstance(reply, wire.Reject):
            raise RejectedError(reply.reason, reply.message)
        self.answered = True
        if not isinstance(reply, wire.CopyGo):
            raise ProtocolError(f"unexpected {type(reply).__name__} for a same-host copy")
        self._check_go(reply)
        return reply

    def _check_go(self, go: wire.CopyGo) -> None:
        """Raise ``ProtocolError`` unless ``go`` fits the read we asked for."""
        req = self.request
        num_origins = (req.layer_end - req.layer_start) * num_planes(self.link.ctx.local)
        if len(go.origins) != 8 * num_origins or go.span_nbytes != self.span.nbytes:
            raise ProtocolError(
                f"copy go for {len(go.origins) // 8} planes of {go.span_nbytes}-byte spans, "
                f"asked for {num_origins} of {self.span.nbytes}"
            )

    def _remote_ranges(self, go: wire.CopyGo) -> IovArray:
        """The server's ranges for this copy per ``go`` (checked), row for row with ours."""
        return remote_ranges(self.request, go)


def local_ranges(local: LocalKV, setup: ReadSetup, span: HeadSpan) -> IovArray:
    """Our ranges of a same-host copy of ``setup``'s item (row for row with ``remote_ranges``)."""
    ids = np.asarray(setup.direct_block_ids, dtype=np.int64)
    layers = slice(setup.item.local_layers.start, setup.item.local_layers.stop)
    offsets = block_offsets(ids, local.plane_block_nbytes, span.offset)
    return plane_ranges(local.plane_origins(layers), offsets, span.nbytes)


def remote_ranges(req: wire.ReadRequest, go: wire.CopyGo) -> IovArray:
    """The server's ranges of ``req``'s blocks where ``go`` says they are."""
    origins = np.frombuffer(go.origins, dtype=np.uint64)
    offsets = block_offsets(np.asarray(req.block_ids, dtype=np.int64), go.block_stride,
                            go.span_offset)
    return plane_ranges(origins, offsets, go.span_nbytes)


def _handshake_go(meta: wire.AgentMetadata, req: wire.ReadRequest) -> wire.CopyGo | None:
    """A go for ``req`` made from the server's handshake (``HostInfo.origins``), or None
    when the handshake has no map or the read does not fit it."""
    info = meta.host
    if info is None or not info.origins or not info.block_stride:
        return None
    planes = planes_per_block(meta.is_mla, meta.fused_kv, meta.split_kv)
    if (len(info.origins) != 8 * planes * meta.num_layers
            or not 0 <= req.layer_start < req.layer_end <= meta.num_layers):
        return None
    try:
        layout = KVLayout.parse(meta.layout)
    except ValueError:
        return None
    span = span_of(layout, meta.is_mla, meta.block_size, meta.num_heads,
                   meta.head_dim * meta.elem_nbytes, req.head_start, req.head_end)
    if span is None or span.nbytes < 1:
        return None
    origins = info.origins[8 * planes * req.layer_start : 8 * planes * req.layer_end]
    return wire.CopyGo(req.xfer_id, origins, info.block_stride, span.offset, span.nbytes,
                       hold_s=1.0, place=info.place)


def copy_shape(req: wire.ReadRequest) -> CopyShape:
    """What a go's fields depend on besides the server's memory: layers and heads."""
    return req.layer_start, req.layer_end, req.head_start, req.head_end
