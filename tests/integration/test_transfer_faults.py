"""Hostile and failing peers: typed rejections, dropped connections, no wedged agent.

A serving agent runs in a child process; the attacks come from a raw UCX client
in this process (``UcxWorker`` plus the handshake helpers). After every attack a
well-behaved reader agent (second child process) must still be served.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvbridge.transfer.errors import PeerClosedError, PeerTimeoutError, ProtocolError
from kvbridge.transfer.protocol import security, wire
from kvbridge.transfer.protocol.handshake import reader_handshake, recv_msg, send_msg
from kvbridge.transfer.ucx.connection import UcxConnection
from tests.integration.raw_peer import CODEC, MAX_FRAME, SECRET, connect, me
from tests.integration.reads import issue, read, wait_read, wait_released
from tests.ports import free_port_base
from tests.transfer.agent_proc import AgentRef, Host, Spec, logical
from tests.waiting import WaitTimeout

pytestmark = pytest.mark.integration

P_SPEC = Spec("p-x", seed=7, secret=SECRET, config={"lease_s": 30.0})
D_SPEC = Spec("d-x", seed=-1, secret=SECRET)


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[AgentRef, AgentRef]]:
    p_host, d_host = Host(), Host()
    try:
        server = p_host.add(replace(P_SPEC, port=free_port_base(1)))
        reader = d_host.add(replace(D_SPEC, port=free_port_base(1)))
        yield server, reader
    finally:
        p_host.close()
        d_host.close()


def good_read_works(server: AgentRef, reader: AgentRef) -> None:
    request_id = f"good-{secrets.token_hex(4)}"
    blocks = [3, 8]
    token = issue([server], request_id, blocks, 1)
    read([reader], [server], request_id, token, blocks, [20, 21], 32)
    assert wait_read(reader, request_id)["failed"] == set()
    got = logical(reader.call("caches"), reader.spec, [20, 21], 32)
    want = logical(server.call("caches"), server.spec, blocks, 32)
    assert torch.equal(got, want)
    wait_released(server, request_id)


def released_within(server: AgentRef, request_id: str, timeout_s: float) -> bool:
    try:
        wait_released(server, request_id, timeout_s=timeout_s)
    except WaitTimeout:
        return False
    return True


async def expect_dropped(conn: UcxConnection) -> wire.RejectReason | None:
    """The server's last word: a Reject reason, or None if it just hung up."""
    try:
        msg = await recv_msg(conn, CODEC, MAX_FRAME, 3.0)
    except (PeerTimeoutError, PeerClosedError, ProtocolError):
        return None
    assert isinstance(msg, wire.Reject), msg
    return msg.reason


def raw_frames() -> dict[str, bytes]:
    junk = os.urandom(200)
    return {
        "random": junk,
        "truncated": (1000).to_bytes(4, "little") + (0).to_bytes(4, "little") + junk[:10],
        "bad_crc": (10).to_bytes(4, "little") + (1234).to_bytes(4, "little") + junk[:10],
        "oversized": bytes(MAX_FRAME + 64),
    }


