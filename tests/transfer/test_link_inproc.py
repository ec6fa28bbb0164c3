"""A reader's link against a real server session (or a scripted one) in this process.

``reading/link.py``/``reading/jobs.py`` on one side, ``serving/session.py``'s ``serve_connection``
on the other, two UCX workers on one event loop (``tests/transfer/inproc.py``).
The server's grant table runs on a ``ManualClock``: a lease ends when the test
moves the clock, never by sleeping. Covers issue #20's protocol defects: a
refused lease renewal fails its own read only, a peer's unexpected answer is a
``ProtocolError`` (never an assert), a second waiter for one reply is refused,
and a grant is looked up by the one token its issuer chose. And issue #29's
finding 4: a lease is renewed only for a read of its grant in flight, never
past that read's deadline; any other renewal is refused (``no_read``) and
extends nothing.
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

from kvbridge.topology import RemoteRead, build_read_plan
from kvbridge.transfer.errors import (
    LeaseRefusedError,
    NoReadServedError,
    ProtocolError,
    RejectedError,
    ReplyPendingError,
)
from kvbridge.transfer.local_kv import topology_of
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.link import PeerLink
from kvbridge.transfer.ucx.connection import UcxConnection
from tests.transfer.inproc import (
    BLOCK_NBYTES,
    BLOCK_SIZE,
    FAST,
    HOST,
    LAYERS,
    SERVER_ID,
    TOPOLOGY,
    Reader,
    Server,
    fake_server_link,
    fake_server_reader,
    same_blocks,
    server_and_reader,
)
from tests.waiting import wait_until_async

R = wire.RejectReason


def token() -> str:
    return secrets.token_urlsafe(16)


def test_a_read_by_the_engine_chosen_token_lands_byte_for_byte() -> None:
    async def run() -> None:
        async with server_and_reader() as (server, reader):
            grant = server.ctx.grants.issue("req", [3, 9, 4], 1, grant=(tok := token()))
            assert grant.grant == tok  # the table keeps the issuer's token: no second one
            reader.submit("req", tok, [3, 9, 4], [0, 1, 2])
            stats = await reader.outcome("req")
            assert stats.ok and stats.num_direct == 1, stats
            assert same_blocks(server.ctx.local, [3, 9, 4], reader.ctx.local, [0, 1, 2])
            # the reader's done report is counted against that same token
            await wait_until_async(lambda: len(server.ctx.grants) == 0, 10.0,
                                   message="the grant to be released")
            server.ctx.grants.check_integrity()

    asyncio.run(run())


def test_a_read_after_the_lease_ended_is_refused_as_expired() -> None:
    async def run() -> None:
        async with server_and_reader() as (server, reader):
            server.ctx.grants.issue("old", [5], 1, lease_s=2.0, grant=(tok := token()))
            server.clock.advance(2.0)  # no sleep: the table's clock says the lease is over
            reader.submit("old", tok, [5], [0])
            stats = await reader.outcome("old")
            assert not stats.ok and "expired_grant" in stats.error, stats
            assert reader.failed["old"] == {0}

    asyncio.run(run())


# Staged reads of 6 one-block chunks, each held back 0.1 s by the server: a read
# lasts >= 0.6 s, and renews its grant from 0.05 s on, every 0.05 s.
SLOW_S = 0.1
RENEWING = {"direct_reads": False, "renew_every_s": 0.05, "lease_s": 1.0}
BLOCKS = [10, 11, 12, 13, 14, 15]


def test_a_refused_renewal_fails_its_own_read_and_no_other() -> None:
    """Defect: the server refused with ``Reject(xfer_id=0)`` and the reader took
    that as the connection's end, failing every read on the link."""

    async def run() -> None:
        async with server_and_reader(None, RENEWING, chunk_delay_s=SLOW_S) as (server, reader):
            grants = server.ctx.grants
            grants.issue("short", BLOCKS, 1, lease_s=1.0, grant=(short := token()))
            grants.issue("long", BLOCKS, 1, lease_s=100.0, grant=(long := token()))
            reader.submit("short", short, BLOCKS, list(range(6)))
            reader.submit("long", long, BLOCKS, list(range(6, 12)))
            # Both reads pinned their grants (each holds a staging buffer once the
            # server's DataHeader came); then the short lease ends under them.
            await wait_until_async(lambda: reader.ctx.pool.num_lent == 2, 10.0,
                                   message="both reads to begin")
            server.clock.advance(5.0)
            refused, kept = await reader.outcome("short"), await reader.outcome("long")
            assert not refused.ok and "LeaseRefusedError" in refused.error, refused
            assert "expired_grant" in refused.error
            assert kept.ok, kept
            assert same_blocks(server.ctx.local, BLOCKS, reader.ctx.local, list(range(6, 12)))
            # the link lived on: a third read goes over the same connection
            grants.issue("after", [1], 1, grant=(after := token()))
            reader.submit("after", after, [1], [20])
            assert (await reader.outcome("after")).ok
            assert server.ctx.num_sessions_total == 1

    asyncio.run(run())


