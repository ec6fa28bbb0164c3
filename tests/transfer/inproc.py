"""Both halves of the transfer protocol in this process, on one event loop (test helper).

Two ``UcxWorker``s on loopback, as ucxx's own tests pair them: a server worker
whose listener runs ``server.serve_connection`` (or a scripted fake server), and
a reader worker under a ``read_job.Reads`` or a bare ``PeerLink``. No child
process, no agent thread: a test drives everything from ``asyncio.run`` and can
reach both sides' tables between two awaits. The server's grant table runs on a
``ManualClock``, so leases end when a test says so.

Used by ``test_transport_inproc.py`` and ``test_link_inproc.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbridge.topology import EngineTopology, KVLayout, RemoteRead, build_read_plan
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks.staging import BufferPool
from kvbridge.transfer.chunk_trace import ChunkTrace
from kvbridge.transfer.clock import ManualClock
from kvbridge.transfer.local_kv import LocalKV, topology_info, topology_of
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import Identity, recv_msg, send_msg, serve_handshake
from kvbridge.transfer.protocol.host import ProbeCell
from kvbridge.transfer.protocol.security import CompatInfo, compat_hash
from kvbridge.transfer.reading.base import ReaderContext
from kvbridge.transfer.reading.copier import Copier
from kvbridge.transfer.reading.jobs import ReadJob, ReadStats
from kvbridge.transfer.reading.link import PeerLink
from kvbridge.transfer.reading.reads import Reads
from kvbridge.transfer.serving.context import ServerContext
from kvbridge.transfer.serving.grants import GrantTable
from kvbridge.transfer.serving.session import serve_connection
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.slow_serving import slow_serving
from tests.waiting import wait_until_async

HOST = "127.0.0.1"
SERVER_ID, READER_ID = "p-inproc", "d-inproc"
BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 4, 2, 8, 2, 32
BLOCK_NBYTES = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2  # K and V of one layer, bfloat16
TOPOLOGY = EngineTopology(
    tp_size=1, pp_size=1, block_size=BLOCK_SIZE, num_kv_heads=HEADS, is_mla=False,
    layout=KVLayout.NHD, num_layers=LAYERS,
)
COMPAT = CompatInfo("inproc", "bfloat16", num_kv_heads=HEADS, head_dim=HEAD_DIM,
                    num_layers=LAYERS, layout=KVLayout.NHD, block_size=BLOCK_SIZE, is_mla=False)
#: Short deadlines (a broken test fails in seconds) and small chunks (one block
#: each, so a few blocks make a read of several chunks).
FAST = dict(connect_timeout_s=5.0, handshake_timeout_s=5.0, reply_timeout_s=5.0,
            chunk_timeout_s=5.0, read_timeout_s=20.0, heartbeat_s=5.0,
            chunk_nbytes=BLOCK_NBYTES * LAYERS, window_chunks=1, local_copy=False)


def caches(seed: int | None, topology: EngineTopology = TOPOLOGY) -> list[torch.Tensor]:
    """One ``[2, blocks, block_size, heads, head_dim]`` cache per layer (NHD; HND swaps
    the middle two) for ``topology`` (zeros: ``None``)."""
    shape: tuple[int, ...] = (2, NUM_BLOCKS, topology.block_size, HEADS, HEAD_DIM)
    if topology.layout == KVLayout.HND:
        shape = (2, NUM_BLOCKS, HEADS, topology.block_size, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def same_blocks(src: LocalKV, src_ids: list[int], dst: LocalKV, dst_ids: list[int]) -> bool:
    """Whether every layer's K and V of ``src_ids`` equal those of ``dst_ids``."""
    return all(torch.equal(a[:, src_ids], b[:, dst_ids]) for a, b in zip(src.layers, dst.layers,
                                                                          strict=True))


def identity(engine_id: str) -> Identity:
    return Identity(engine_id, 0, compat_hash(COMPAT), None, topology_info(TOPOLOGY))


@dataclass
class Server:
    """A real server session behind a listener; its grant table on a manual clock."""

    worker: UcxWorker
    ctx: ServerContext
    clock: ManualClock
    port: int


