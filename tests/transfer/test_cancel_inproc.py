"""A read the engine cancels (``Reads.cancel``: a load late at its deadline) ends at
once, failed, and writes nothing into its blocks after the cancel said so.

Issue #29, "Bounded synchronous loads": vLLM recomputes a late load into the same
blocks, so a cancelled read that went on writing them would give a wrong token.
Each test reads from a real server session that holds every chunk back
(``tests/slow_serving.py``), cancels once the first block landed, fills the blocks
with a sentinel, lets the server send the rest (its chunks reach the reader's
UCX worker and are dropped there as strays, or find the link gone), and checks
the sentinel is still there; then a next read works. Both halves in this process
on one loop (``tests/transfer/inproc.py``).
"""

from __future__ import annotations

import asyncio
import secrets

import torch

from kvbridge.transfer.local_kv import LocalKV
from tests.transfer.inproc import (
    BLOCK_NBYTES,
    LAYERS,
    Reader,
    Server,
    same_blocks,
    server_and_reader,
)
from tests.waiting import wait_until_async

BLOCKS = [10, 11, 12, 13, 14, 15]  # one chunk each (inproc.FAST)
LOCAL = [0, 1, 2, 3, 4, 5]
SENTINEL = 3.0
#: Generous: a loaded machine may starve the loop (the engine's own bound is 2 s).
QUIESCE_S = 10.0


def token() -> str:
    return secrets.token_urlsafe(16)


def fill(local: LocalKV, block_ids: list[int], value: float) -> None:
    for layer in local.layers:
        layer[:, block_ids] = value


def untouched(local: LocalKV, block_ids: list[int], value: float) -> bool:
    return all(bool((layer[:, block_ids] == value).all()) for layer in local.layers)


def num_serving(server: Server) -> int:
    return sum(len(session.reads) for session in server.ctx.sessions)


async def cancel_after_the_first_block(server: Server, reader: Reader) -> None:
    """Start a read of BLOCKS, cancel it once block 0 landed, and check its outcome."""
    server.ctx.grants.issue("late", BLOCKS, 1, lease_s=100.0, grant=(tok := token()))
    reader.submit("late", tok, BLOCKS, LOCAL)
    await wait_until_async(
        lambda: same_blocks(server.ctx.local, BLOCKS[:1], reader.ctx.local, LOCAL[:1]), 10.0,
        message="the read's first block to land")
    assert not same_blocks(server.ctx.local, BLOCKS, reader.ctx.local, LOCAL)  # still under way
    quiet = await reader.reads.cancel({"late", "never-started"}, QUIESCE_S)
    assert quiet == {"late", "never-started"}
    fill(reader.ctx.local, LOCAL, SENTINEL)  # what D computes into them from now on
    stats = await reader.outcome("late")
    assert not stats.ok and "ReadCancelledError" in stats.error, stats
    assert reader.failed["late"] == set(LOCAL)
    # reported once: the cancel of a read that ended has nothing left to do
    assert await reader.reads.cancel({"late"}, QUIESCE_S) == {"late"}
    outcomes = reader.reads.outcomes
    assert outcomes.take_finished() == set() and outcomes.take_failed() == {}


async def read_again(server: Server, reader: Reader) -> None:
    server.ctx.grants.issue("next", [1, 2], 1, grant=(tok := token()))
    reader.submit("next", tok, [1, 2], [20, 21])
    assert (await reader.outcome("next")).ok
    assert same_blocks(server.ctx.local, [1, 2], reader.ctx.local, [20, 21])


def test_a_cancelled_direct_read_lands_nothing_after_its_cancel() -> None:
    """Direct: the server's chunks land straight in our blocks. The cancel withdraws
    the receives no chunk matched yet; the chunks sent after it are dropped."""

    async def run() -> None:
        async with server_and_reader(chunk_delay_s=0.3) as (server, reader):
            await cancel_after_the_first_block(server, reader)
            stray_before = reader.worker.num_stray_dropped
            total = len(BLOCKS) * LAYERS * BLOCK_NBYTES
            await wait_until_async(lambda: server.ctx.num_data_bytes_sent >= total, 10.0,
                                   message="the server to send every chunk")
            await wait_until_async(lambda: num_serving(server) == 0, 10.0,
                                   message="the server's sends to end")
            # they reached this worker and found no receive: dropped, not landed
            await wait_until_async(
                lambda: reader.worker.num_stray_dropped - stray_before >= len(BLOCKS) - 1, 10.0,
                message="the chunks sent after the cancel to be dropped")
            assert untouched(reader.ctx.local, LOCAL, SENTINEL)
            await read_again(server, reader)
            assert server.ctx.num_sessions_total == 1  # over the same link

    asyncio.run(run())


def test_a_cancelled_staged_read_unpacks_nothing_after_its_cancel() -> None:
    """Staged: chunks land in staging buffers and are unpacked into our blocks. The
    cancel lets the unpack under way end; the link is given up."""

    async def run() -> None:
        async with server_and_reader({"chunk_timeout_s": 1.0}, {"direct_reads": False},
                                     chunk_delay_s=0.3) as (server, reader):
            await cancel_after_the_first_block(server, reader)
            # the server sends what the reader credited, then waits for credit in vain
            await wait_until_async(lambda: num_serving(server) == 0, 10.0,
                                   message="the server's read to end")
            await asyncio.sleep(0)
            assert untouched(reader.ctx.local, LOCAL, SENTINEL)
            await read_again(server, reader)

    asyncio.run(run())


def test_a_read_cancelled_before_its_task_ran_lets_go_of_its_receives() -> None:
    """A read begun at once by ``submit`` (a live link and plan) and cancelled before
    its task first ran: its receives are withdrawn, its failure reported."""

    async def run() -> None:
        async with server_and_reader(chunk_delay_s=0.3) as (server, reader):
            await read_again(server, reader)  # the link and plan are cached now
            server.ctx.grants.issue("late", BLOCKS, 1, lease_s=100.0, grant=(tok := token()))
            reader.submit("late", tok, BLOCKS, LOCAL)  # receives posted, request sent
            assert await reader.reads.cancel({"late"}, QUIESCE_S) == {"late"}
            fill(reader.ctx.local, LOCAL, SENTINEL)
            stats = await reader.outcome("late")
            assert not stats.ok and "ReadCancelledError" in stats.error, stats
            await wait_until_async(lambda: num_serving(server) == 0, 10.0,
                                   message="the server's sends to end")
            await wait_until_async(
                lambda: reader.worker.num_stray_dropped >= len(BLOCKS), 10.0,
                message="the chunks to be dropped")
            assert untouched(reader.ctx.local, LOCAL, SENTINEL)
            assert torch.equal(reader.ctx.local.layers[0][:, 20], server.ctx.local.layers[0][:, 1])

    asyncio.run(run())