@pytest.mark.parametrize("kind", sorted(raw_frames()))
def test_garbage_frames_drop_the_connection(agents: tuple[AgentRef, AgentRef], kind: str) -> None:
    server, reader = agents

    async def attack() -> wire.RejectReason | None:
        worker, conn = await connect(server.port)
        try:
            challenge = await recv_msg(conn, CODEC, MAX_FRAME, 5.0)
            assert isinstance(challenge, wire.Challenge)
            await conn.send(np.frombuffer(raw_frames()[kind], dtype=np.uint8), 0, timeout_s=5.0)
            return await expect_dropped(conn)
        finally:
            conn.abort()
            await worker.close()

    reason = asyncio.run(attack())
    assert reason in (None, wire.RejectReason.BAD_REQUEST)
    good_read_works(server, reader)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("version", wire.RejectReason.VERSION),
        ("compat", wire.RejectReason.COMPAT),
        ("secret", wire.RejectReason.AUTH),
        ("no_secret", wire.RejectReason.AUTH),
    ],
)
def test_bad_hello_is_rejected(
    agents: tuple[AgentRef, AgentRef], case: str, expected: wire.RejectReason
) -> None:
    server, reader = agents

    async def attack() -> wire.RejectReason | None:
        worker, conn = await connect(server.port)
        try:
            challenge = await recv_msg(conn, CODEC, MAX_FRAME, 5.0)
            assert isinstance(challenge, wire.Challenge)
            ident = me(
                secret=b"wrong secret, 32 bytes long....." if case == "secret" else SECRET,
                compat="0" * 64 if case == "compat" else None,
            )
            context = security.handshake_context("reader", ident.engine_id, 0, "p-x", 0)
            proof = None if case == "no_secret" else security.prove(
                ident.secret or b"", challenge.nonce, context
            )
            version = 99 if case == "version" else security.PROTOCOL_VERSION
            hello = wire.Hello(
                ident.engine_id, 0, version, ident.compat_hash, security.make_nonce(), proof
            )
            await send_msg(conn, CODEC, hello, 5.0)
            return await expect_dropped(conn)
        finally:
            conn.abort()
            await worker.close()

    assert asyncio.run(attack()) == expected
    good_read_works(server, reader)


@pytest.mark.parametrize("case", ["unknown", "expired", "outside"])
def test_bad_grant_is_rejected(agents: tuple[AgentRef, AgentRef], case: str) -> None:
    server, reader = agents
    blocks = [4, 5, 6]
    token = issue([server], f"grant-{case}", blocks, 1)
    if case == "expired":
        token = secrets.token_urlsafe(16)
        server.call("issue", "grant-expired-short", blocks, 1, 0.05, token)
        time.sleep(0.4)

    async def attack() -> wire.Message:
        worker, conn = await connect(server.port)
        try:
            await reader_handshake(conn, CODEC, me(), "p-x", 0, max_nbytes=MAX_FRAME, timeout_s=5)
            grant = secrets.token_urlsafe(16) if case == "unknown" else token
            block_ids = [4, 5, 33] if case == "outside" else blocks
            request = wire.ReadRequest(1, grant, block_ids, 0, 8, 0, 4, 8)
            await send_msg(conn, CODEC, request, 5.0)
            return await recv_msg(conn, CODEC, MAX_FRAME, 5.0)
        finally:
            conn.abort()
            await worker.close()

    reply = asyncio.run(attack())
    expected = {
        "unknown": wire.RejectReason.UNKNOWN_GRANT,
        "expired": wire.RejectReason.EXPIRED_GRANT,
        "outside": wire.RejectReason.NOT_GRANTED,
    }[case]
    assert isinstance(reply, wire.Reject) and reply.reason == expected, reply
    good_read_works(server, reader)


@pytest.mark.parametrize("config", [{"chunk_timeout_s": 1.0},
                                    {"chunk_timeout_s": 60.0, "read_timeout_s": 1.0}],
                         ids=["chunk_timeout", "read_timeout"])