@dataclass
class Reader:
    """The reading half: jobs (``Reads``) over links it opens to the server."""

    worker: UcxWorker
    ctx: ReaderContext
    reads: Reads
    port: int
    outcomes: dict[str, ReadStats] = field(default_factory=dict)
    failed: dict[str, set[int]] = field(default_factory=dict)

    def submit(self, request_id: str, grant: str, remote_ids: list[int],
               local_ids: list[int], num_tokens: int | None = None) -> None:
        """Read ``num_tokens`` (default: all) of blocks ``remote_ids`` into ``local_ids``
        (returns at once)."""
        if num_tokens is None:
            num_tokens = BLOCK_SIZE * len(remote_ids)
        self.reads.submit(ReadJob(request_id, SERVER_ID, HOST, self.port, tuple(remote_ids),
                                  tuple(local_ids), grant, num_tokens, time.monotonic()))

    async def outcome(self, request_id: str, timeout_s: float = 15.0) -> ReadStats:
        """Wait for the read's outcome (``ok`` and ``error`` in the stats)."""

        def ended() -> bool:
            self.reads.outcomes.take_finished()
            self.failed.update(self.reads.outcomes.take_failed())
            self.outcomes.update((s.request_id, s) for s in self.reads.outcomes.take_stats())
            return request_id in self.outcomes

        await wait_until_async(ended, timeout_s, message=f"read {request_id} to end")
        return self.outcomes[request_id]


@asynccontextmanager
async def server_and_reader(
    server_config: dict[str, Any] | None = None, reader_config: dict[str, Any] | None = None,
    *, chunk_delay_s: float = 0.0, reader_topology: EngineTopology = TOPOLOGY,
    trace: ChunkTrace | None = None, device: str = "cpu",
) -> AsyncIterator[tuple[Server, Reader]]:
    """A server session and a reader of it, closed on exit.

    ``chunk_delay_s``: the server waits this long before each data chunk
    (``tests/slow_serving.py``; every server of this process while inside).
    ``reader_topology``: the reader's caches (layout, block size; the rest as
    ``TOPOLOGY``). ``trace``: both halves' chunk trace (``chunk_trace.py``).
    ``device``: where both sides' caches and staging buffers are (``"cuda"``: a
    GPU run; every read then stages).
    """
    with slow_serving(chunk_delay_s) if chunk_delay_s else contextlib.nullcontext():
        async with _server_and_reader(server_config, reader_config, reader_topology,
                                      trace, torch.device(device)) as pair:
            yield pair


@asynccontextmanager
async def _server_and_reader(
    server_config: dict[str, Any] | None, reader_config: dict[str, Any] | None,
    reader_topology: EngineTopology, trace: ChunkTrace | None, device: torch.device,
) -> AsyncIterator[tuple[Server, Reader]]:
    executor = ThreadPoolExecutor(1, thread_name_prefix="inproc-copy")
    s_cfg = AgentConfig(**{**FAST, **(server_config or {})})
    r_cfg = AgentConfig(**{**FAST, **(reader_config or {})})
    clock = ManualClock(1000.0)
    grants = GrantTable(clock, s_cfg.lease_s, 10 * s_cfg.lease_s)
    s_local = LocalKV(TOPOLOGY, 0, 0, [t.to(device) for t in caches(seed=7)])
    s_ctx = ServerContext(identity(SERVER_ID), s_local, grants, s_cfg, BufferPool(4, device),
                          executor, clock, trace=trace)
    copier = None
    if s_cfg.local_copy and r_cfg.local_copy:  # same-host copies (no grant board)
        s_ctx.probe = ProbeCell()
        s_ctx.host = s_ctx.probe.host_info(None)
        copier = Copier(r_cfg.copy_threads)
    gpu_memory = device.type == "cuda"
    s_worker, r_worker = UcxWorker(gpu_memory=gpu_memory), UcxWorker(gpu_memory=gpu_memory)
    reads: Reads | None = None
    try:
        port = s_worker.listen(HOST, 0, lambda conn: serve_connection(s_ctx, conn), timeout_s=5.0)
        r_caches = [t.to(device) for t in caches(None, reader_topology)]
        r_local = LocalKV(reader_topology, 0, 0, r_caches)
        r_ctx = ReaderContext(identity(READER_ID), r_local, r_cfg,
                              BufferPool(r_cfg.num_read_slots * r_cfg.window_chunks, device),
                              executor, copier=copier, trace=trace)
        reads = Reads(r_ctx, r_worker, f"{READER_ID}:0")
        yield Server(s_worker, s_ctx, clock, port), Reader(r_worker, r_ctx, reads, port)
    finally:
        if reads is not None:
            await reads.close()
        await r_worker.close()
        await s_worker.close()
        if copier is not None:
            copier.close()
        executor.shutdown(wait=True)