def test_two_reads_of_one_grant_renew_at_once_on_one_link() -> None:
    """Defect: renewals waited under the grant's hash, so the second read's
    renewal replaced the first's waiter, which then timed out and killed the link."""

    async def run() -> None:
        cfg = {**RENEWING, "reply_timeout_s": 0.3}  # a read lasts longer than that
        async with server_and_reader(None, cfg, chunk_delay_s=SLOW_S) as (server, reader):
            # more readers than will report: no release ends the lease under the reads
            server.ctx.grants.issue("shared", BLOCKS, 5, lease_s=100.0, grant=(tok := token()))
            reader.submit("a", tok, BLOCKS, list(range(6)))
            reader.submit("b", tok, BLOCKS, list(range(6, 12)))
            first, second = await reader.outcome("a"), await reader.outcome("b")
            assert first.ok and second.ok, (first, second)
            for local in (list(range(6)), list(range(6, 12))):
                assert same_blocks(server.ctx.local, BLOCKS, reader.ctx.local, local)
            assert server.ctx.num_sessions_total == 1

    asyncio.run(run())


async def _renewals_answered(conn: UcxConnection, codec: wire.MessageCodec,
                             msg: wire.Message) -> None:
    if isinstance(msg, wire.RenewLease):
        answer = wire.LeaseRenewed(msg.grant, 12.5, msg.xfer_id)
        await conn.send_frame(codec.encode(answer), timeout_s=5.0)


def test_a_second_waiter_for_one_reply_is_refused_and_the_first_keeps_it() -> None:
    async def run() -> None:
        async with fake_server_link(_renewals_answered) as (link, _):
            first = asyncio.ensure_future(link.renew("some-grant-token-00", 30.0, 77))
            await asyncio.sleep(0)  # the first renewal is sent and waits for its answer
            with pytest.raises(ReplyPendingError, match="already awaited"):
                await link.renew("some-grant-token-00", 30.0, 77)
            assert await first == 12.5
            assert await link.renew("some-grant-token-00", 30.0, 77) == 12.5  # free again
            assert link.alive

    asyncio.run(run())


async def _answer_staged_reads_with_copy_go(conn: UcxConnection, codec: wire.MessageCodec,
                                            msg: wire.Message) -> None:
    match msg:
        case wire.ReadRequest(xfer_id=xfer_id, grant="copy-go-please-0000"):
            go = wire.CopyGo(xfer_id, np.zeros(4, np.uint64).tobytes(), 1, 0, 1, 5.0)
            GO_SENT.append(xfer_id)
            await conn.send_frame(codec.encode(go), timeout_s=5.0)
        case wire.ReadRequest(xfer_id=xfer_id):
            reject = wire.Reject(R.UNKNOWN_GRANT, "no such grant", xfer_id)
            await conn.send_frame(codec.encode(reject), timeout_s=5.0)
        case wire.CopyDone(xfer_id=xfer_id, ok=ok):
            COPY_DONE.append((xfer_id, ok))


GO_SENT: list[int] = []
COPY_DONE: list[tuple[int, bool]] = []


