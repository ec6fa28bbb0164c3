"""Refused handshakes and refused reads: typed reject, a log line, and not one KV byte out.

``tests/integration/test_transfer_faults.py`` checks the reject *reasons*; this
module proves the stronger claim of issue 8: for every refused attempt the
attacker did everything a real reader does to receive data (read request,
credit for many chunks, receives posted on every data channel of its read)
and still

* no receive completed and no ``DataHeader`` arrived,
* the agent's count of KV bytes handed to UCX did not move,
* the agent logged the refusal with its reason,
* the victim's grant is still live and a good reader is still served.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import pytest

from kvbridge.transfer.errors import RejectedError, TransferError
from kvbridge.transfer.protocol import security, wire
from kvbridge.transfer.protocol.handshake import Identity, reader_handshake, recv_msg, send_msg
from kvbridge.transfer.protocol.wire import channel_of
from kvbridge.transfer.serving.grants import GRANT_LEN
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.faults.fuzz_client import CODEC, MAX_FRAME, FaultHost, counters, good_read, hosts
from tests.integration.reads import issue, read, wait_read, wait_released
from tests.ports import free_port_base
from tests.transfer.agent_proc import AgentRef, Spec

pytestmark = pytest.mark.faults

SECRET = b"security tests use 32 bytes here"
# Leases on a manual clock: the expired grant's lease ends by ``advance``, not a sleep.
P_SPEC = Spec("p-sec", seed=21, secret=SECRET, num_blocks=64,
              config={"grant_wait_s": 0.3, "lease_s": 120.0}, manual_clock=True)
D_SPEC = Spec("d-sec", seed=-1, secret=SECRET, num_blocks=64)
NUM_CHUNKS = 8  # receives posted per attempt: enough for every block the read names
R = wire.RejectReason


@dataclass
class Setup:
    p_host: FaultHost
    server: AgentRef
    reader: AgentRef
    victim_token: str
    victim_blocks: list[int]


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    with hosts(2) as (p_host, d_host):
        server = p_host.add(replace(P_SPEC, port=free_port_base(1)))
        reader = d_host.add(replace(D_SPEC, port=free_port_base(1)))
        blocks = [12, 13, 14]
        token = issue([server], "victim", blocks, 1)  # live for the whole module
        yield Setup(p_host, server, reader, token, blocks)


@dataclass(frozen=True)
class Attempt:
    """Who connects, and which read it asks for."""

    secret: bytes | None = SECRET
    version: int = security.PROTOCOL_VERSION
    compat: str | None = None  # None: the right hash
    grant: str = ""
    block_ids: tuple[int, ...] = (12,)


async def attack(port: int, attempt: Attempt) -> tuple[wire.Message | None, bool]:
    """Try to read; return (the agent's first answer, whether any data receive completed)."""
    worker = UcxWorker()
    conn = await worker.connect("127.0.0.1", port, timeout_s=5.0)
    posted: list[asyncio.Future[None]] = []
    try:
        compat = attempt.compat or security.compat_hash(P_SPEC.compat())
        me = Identity("mallory", 0, compat, attempt.secret)
        answer: wire.Message | None = None
        try:
            if attempt.version == security.PROTOCOL_VERSION:
                await reader_handshake(conn, CODEC, me, P_SPEC.engine_id, 0,
                                       max_nbytes=MAX_FRAME, timeout_s=5.0)
            else:  # the reader helper always speaks the current version: build it here
                challenge = await recv_msg(conn, CODEC, MAX_FRAME, 5.0)
                assert isinstance(challenge, wire.Challenge)
                context = security.handshake_context("reader", "mallory", 0, P_SPEC.engine_id, 0)
                proof = security.prove(SECRET, challenge.nonce, context)
                await send_msg(conn, CODEC, wire.Hello("mallory", 0, attempt.version, compat,
                                                       security.make_nonce(), proof), 5.0)
                answer = await recv_msg(conn, CODEC, MAX_FRAME, 5.0)
        except RejectedError as exc:
            answer = wire.Reject(R(exc.reason), str(exc))
        # A refused peer carries on as if accepted: ask, give credit, post receives.
        xfer_id = 5
        for chunk in range(NUM_CHUNKS):
            buf = np.empty(1 << 20, dtype=np.uint8)
            posted.append(conn.post_recv(buf, channel_of(xfer_id, chunk)))
        request = wire.ReadRequest(xfer_id, attempt.grant or secrets.token_urlsafe(16),
                                   list(attempt.block_ids), 0, 8, 0, P_SPEC.num_layers, 1)
        try:
            await send_msg(conn, CODEC, request, 5.0)
            await send_msg(conn, CODEC, wire.Credit(xfer_id, NUM_CHUNKS), 5.0)
            while answer is None:
                msg = await recv_msg(conn, CODEC, MAX_FRAME, 5.0)
                assert not isinstance(msg, wire.DataHeader), "the agent started sending KV"
                if isinstance(msg, wire.Reject):
                    answer = msg
        except TransferError:
            pass  # refused at the handshake: the agent hung up
        await asyncio.sleep(0.5)  # time for any stray chunk to land
        return answer, any(f.done() and not f.cancelled() for f in posted)
    finally:
        conn.abort()
        await worker.close()
        for future in posted:  # cancelled by the close: nothing to report
            if future.done() and not future.cancelled():
                future.exception()


CASES = {
    "wrong_secret": (Attempt(secret=b"not the cluster secret, 32 bytes"), R.AUTH),
    "no_secret": (Attempt(secret=None), R.AUTH),
    "wrong_version": (Attempt(version=security.PROTOCOL_VERSION + 1), R.VERSION),
    "wrong_compat": (Attempt(compat="f" * 64), R.COMPAT),
    "forged_grant": (Attempt(grant=secrets.token_urlsafe(16)[:GRANT_LEN]), R.UNKNOWN_GRANT),
    "expired_grant": (Attempt(grant="<expired>", block_ids=(30,)), R.EXPIRED_GRANT),
    "released_grant": (Attempt(grant="<released>", block_ids=(31,)), R.UNKNOWN_GRANT),
    "other_requests_grant": (Attempt(grant="<other>", block_ids=(12, 13)), R.NOT_GRANTED),
    "blocks_outside_grant": (Attempt(grant="<victim>", block_ids=(12, 13, 15)), R.NOT_GRANTED),
    "blocks_outside_cache": (Attempt(grant="<victim>", block_ids=(12, 64)), R.BAD_REQUEST),
}


def resolve(setup: Setup, attempt: Attempt) -> Attempt:
    """Fill in grant placeholders with real tokens of the server."""
    server = setup.server
    if attempt.grant == "<victim>":
        return replace(attempt, grant=setup.victim_token)
    if attempt.grant == "<other>":  # a live grant of another request, over other blocks
        return replace(attempt, grant=issue([server], f"other-{secrets.token_hex(3)}", [40], 1))
    if attempt.grant == "<expired>":
        token = secrets.token_urlsafe(16)
        server.call("issue", f"short-{token[:4]}", list(attempt.block_ids), 1, 0.05, token)
        server.call("advance", 0.1)  # past its lease, nowhere near the others' (120 s)
        return replace(attempt, grant=token)
    if attempt.grant == "<released>":  # read to the end by its reader, then replayed
        token = secrets.token_urlsafe(16)
        server.call("issue", f"done-{token[:4]}", list(attempt.block_ids), 1, None, token)
        good_read_token(setup, token, list(attempt.block_ids))
        return replace(attempt, grant=token)
    return attempt


def good_read_token(setup: Setup, token: str, blocks: list[int]) -> None:
    """The grant's rightful reader reads it to the end (and the server releases it)."""
    request_id = f"done-{token[:4]}"
    read([setup.reader], [setup.server], request_id, token, blocks, [50 + b % 8 for b in blocks],
         setup.server.spec.block_size * len(blocks))
    assert wait_read(setup.reader, request_id)["failed"] == set()
    wait_released(setup.server, request_id)


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_attempt_gets_no_kv_byte(setup: Setup, name: str) -> None:
    attempt, reason = CASES[name]
    attempt = resolve(setup, attempt)
    setup.server.call("logs", "")  # forget what came before
    before = counters(setup.server)

    answer, data_arrived = asyncio.run(attack(setup.server.port, attempt))

    assert isinstance(answer, wire.Reject) and answer.reason == reason, answer
    assert not data_arrived
    after = counters(setup.server)
    assert after.num_data_bytes_sent == before.num_data_bytes_sent
    assert after.num_reads_served == before.num_reads_served
    logs = "\n".join(setup.server.call("logs", ""))
    assert f": {reason}:" in logs and "rejecting" in logs, logs
    _, num_live = setup.server.call("grant_stats")
    assert num_live >= 1  # the victim's grant is untouched
    good_read(setup.server, setup.reader, [7, 9], [20, 21])


def test_forged_done_reports_release_nothing(setup: Setup) -> None:
    """Reports naming a forged grant neither free the victim's blocks nor count for it."""

    async def report() -> None:
        worker = UcxWorker()
        conn = await worker.connect("127.0.0.1", setup.server.port, timeout_s=5.0)
        try:
            me = Identity("mallory", 0, security.compat_hash(P_SPEC.compat()), SECRET)
            await reader_handshake(conn, CODEC, me, P_SPEC.engine_id, 0, max_nbytes=MAX_FRAME,
                                   timeout_s=5.0)
            victim = setup.victim_token
            for forged in (victim[:-1] + ("A" if victim[-1] != "A" else "B"), victim.upper(),
                           victim + "x", secrets.token_urlsafe(16)):
                await send_msg(conn, CODEC, wire.ReadDone(forged, "mallory:0", True), 5.0)
            await send_msg(conn, CODEC, wire.Bye(""), 5.0)
        finally:
            conn.abort()
            await worker.close()

    stats_before, live_before = setup.server.call("grant_stats")
    asyncio.run(report())
    time.sleep(P_SPEC.config["grant_wait_s"] + 0.5)  # let the reports wait out their grants
    stats_after, live_after = setup.server.call("grant_stats")
    assert live_after == live_before
    assert stats_after.num_readers_done == stats_before.num_readers_done
    assert "done report from mallory:0 ignored" in "\n".join(setup.server.call("logs", ""))