Script = Callable[[UcxConnection, wire.MessageCodec, wire.Message], Awaitable[None]]


def _scripted_session(answer: Script, s_local: LocalKV,
                      codec: wire.MessageCodec) -> Callable[[UcxConnection], Awaitable[None]]:
    """A server session that handshakes for real, answers pings, and ``answer``s the rest."""

    async def session(conn: UcxConnection) -> None:
        hello = await serve_handshake(conn, codec, identity(SERVER_ID),
                                      s_local.metadata(SERVER_ID, None), max_nbytes=1 << 20,
                                      timeout_s=5.0)
        assert hello is not None
        while not conn.closed:
            msg = await recv_msg(conn, codec, 1 << 20, 30.0)
            if isinstance(msg, wire.Ping):
                await send_msg(conn, codec, wire.Pong(msg.seq), 5.0)
            else:
                await answer(conn, codec, msg)

    return session


@asynccontextmanager
async def fake_server_link(
    answer: Script, reader_config: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[PeerLink, RemoteRead]]:
    """A ``PeerLink`` to a scripted server: a real handshake, then ``answer`` per message.

    Yields the link and the one item of its read plan (all heads and layers).
    """
    executor = ThreadPoolExecutor(1, thread_name_prefix="inproc-copy")
    s_local = LocalKV(TOPOLOGY, 0, 0, caches(seed=7))
    s_worker, r_worker = UcxWorker(), UcxWorker()
    link: PeerLink | None = None
    try:
        port = s_worker.listen(HOST, 0, _scripted_session(answer, s_local, wire.MessageCodec()),
                               timeout_s=5.0)
        r_cfg = AgentConfig(**{**FAST, "direct_reads": False, **(reader_config or {})})
        r_ctx = ReaderContext(identity(READER_ID), LocalKV(TOPOLOGY, 0, 0, caches(seed=None)),
                              r_cfg, BufferPool(4), executor)
        link = await PeerLink.open(r_ctx, r_worker, HOST, port, SERVER_ID, 0)
        plan = build_read_plan(TOPOLOGY, 0, 0, topology_of(link.meta), SERVER_ID)
        yield link, plan.items[0]
    finally:
        if link is not None:
            await link.close()
        await r_worker.close()
        await s_worker.close()
        executor.shutdown(wait=True)


@asynccontextmanager
async def fake_server_reader(
    answer: Script, reader_config: dict[str, Any] | None = None,
) -> AsyncIterator[Reader]:
    """A reader (``Reads``, jobs and all) of a scripted server (see ``fake_server_link``)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="inproc-copy")
    s_local = LocalKV(TOPOLOGY, 0, 0, caches(seed=7))
    s_worker, r_worker = UcxWorker(), UcxWorker()
    reads: Reads | None = None
    try:
        port = s_worker.listen(HOST, 0, _scripted_session(answer, s_local, wire.MessageCodec()),
                               timeout_s=5.0)
        r_cfg = AgentConfig(**{**FAST, **(reader_config or {})})
        r_ctx = ReaderContext(identity(READER_ID), LocalKV(TOPOLOGY, 0, 0, caches(seed=None)),
                              r_cfg, BufferPool(r_cfg.num_read_slots * r_cfg.window_chunks),
                              executor)
        reads = Reads(r_ctx, r_worker, f"{READER_ID}:0")
        yield Reader(r_worker, r_ctx, reads, port)
    finally:
        if reads is not None:
            await reads.close()
        await r_worker.close()
        await s_worker.close()
        executor.shutdown(wait=True)