def test_an_unexpected_answer_to_a_read_is_a_protocol_error_of_that_read() -> None:
    """Defect: ``assert isinstance(header, wire.DataHeader)`` met a ``CopyGo``."""
    GO_SENT.clear()
    COPY_DONE.clear()

    async def run() -> None:
        async with fake_server_link(_answer_staged_reads_with_copy_go) as (link, item):
            with pytest.raises(ProtocolError, match="CopyGo .*staged read"):
                await link.read(item, "copy-go-please-0000", [1, 2], [1, 2], 8)
            assert link.alive  # nothing was posted for it: the link goes on
            with pytest.raises(RejectedError, match="unknown_grant"):
                await link.read(item, "another-grant-0000", [1], [1], 4)
            # the go pinned a grant on the server: we said at once we will not copy
            await wait_until_async(lambda: bool(COPY_DONE), 10.0, message="CopyDone")
            [go_id], [(done_id, ok)] = GO_SENT, COPY_DONE
            assert (done_id, ok) == (go_id, False)

    asyncio.run(run())


async def _renewals_answered_wrongly(conn: UcxConnection, codec: wire.MessageCodec,
                                     msg: wire.Message) -> None:
    if isinstance(msg, wire.RenewLease):  # a lease answer for another read
        answer = wire.LeaseRenewed(msg.grant, 3.0, msg.xfer_id + 1)
        await conn.send_frame(codec.encode(answer), timeout_s=5.0)
        refused = wire.Reject(R.EXPIRED_GRANT, "expired", msg.xfer_id, renewal=True)
        await conn.send_frame(codec.encode(refused), timeout_s=5.0)


def test_a_refused_renewal_raises_lease_refused_and_keeps_the_link() -> None:
    async def run() -> None:
        async with fake_server_link(_renewals_answered_wrongly) as (link, _):
            with pytest.raises(LeaseRefusedError, match="expired_grant") as refused:
                await link.renew("some-grant-token-00", 30.0, 4)
            assert isinstance(refused.value, RejectedError)  # a verdict, like any reject
            assert link.alive

    asyncio.run(run())


# ------------------------------------------------------------------- renewals only while reading


async def open_link(server: Server, reader: Reader) -> tuple[PeerLink, RemoteRead]:
    """A bare link of the reader's to the server, and the one item of its read plan."""
    link = await PeerLink.open(reader.ctx, reader.worker, HOST, server.port, SERVER_ID, 0)
    plan = build_read_plan(TOPOLOGY, 0, 0, topology_of(link.meta), SERVER_ID)
    return link, plan.items[0]


#: A staged read's deadline on the server: chunk_timeout_s per chunk, but at most
#: read_timeout_s (6 x 5 s > 20 s).
READ_BUDGET_S = min(len(BLOCKS) * FAST["chunk_timeout_s"], FAST["read_timeout_s"])


def test_a_lease_is_renewed_only_for_a_read_of_its_grant_in_flight() -> None:
    """Issue #29, finding 4: the server renewed any live grant for anyone who asked,
    reading or not, so a reader could keep P's blocks held for ever. Now: no read in
    flight, a read of another grant, a read that ended: refused as ``no_read`` (the
    reader's typed ``NoReadServedError``), nothing extended, the grant expires as
    issued; the read's own grant is renewed, up to that read's deadline."""

    async def run() -> None:
        staged = {"direct_reads": False}
        async with server_and_reader(None, staged, chunk_delay_s=SLOW_S) as (server, reader):
            grants, start = server.ctx.grants, server.clock.now()
            grants.issue("reading", BLOCKS, 1, lease_s=5.0, grant=(read_tok := token()))
            idle = grants.issue("idle", [1], 1, lease_s=5.0, grant=(idle_tok := token()))
            link, item = await open_link(server, reader)
            try:
                with pytest.raises(NoReadServedError, match="no_read") as refused:
                    await link.renew(idle_tok, 100.0, 1)  # no read at all
                assert isinstance(refused.value, LeaseRefusedError)
                assert refused.value.reason == R.NO_READ and link.alive
                with pytest.raises(LeaseRefusedError, match="unknown_grant") as gone:
                    await link.renew(token(), 100.0, 1)  # a grant that is gone says so
                assert not isinstance(gone.value, NoReadServedError)

                reading = asyncio.ensure_future(
                    link.read(item, read_tok, BLOCKS, list(range(6)), BLOCK_SIZE * len(BLOCKS)))
                [session] = server.ctx.sessions
                await wait_until_async(
                    lambda: [r.deadline for r in session.reads.values()] != [None]
                    and bool(session.reads), 10.0, message="the read to be pinned")
                [(xfer_id, served)] = session.reads.items()
                with pytest.raises(NoReadServedError):  # a read in flight, of another grant
                    await link.renew(idle_tok, 100.0, xfer_id)
                remaining = await link.renew(read_tok, 100.0, xfer_id)  # its own: renewed
                assert remaining == pytest.approx(READ_BUDGET_S)  # to its deadline, no later
                assert grants.validate_read(read_tok, []).expires_at == served.deadline
                await reading
                assert same_blocks(server.ctx.local, BLOCKS, reader.ctx.local, list(range(6)))
                with pytest.raises(NoReadServedError):  # the read ended: nothing to renew
                    await link.renew(read_tok, 100.0, xfer_id)
                assert link.alive and server.ctx.num_sessions_total == 1
            finally:
                await link.close()
            assert grants.validate_read(idle_tok, []).expires_at == idle.expires_at
            server.clock.advance(idle.expires_at - start)  # the idle grant's lease as issued
            assert [r.request_id for r in grants.expire()] == ["idle"]
            grants.check_integrity()

    asyncio.run(run())


