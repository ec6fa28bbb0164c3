"""Staged reads with their packs and unpacks on the copy thread or on the agent's loop
(``AgentConfig.staged_launch``, ``transfer/blocks/launching.py``; issue #41).

Both halves in this process on one loop (``tests/transfer/inproc.py``), real UCX
on loopback, direct reads off so every read stages. On the CPU a "loop" launch
copies before it returns (there is no CUDA event to watch), so the loop path's
control flow runs for real: unpacks started while the next chunk is awaited,
buffers posted and credited again as their unpacks end, a cancel that waits
for them. ``late_device`` makes each launch end later, as a CUDA event passes
after its launch, so that unpacks are still under way when chunks arrive or a
cancel comes.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks import launching
from kvbridge.transfer.blocks.launching import launch_mode
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.reading import staged as reading_staged
from tests.transfer.inproc import BLOCK_SIZE, TOPOLOGY, Reader, Server, server_and_reader
from tests.waiting import wait_until_async

STAGED = {"direct_reads": False}
MODES = ("loop", "thread")
REMOTE = [9, 2, 20, 7, 11, 3, 30]  # one block a chunk (inproc.FAST): 7 chunks
NUM_TOKENS = BLOCK_SIZE * 6 + 3  # the last block in part
#: reader -> (its topology, the window); the server is ``TOPOLOGY`` (NHD, blocks of 4)
READERS: dict[str, tuple[EngineTopology, int]] = {
    "nhd4_window1": (TOPOLOGY, 1),
    "hnd8_window2": (replace(TOPOLOGY, layout=KVLayout.HND, block_size=8), 2),
    "hnd2_window3": (replace(TOPOLOGY, layout=KVLayout.HND, block_size=2), 3),
}


def token() -> str:
    return secrets.token_urlsafe(16)


def tokens(local: LocalKV, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The blocks' first ``num_tokens`` tokens as ``[layer, kv, token, head, dim]``."""
    out = []
    for layer in local.layers:
        planes = layer.transpose(2, 3) if local.topology.layout == KVLayout.HND else layer
        picked = planes[:, block_ids]
        out.append(picked.reshape(picked.shape[0], -1, *picked.shape[3:])[:, :num_tokens])
    return torch.stack(out)