def test_direct_read_to_a_stalled_reader_ends_at_its_send_deadline(
    config: dict[str, float],
) -> None:
    """A direct read is served by callbacks, not a task; its deadline must still end it.

    The reader asks for more than a shared-memory FIFO holds and then makes no
    UCX progress, connection open: the server's sends stall and no error ever
    comes. The send deadline must end the read (unpinning the grant) so that
    the lease releases the blocks, once, while the reader still stalls; then a
    good reader is served. The deadline is ``chunk_timeout_s`` per chunk, and
    never more than ``read_timeout_s``: a read pins its grant that long at most.
    """
    p_host, d_host = Host(), Host()
    try:
        server = p_host.add(replace(P_SPEC, engine_id="p-stall", port=free_port_base(1),
                                    config=config))
        reader = d_host.add(replace(D_SPEC, port=free_port_base(1)))
        blocks = list(range(8, 56))  # 48 blocks x 4 layers x 32 KiB = 6 MiB
        token = secrets.token_urlsafe(16)
        server.call("issue", "stall", blocks, 1, 1.5, token)
        asked = threading.Event()

        async def ask_and_stall() -> None:
            worker, conn = await connect(server.port)
            try:
                await reader_handshake(conn, CODEC, me(), "p-stall", 0, max_nbytes=MAX_FRAME,
                                       timeout_s=5)
                request = wire.ReadRequest(1, token, blocks, 0, 8, 0, 4, len(blocks), direct=True)
                await send_msg(conn, CODEC, request, 5.0)
                asked.set()
                time.sleep(6.0)  # blocks this loop: no UCX progress, nothing taken
            finally:
                conn.abort()
                await worker.close()

        stalled = threading.Thread(target=asyncio.run, args=(ask_and_stall(),))
        stalled.start()
        try:
            assert asked.wait(10.0)
            released_while_stalled = released_within(server, "stall", 4.5) and stalled.is_alive()
        finally:
            stalled.join(30.0)
        assert not stalled.is_alive(), "the stalled reader did not close"
        assert released_while_stalled, "the stalled read kept its grant pinned"
        stats, _ = server.call("grant_stats")
        assert (stats.num_released_expired, stats.num_released_done) == (1, 0)
        good_read_works(server, reader)
    finally:
        p_host.close()
        d_host.close()


def test_a_lease_is_renewed_only_for_a_read_in_flight() -> None:
    """Issue #29, finding 4: a lease could be renewed without a read in flight, so a
    peer holding a grant's token kept P's blocks held as long as it kept asking.

    A raw client renews a grant (1) reading nothing, (2) while a read of another
    grant is in flight: both refused as ``no_read``, and that grant expires at its
    original time; (3) for the read's own grant: renewed, to that read's deadline
    on P (chunk_timeout_s per chunk) and no later. P's grant clock moves only
    when the test says, so "its original time" is exact.
    """
    p_host = Host()
    try:
        server = p_host.add(replace(P_SPEC, engine_id="p-lease", port=free_port_base(1),
                                    manual_clock=True,
                                    config={"lease_s": 30.0, "chunk_timeout_s": 5.0}))
        idle, reading = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        server.call("issue", "idle", [4, 5], 1, 5.0, idle)
        server.call("issue", "reading", [6, 7], 1, 5.0, reading)
        expires_at = server.call("next_expiry")

        async def renew() -> list[wire.Message]:
            worker, conn = await connect(server.port)
            replies = []
            try:
                await reader_handshake(conn, CODEC, me(), "p-lease", 0, max_nbytes=MAX_FRAME,
                                       timeout_s=5)

                async def ask(msg: wire.Message) -> None:
                    await send_msg(conn, CODEC, msg, 5.0)
                    replies.append(await recv_msg(conn, CODEC, MAX_FRAME, 5.0))

                await ask(wire.RenewLease(idle, 60.0, 1))
                # a staged read of two one-block chunks, never credited: in flight
                # (P waits chunk_timeout_s for the credit) until it gives up
                await ask(wire.ReadRequest(2, reading, [6, 7], 0, 8, 0, 4, 1))
                await ask(wire.RenewLease(idle, 60.0, 2))
                await ask(wire.RenewLease(reading, 60.0, 2))
                return replies
            finally:
                conn.abort()
                await worker.close()

        no_read, header, other_read, own = asyncio.run(renew())
        for reply, xfer_id in ((no_read, 1), (other_read, 2)):
            assert isinstance(reply, wire.Reject), reply  # not LeaseRenewed
            assert (reply.reason, reply.renewal, reply.xfer_id) == (
                wire.RejectReason.NO_READ, True, xfer_id), reply
        assert isinstance(header, wire.DataHeader) and header.num_chunks == 2, header
        assert isinstance(own, wire.LeaseRenewed), own
        assert own.remaining_s == 2 * 5.0  # the read's deadline, not the 60 s asked for
        assert server.call("next_expiry") == expires_at  # the idle grant's, unchanged
        server.call("advance", 5.0)  # its lease as issued; the read's grant lives on
        wait_released(server, "idle")
        stats, num_live = server.call("grant_stats")
        assert (stats.num_released_expired, num_live) == (1, 1)
    finally:
        p_host.close()
