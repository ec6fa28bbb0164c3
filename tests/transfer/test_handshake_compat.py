"""A handshake between caches that differ: the reader's error names the fields, both values.

Real UCX on loopback, both handshake halves in this process. A KV cache dtype
that differs between P and D (``--kv-cache-dtype fp8`` on one only) must be
refused at the handshake with a message a user can act on, not "compat hash
a1b2 != c3d4".
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvbridge.transfer.errors import RejectedError
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import (
    Identity,
    compat_reason,
    reader_handshake,
    serve_handshake,
)
from kvbridge.transfer.protocol.security import CompatInfo, compat_hash
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.transfer.inproc import COMPAT, HOST, TOPOLOGY, caches

CODEC = wire.MessageCodec()


def identity(engine_id: str, compat: CompatInfo | None) -> Identity:
    info = compat or COMPAT
    return Identity(engine_id, 0, compat_hash(info), None, None, compat)


async def handshake(server: Identity, reader: Identity) -> wire.AgentMetadata:
    local = LocalKV(TOPOLOGY, 0, 0, caches(seed=1))

    async def session(conn: UcxConnection) -> None:
        try:
            await serve_handshake(conn, CODEC, server, local.metadata(server.engine_id, None),
                                  max_nbytes=1 << 20, timeout_s=5.0)
        finally:
            conn.abort()

    s_worker, r_worker = UcxWorker(), UcxWorker()
    try:
        port = s_worker.listen(HOST, 0, session, timeout_s=5.0)
        conn = await r_worker.connect("127.0.0.1", port, timeout_s=5.0)
        try:
            return await reader_handshake(conn, CODEC, reader, server.engine_id, 0,
                                          max_nbytes=1 << 20, timeout_s=5.0)
        finally:
            conn.abort()
    finally:
        await r_worker.close()
        await s_worker.close()


def test_a_dtype_mismatch_is_refused_naming_both_dtypes() -> None:
    fp8 = dataclasses.replace(COMPAT, dtype="float8_e4m3fn")
    with pytest.raises(RejectedError) as caught:
        asyncio.run(handshake(identity("p", fp8), identity("d", COMPAT)))
    assert caught.value.reason == wire.RejectReason.COMPAT
    message = str(caught.value)
    assert "dtype: local 'bfloat16' != remote 'float8_e4m3fn'" in message, message
    assert "--kv-cache-dtype" in message and "compat hash" not in message


def test_every_differing_field_is_named_and_no_other() -> None:
    mla = dataclasses.replace(COMPAT, is_mla=True, num_kv_heads=1, head_dim=576)
    with pytest.raises(RejectedError) as caught:
        asyncio.run(handshake(identity("p", mla), identity("d", COMPAT)))
    message = str(caught.value)
    for line in ("num_kv_heads: local 2 != remote 1", "head_dim: local 8 != remote 576",
                 "is_mla: local False != remote True"):
        assert line in message, message
    assert "dtype:" not in message and "model:" not in message


def test_equal_caches_still_pair() -> None:
    meta = asyncio.run(handshake(identity("p", COMPAT), identity("d", COMPAT)))
    assert meta.engine_id == "p"


def test_a_server_that_does_not_describe_its_cache_keeps_the_hash_message() -> None:
    with pytest.raises(RejectedError) as caught:  # an older server: no description
        asyncio.run(handshake(identity("p", None), identity("d", dataclasses.replace(
            COMPAT, dtype="float8_e4m3fn"))))
    assert "compat hash" in str(caught.value)
    assert compat_reason(COMPAT, "compat hash 1 != 2; server cache {not json") .startswith(
        "compat hash 1 != 2 (server cache description unreadable")