def test_a_long_read_renews_its_lease_up_to_its_deadline_and_lands() -> None:
    """A read longer than renew_every_s renews while it runs (and lands); the lease
    it gets ends at the read's deadline on the server, not at ``now + lease_s``."""

    async def run() -> None:
        cfg = {**RENEWING, "lease_s": 1000.0}  # asks for far more than the read needs
        async with server_and_reader(None, cfg, chunk_delay_s=SLOW_S) as (server, reader):
            grants = server.ctx.grants
            # two readers expected: this one's report does not release the grant
            g = grants.issue("long", BLOCKS, 2, lease_s=1.0, grant=(tok := token()))
            reader.submit("long", tok, BLOCKS, list(range(6)))
            await wait_until_async(lambda: grants.next_expiry() != g.expires_at, 10.0,
                                   message="a renewal")
            pinned_at = server.clock.now()  # the grant clock never moves here
            assert grants.next_expiry() == pytest.approx(pinned_at + READ_BUDGET_S)
            stats = await reader.outcome("long")
            assert stats.ok, stats
            assert same_blocks(server.ctx.local, BLOCKS, reader.ctx.local, list(range(6)))
            assert grants.next_expiry() == pytest.approx(pinned_at + READ_BUDGET_S)

    asyncio.run(run())


RENEWALS: list[int] = []


async def _staged_read_with_refused_renewals(conn: UcxConnection, codec: wire.MessageCodec,
                                             msg: wire.Message) -> None:
    """Serve one staged read of one block, its chunk only after renewals were refused
    as ``no_read`` (a server whose half of the read is over, or not pinned yet)."""
    match msg:
        case wire.ReadRequest(xfer_id=xfer_id, block_ids=ids):
            header = wire.DataHeader(xfer_id, 1, len(ids) * BLOCK_NBYTES * LAYERS)
            await conn.send_frame(codec.encode(header), timeout_s=5.0)
        case wire.RenewLease(xfer_id=xfer_id):
            RENEWALS.append(xfer_id)
            refused = wire.Reject(R.NO_READ, "no such read", xfer_id, renewal=True)
            await conn.send_frame(codec.encode(refused), timeout_s=5.0)
            if len(RENEWALS) == 2:  # the reader took the first refusal in and asked again
                chunk = np.arange(BLOCK_NBYTES * LAYERS, dtype=np.uint8)
                await conn.send(chunk, wire.channel_of(xfer_id, 0), timeout_s=5.0)
        case _:
            pass


def test_a_renewal_refused_as_no_read_fails_no_read() -> None:
    """``no_read`` is no verdict on the read (unlike ``expired_grant``, which fails it
    when it ends): the read lands, and the reader renews again next round (a server
    that had not pinned the grant yet may renew then)."""
    RENEWALS.clear()

    async def run() -> None:
        cfg = {"direct_reads": False, "renew_every_s": 0.05}
        async with fake_server_reader(_staged_read_with_refused_renewals, cfg) as reader:
            reader.submit("moot", "some-grant-token-00", [3], [5])
            stats = await reader.outcome("moot")
            assert stats.ok, stats  # its data came: the refusals failed nothing
            assert len(RENEWALS) >= 2 and len(set(RENEWALS)) == 1, RENEWALS

    asyncio.run(run())
