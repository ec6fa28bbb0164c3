"""``tests/slow_serving.py``: the fault tests' slow server, on each way of serving a read.

A server slowed from the test (kvbridge has no delay knob of its own) must
still serve every read whole (the wrappers reach the real sends), must hold
each read back with its grant pinned (what lets a fault test kill, cut or hang
up mid-transfer), and must unpin when the session ends during the delay.
In this process: a real server session and reader (``inproc.py``).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest

from kvbridge.transfer.serving.context import ServedRead
from tests.slow_serving import install, slow_serving
from tests.transfer.inproc import same_blocks, server_and_reader
from tests.waiting import wait_until_async

BLOCKS = [3, 9, 4]
#: Reader settings per way of serving (``ReadRequest.direct`` / ``local_copy``).
WAYS: dict[str, dict[str, Any]] = {
    "staged": {"direct_reads": False},
    "direct": {},
    "same_host_copy": {"local_copy": True},
}


@pytest.mark.parametrize("way", WAYS)
def test_a_slowed_read_lands_byte_for_byte(way: str) -> None:
    async def run() -> None:
        async with server_and_reader({"local_copy": True}, WAYS[way], chunk_delay_s=0.01) as (
                server, reader):
            server.ctx.grants.issue("req", BLOCKS, 1, grant=(tok := secrets.token_urlsafe(16)))
            reader.submit("req", tok, BLOCKS, [0, 1, 2])
            stats = await reader.outcome("req")
            assert stats.ok, stats
            assert (stats.num_direct, stats.num_local_copies) == {
                "staged": (0, 0), "direct": (1, 0), "same_host_copy": (1, 1)}[way]
            assert same_blocks(server.ctx.local, BLOCKS, reader.ctx.local, [0, 1, 2])

    asyncio.run(run())


@pytest.mark.parametrize("way", WAYS)
def test_a_slowed_read_is_held_back_pinned_and_unpinned_when_its_session_ends(
        way: str) -> None:
    async def run() -> None:
        # an hour per chunk: nothing is sent while the test looks
        async with server_and_reader({"local_copy": True}, WAYS[way], chunk_delay_s=3600.0) as (
                server, reader):
            ctx, grants = server.ctx, server.ctx.grants
            grants.issue("req", BLOCKS, 1, grant=(tok := secrets.token_urlsafe(16)))
            reader.submit("req", tok, BLOCKS, [0, 1, 2])
            [served] = await wait_until_async(
                lambda: [r for s in ctx.sessions for r in s.reads.values() if r.deadline],
                10.0, message="the read to be pinned")
            assert grants.revoke("req") and len(grants) == 1  # pinned: the release waits
            if way == "staged":  # the reader is ready for the first chunk
                await wait_until_async(lambda: served.credit >= 1, 10.0, message="credit")
            await asyncio.sleep(0.3)  # unslowed, the read would end now (fails nothing if slow)
            assert ctx.num_data_bytes_sent == 0 and ctx.num_holds == 0  # held back
            assert ctx.num_reads_served == 0 and len(grants) == 1  # still pinned
            await server.worker.close()  # the server's connections end, and its sessions
            await wait_until_async(lambda: len(grants) == 0, 10.0,
                                   message="the grant to be unpinned and released")
            grants.check_integrity()

    asyncio.run(run())


def test_undo_restores_the_real_serving_functions() -> None:
    from kvbridge.transfer.serving import direct, session

    real = ServedRead.wait_credit, direct._post_chunk, session.CopyHold
    with slow_serving(0.5):
        assert (ServedRead.wait_credit, direct._post_chunk, session.CopyHold) != real
    assert (ServedRead.wait_credit, direct._post_chunk, session.CopyHold) == real
    with pytest.raises(ValueError, match="finite and >= 0"):
        install(-1.0)
