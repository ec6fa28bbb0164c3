"""The reading half against a hostile or broken server: typed errors, bounded memory.

Issue 29 item 6: D sized its staging buffers from the server's metadata before
checking it against its own cache, and kept the largest buffer for good. Now
``reading/server_meta.py`` refuses metadata that does not fit the reader's
cache before anything is sized on it, and the pools free what is larger than
a chunk. Two fuzzers:

* metadata: mutations of a real server's ``AgentMetadata``; each is refused
  with a ``ProtocolError`` or, if accepted, sizes no staging chunk beyond the
  reader's whole cache (``prepare``); and one refused over real UCX;
* messages: a scripted server (real handshake, real UCX) that answers every
  read with a random wrong answer; every read ends in a typed error, and the
  reader's staging buffers never exceed its cache.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ConfigError
from kvbridge.topology import build_read_plan
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks.staging import BufferPool
from kvbridge.transfer.errors import ProtocolError, TransferError
from kvbridge.transfer.local_kv import LocalKV, topology_of
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import serve_handshake
from kvbridge.transfer.reading.base import ReaderContext
from kvbridge.transfer.reading.link import PeerLink
from kvbridge.transfer.reading.server_meta import check_server_meta
from kvbridge.transfer.reading.strategy import prepare
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.transfer.inproc import (
    FAST,
    HOST,
    READER_ID,
    SERVER_ID,
    TOPOLOGY,
    caches,
    fake_server_link,
    identity,
)

LOCAL = LocalKV(TOPOLOGY, 0, 0, caches(seed=None))
GOOD = LOCAL.metadata(SERVER_ID, None)
CACHE_NBYTES = LOCAL.num_blocks * LOCAL.block_nbytes * len(LOCAL.layers)
BIG = st.integers(1, 1 << 31)
MUTATIONS = st.fixed_dictionaries({}, optional={
    "block_size": BIG, "head_dim": BIG, "num_heads": BIG, "num_kv_heads": BIG,
    "elem_nbytes": BIG, "num_layers": BIG, "num_model_layers": BIG,
    "tp_size": BIG, "tp_rank": st.integers(0, 1 << 31), "pp_size": BIG,
    "layout": st.sampled_from(["NHD", "HND", "XYZ", ""]), "is_mla": st.booleans(),
    "fused_kv": st.booleans(), "num_blocks": st.integers(0, 1 << 31),
    "layer_block_nbytes": st.lists(st.integers(0, 1 << 31), max_size=4),
})


def test_the_real_metadata_passes() -> None:
    check_server_meta(GOOD, LOCAL, "p")


@settings(max_examples=400, deadline=None)
@given(MUTATIONS)
def test_mutated_metadata_is_refused_typed_or_sizes_within_our_cache(changes: dict) -> None:
    meta = msgspec.structs.replace(GOOD, **changes)
    try:
        check_server_meta(meta, LOCAL, "p")
    except ProtocolError as exc:
        assert "cannot read from" in str(exc)
        return
    ctx = ReaderContext(identity(READER_ID), LOCAL, AgentConfig(), BufferPool(1),
                        ThreadPoolExecutor(1))
    try:
        plan = build_read_plan(TOPOLOGY, 0, 0, topology_of(meta), SERVER_ID)
    except (ConfigError, ValueError):
        return  # a plan the reader refuses (typed) is as good as a refusal here
    for item in plan.items:
        setup = prepare(meta, ctx, iter([1]), item, "grant-0000000000", [0, 1], [0, 1],
                        min(meta.block_size, 4), 0, b"")
        assert setup.request.chunk_blocks * setup.packed_fmt.block_nbytes <= max(
            CACHE_NBYTES, AgentConfig().chunk_nbytes)


def test_metadata_that_does_not_fit_is_refused_over_ucx_before_a_link() -> None:
    """A server claiming blocks of 2**30 tokens: the link is never opened."""
    huge = msgspec.structs.replace(GOOD, block_size=1 << 30)

    async def run() -> None:
        codec = wire.MessageCodec()

        async def session(conn: UcxConnection) -> None:
            await serve_handshake(conn, codec, identity(SERVER_ID), huge, max_nbytes=1 << 20,
                                  timeout_s=5.0)

        server, client = UcxWorker(), UcxWorker()
        executor = ThreadPoolExecutor(1)
        try:
            port = server.listen(HOST, 0, session, timeout_s=5.0)
            ctx = ReaderContext(identity(READER_ID), LOCAL, AgentConfig(**FAST), BufferPool(2),
                                executor)
            with pytest.raises(ProtocolError, match=r"block_size 1073741824 > the \d+ tokens"):
                await PeerLink.open(ctx, client, HOST, port, SERVER_ID, 0)
            assert client.num_connections == 0  # closed at once
        finally:
            await client.close()
            await server.close()
            executor.shutdown()

    asyncio.run(run())


def _wrong_answers(rng: random.Random) -> list[object]:
    """What a hostile server may say to ReadRequest ``x`` (callables of x)."""
    return [
        lambda x: wire.DataHeader(x, rng.randint(1, wire.MAX_CHUNKS), rng.randint(0, 1 << 48)),
        lambda x: wire.DataHeader(rng.randint(1, wire.MAX_XFER_ID), 1, 1 << 40),
        lambda x: wire.CopyGo(x, np.zeros(rng.randint(1, 64), np.uint64).tobytes(),
                              rng.randint(1, 1 << 31), rng.randint(0, 1 << 31),
                              rng.randint(1, 1 << 31), 5.0),
        lambda x: wire.Reject(rng.choice(list(wire.RejectReason)), "no", x),
        lambda x: wire.Reject(rng.choice(list(wire.RejectReason)), "bye", 0),
        lambda x: wire.LeaseRenewed("grant-0000000000", 1.0, x),
        lambda x: wire.Pong(rng.randint(0, 1 << 31)),
        lambda x: rng.randbytes(rng.randint(0, 300)),  # not a message at all
    ]


@pytest.mark.parametrize("seed", range(24))
def test_wrong_answers_to_reads_fail_typed_and_allocate_within_our_cache(seed: int) -> None:
    rng = random.Random(seed)
    answers = _wrong_answers(rng)

    async def answer(conn: UcxConnection, codec: wire.MessageCodec, msg: wire.Message) -> None:
        if isinstance(msg, wire.ReadRequest):
            reply = rng.choice(answers)(msg.xfer_id)
            payload = reply if isinstance(reply, bytes) else codec.encode(reply)
            await conn.send_frame(payload, timeout_s=5.0)

    async def run() -> None:
        # short reply deadline: an answer the reader waits past is a typed timeout too
        async with fake_server_link(answer, {"reply_timeout_s": 1.0}) as (link, item):
            for _ in range(3):
                if not link.alive:
                    break
                with pytest.raises((TransferError, ConfigError)):
                    await link.read(item, "grant-0000000000", [1, 2, 3], [1, 2, 3], 12)
                pool = link._ctx.pool  # the reader's staging pool  # noqa: SLF001
                assert pool.num_kept_nbytes + pool.num_lent * CACHE_NBYTES <= CACHE_NBYTES

    asyncio.run(run())


def test_a_buffer_larger_than_a_chunk_is_freed_not_kept() -> None:
    """One read of a peer with huge blocks must not pin that memory for good."""

    async def run() -> None:
        pool = BufferPool(2, keep_nbytes=1 << 16)
        small = (await pool.acquire(1 << 16, timeout_s=1.0))[0]
        big = (await pool.acquire(1 << 24, timeout_s=1.0))[0]
        assert big.nbytes == 1 << 24
        pool.release(big)
        pool.release(small)
        assert pool.num_kept_nbytes == 1 << 16 and pool.num_lent == 0

    asyncio.run(run())