def local_ids(topology: EngineTopology, num_tokens: int) -> list[int]:
    """Scattered, distinct local blocks for ``num_tokens`` tokens."""
    num_blocks = -(-num_tokens // topology.block_size)
    return [(5 * i + 3) % 32 for i in range(num_blocks)]


def config(mode: str, **more: object) -> dict[str, object]:
    return {**STAGED, "staged_launch": mode, **more}


async def read(server: Server, reader: Reader, name: str, remote: list[int], local: list[int],
               num_tokens: int) -> torch.Tensor:
    """Read, check it went well and staged, and return what landed (logical tokens)."""
    server.ctx.grants.issue(name, remote, 1, grant=(tok := token()))
    reader.submit(name, tok, remote, local, num_tokens)
    stats = await reader.outcome(name)
    assert stats.ok and stats.num_direct == 0, stats
    return tokens(reader.ctx.local, local, num_tokens)


async def pools_idle(server: Server, reader: Reader) -> None:
    """Every staging buffer back (the server's after its sends ended)."""
    await wait_until_async(lambda: server.ctx.pool.num_lent == 0, 10.0,
                           message="the server's buffers to come back")
    assert reader.ctx.pool.num_lent == 0


class LateEvent:
    """Passes ``delay_s`` after the launch it follows (a CUDA event on a busy device)."""

    def __init__(self, delay_s: float) -> None:
        self.due = time.perf_counter() + delay_s
        self.passed = False

    def query(self) -> bool:
        self.passed = self.passed or time.perf_counter() >= self.due
        return self.passed


@pytest.fixture
def late_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[float], list[LateEvent]]]:
    """``late_device(delay_s)``: every unpack launched on the loop ends ``delay_s``
    after it copied (packs end at once); returns the list of their events."""

    def install(delay_s: float) -> list[LateEvent]:
        events: list[LateEvent] = []

        def run_here(on: torch.Tensor, work: functools.partial[None]) -> LateEvent | None:
            work()
            if work.func is not reading_staged._unpack:
                return None
            events.append(LateEvent(delay_s))
            return events[-1]

        monkeypatch.setattr(launching, "_run_here", run_here)
        return events

    yield install


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA caches (CUDA events): GPU runs only"))])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_loop_and_thread_launches_land_the_same_exact_bytes(reader: str, device: str) -> None:
    """On a GPU, "loop" launches the kernels on the loop and watches real CUDA events."""
    topology, window = READERS[reader]
    local = local_ids(topology, NUM_TOKENS)

    async def landed(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        async with server_and_reader(config(mode), config(mode, window_chunks=window),
                                     reader_topology=topology, device=device) as (
                server, reader_):
            got = await read(server, reader_, mode, REMOTE, local, NUM_TOKENS)
            await pools_idle(server, reader_)
            return got, tokens(server.ctx.local, REMOTE, NUM_TOKENS)

    (loop_got, want), (thread_got, _) = asyncio.run(landed("loop")), asyncio.run(landed("thread"))
    assert torch.equal(loop_got, want)
    assert torch.equal(thread_got, want)


@pytest.mark.parametrize("mode", MODES)
def test_a_window_of_eight_reads_many_chunks(mode: str) -> None:
    """24 one-block chunks through 8 buffers, twice over one link."""
    remote = [(7 * i + 1) % 32 for i in range(24)]
    local = [(11 * i + 5) % 32 for i in range(24)]

    async def run() -> None:
        async with server_and_reader(config(mode), config(mode, window_chunks=8)) as (
                server, reader):
            assert reader.ctx.pool.num_buffers == 32  # num_read_slots x window_chunks
            for name in ("first", "again"):
                server.ctx.local.layers[0][:, remote] += 1  # new bytes for the second read
                got = await read(server, reader, name, remote, local, BLOCK_SIZE * 24)
                assert torch.equal(got, tokens(server.ctx.local, remote, BLOCK_SIZE * 24))
            assert server.ctx.num_sessions_total == 1
            await pools_idle(server, reader)

    asyncio.run(run())


def test_unpacks_that_end_late_still_land_exact_bytes(
    late_device: Callable[[float], list[LateEvent]],
) -> None:
    """Each unpack ends 20 ms after it copied: chunks arrive while unpacks are
    under way; the bytes are exact and the read ends only after every unpack."""
    events = late_device(0.02)
    topology, _ = READERS["hnd8_window2"]
    local = local_ids(topology, NUM_TOKENS)

    async def run() -> None:
        async with server_and_reader(config("loop"), config("loop", window_chunks=3),
                                     reader_topology=topology) as (server, reader):
            got = await read(server, reader, "late", REMOTE, local, NUM_TOKENS)
            assert torch.equal(got, tokens(server.ctx.local, REMOTE, NUM_TOKENS))
            # one unpack a chunk, each ended before the read did
            assert len(events) == len(REMOTE) and all(event.passed for event in events)
            await pools_idle(server, reader)

    asyncio.run(run())


def test_a_cancelled_read_waits_for_its_late_unpack_and_gives_its_buffers_back(
    late_device: Callable[[float], list[LateEvent]],
) -> None:
    """A cancel while an unpack is under way on the device: the read ends only
    once that unpack's event passed; its buffers are discarded, not reused."""
    events = late_device(0.6)
    blocks, local = [10, 11, 12, 13, 14, 15], [0, 1, 2, 3, 4, 5]

    async def run() -> None:
        async with server_and_reader({**config("loop"), "chunk_timeout_s": 1.0},
                                     config("loop", window_chunks=2),
                                     chunk_delay_s=0.1) as (server, reader):
            server.ctx.grants.issue("late", blocks, 1, lease_s=100.0, grant=(tok := token()))
            reader.submit("late", tok, blocks, local)
            await wait_until_async(lambda: events, 10.0, message="the first unpack's launch")
            assert reader.ctx.pool.num_lent == 2
            assert not events[0].query()  # copied (on the CPU), but not "ended" yet
            assert await reader.reads.cancel({"late"}, 10.0) == {"late"}
            assert all(event.passed for event in events)  # the read waited for them
            stats = await reader.outcome("late")
            assert not stats.ok and "ReadCancelledError" in stats.error, stats
            assert reader.ctx.pool.num_lent == 0  # the window's two, discarded
            assert reader.ctx.pool.num_kept_nbytes == 0
            await wait_until_async(lambda: server.ctx.pool.num_lent == 0, 10.0,
                                   message="the server's read to end")

    asyncio.run(run())


@pytest.mark.parametrize(("setting", "device", "mode"), [
    ("auto", "cpu", "thread"), ("auto", "cuda", "loop"), ("thread", "cuda", "thread"),
    ("loop", "cpu", "loop"),
])
def test_auto_launches_on_the_loop_for_cuda_caches_only(setting: str, device: str,
                                                       mode: str) -> None:
    assert launch_mode(setting, torch.device(device)) == mode  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["fast", "LOOP", "", 1, None])
def test_a_bad_staged_launch_is_refused_naming_the_choices(value: object) -> None:
    with pytest.raises(ConfigError, match="staged_launch"):
        AgentConfig(staged_launch=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"one of 'auto', 'thread', 'loop', got 'fast'"):
        AgentConfig.from_options({"staged_launch": "fast"}, strict=False)
    assert AgentConfig.from_options({"staged_launch": "loop"}).staged_launch == "loop"
    assert AgentConfig().staged_launch == "auto"
