"""``transfer/ucx/`` (worker, connection) between two UCX workers of this process.

No child process: a listener, a connection to it, frames and data both ways, a
peer that went away, deadlines, and the mapping of ucxx's exceptions onto
``transfer.errors``. Real UCX on loopback, as everywhere in ``tests/transfer``.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import torch
import ucxx.exceptions as ucx_exc

from kvbridge.transfer.errors import (
    PeerClosedError,
    PeerTimeoutError,
    PeerUnreachableError,
    ProtocolError,
    TransferError,
)
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import SAFE_TLS, UcxWorker, _map_ucx_error
from tests.transfer.inproc import HOST
from tests.waiting import wait_until_async

MAX_FRAME = 4096


Connected = tuple[UcxConnection, asyncio.Queue[UcxConnection], UcxWorker]


@asynccontextmanager
async def connected() -> AsyncIterator[Connected]:
    """A connection from a client worker to a listening worker, the accepted ends, the
    client worker."""
    accepted: asyncio.Queue[UcxConnection] = asyncio.Queue()
    hold = asyncio.Event()

    async def on_connect(conn: UcxConnection) -> None:
        await accepted.put(conn)
        await hold.wait()  # the connection is the test's until the worker closes

    server, client = UcxWorker(), UcxWorker()
    try:
        port = server.listen(HOST, 0, on_connect, timeout_s=5.0)
        conn = await client.connect(HOST, port, timeout_s=5.0)
        try:
            yield conn, accepted, client
        finally:
            conn.abort()
    finally:
        await client.close()
        await server.close()


def test_frames_and_data_go_both_ways() -> None:
    async def run() -> None:
        async with connected() as (conn, accepted, _):
            far = await asyncio.wait_for(accepted.get(), 5.0)
            assert far.remote_id == conn.local_id and conn.remote_id == far.local_id
            await conn.send_frame(b"hello", timeout_s=5.0)
            assert await far.recv_frame(max_nbytes=MAX_FRAME, timeout_s=5.0) == b"hello"
            await far.send_frame(b"", timeout_s=5.0)  # an empty frame is a frame
            assert await conn.recv_frame(max_nbytes=MAX_FRAME, timeout_s=5.0) == b""
            # a data channel: exactly the posted size, bytes intact
            data = np.random.default_rng(3).integers(0, 256, 100_000, dtype=np.uint8)
            into = np.zeros_like(data)
            arrived = far.post_recv(into, 7)
            await conn.send(data, 7, timeout_s=5.0)
            await far.wait(arrived, timeout_s=5.0, what="chunk")
            assert np.array_equal(into, data)
            assert conn.outgoing_tag(7) == far.incoming_tag(7)

    asyncio.run(run())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_data_in_tensors(device: str) -> None:
    """Staging buffers of CUDA caches are uint8 tensors on the GPU (``blocks/staging.py``):
    UCX takes a tensor's memory as it is, whatever the two ends' memory types."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU here (scripts/gpu_check.sh runs the GPU path)")

    async def run() -> None:
        async with connected() as (conn, accepted, _):
            far = await asyncio.wait_for(accepted.get(), 5.0)
            data = torch.randint(0, 256, (300_000,), dtype=torch.uint8).to(device)
            into = torch.zeros(400_000, dtype=torch.uint8, device=device)
            arrived = far.post_recv(into[: data.numel()], 5)
            await conn.send(data, 5, timeout_s=5.0)
            await far.wait(arrived, timeout_s=5.0, what="chunk")
            assert torch.equal(into[: data.numel()], data)
            assert not into[data.numel() :].any()
            host = np.zeros(300_000, dtype=np.uint8)  # a tensor to a numpy array
            arrived = far.post_recv(host, 6)
            await conn.send(data, 6, timeout_s=5.0)
            await far.wait(arrived, timeout_s=5.0, what="chunk")
            assert np.array_equal(host, data.cpu().numpy())

    asyncio.run(run())


def test_a_frame_larger_than_allowed_is_a_protocol_error() -> None:
    async def run() -> None:
        async with connected() as (conn, accepted, _):
            far = await asyncio.wait_for(accepted.get(), 5.0)
            await conn.send_frame(b"x" * 100, timeout_s=5.0)
            with pytest.raises(ProtocolError, match="larger than the posted buffer"):
                await far.recv_frame(max_nbytes=16, timeout_s=5.0)

    asyncio.run(run())


def test_a_data_message_of_another_size_fails_its_receive() -> None:
    async def run() -> None:
        async with connected() as (conn, accepted, _):
            far = await asyncio.wait_for(accepted.get(), 5.0)
            arrived = far.post_recv(np.zeros(64, dtype=np.uint8), 3)
            await conn.send(np.ones(32, dtype=np.uint8), 3, timeout_s=5.0)
            with pytest.raises(ProtocolError, match="32 bytes arrived, expected 64"):
                await far.wait(arrived, timeout_s=5.0, what="chunk")

    asyncio.run(run())


def test_a_silent_peer_times_out_and_the_connection_is_aborted() -> None:
    async def run() -> None:
        async with connected() as (conn, _, worker):
            with pytest.raises(PeerTimeoutError, match="no completion in 0.2s"):
                await conn.recv_frame(max_nbytes=MAX_FRAME, timeout_s=0.2)
            assert conn.closed  # its receive may still land later: never reused
            with pytest.raises(PeerClosedError):
                await conn.send_frame(b"late", timeout_s=1.0)
            # the abandoned receive was completed, not left posted for ever
            await wait_until_async(lambda: worker.num_requests == 0, 10.0,
                                   message="the receive to end")

    asyncio.run(run())


def test_a_peer_that_aborted_goes_silent_and_local_use_after_abort_is_refused() -> None:
    async def run() -> None:
        async with connected() as (conn, accepted, _):
            far = await asyncio.wait_for(accepted.get(), 5.0)
            far.abort()
            far.abort()  # idempotent
            with pytest.raises(PeerClosedError, match="closed connection"):
                far.post_frame(b"after abort")
            # UCX peer error handling is off: only our deadline notices the peer left
            with pytest.raises(PeerTimeoutError):
                await conn.recv_frame(max_nbytes=MAX_FRAME, timeout_s=0.3)
            await conn.close(b"bye")  # idempotent after the abort its timeout did
            assert conn.closed

    asyncio.run(run())


def test_a_connection_counts_and_releases_its_id() -> None:
    async def run() -> None:
        async with connected() as (conn, accepted, worker):
            far = await asyncio.wait_for(accepted.get(), 5.0)
            assert worker.num_connections == 1
            conn.abort()
            assert worker.num_connections == 0
            far.abort()

    asyncio.run(run())


def test_connecting_where_nobody_listens_fails_typed_within_the_deadline() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]

    async def run() -> None:
        worker = UcxWorker()
        try:
            with pytest.raises((PeerTimeoutError, PeerUnreachableError)):
                await asyncio.wait_for(worker.connect(HOST, port, timeout_s=0.5), 5.0)
            await wait_until_async(lambda: worker.num_connections == 0, 10.0,
                                   message="the id to be released")
        finally:
            await worker.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("environ", "kwargs", "tls", "scheme"),
    [
        ({}, {}, SAFE_TLS, "get_zcopy"),
        ({}, {"gpu_memory": True}, SAFE_TLS, "auto"),  # CUDA caches: UCX's own choice
        ({"UCX_TLS": "tcp,self", "UCX_RNDV_SCHEME": "put_zcopy"}, {}, "tcp,self", "put_zcopy"),
        ({"UCX_RNDV_SCHEME": "put_zcopy"}, {"gpu_memory": True}, SAFE_TLS, "put_zcopy"),
        ({"UCX_TLS": "tcp,self"}, {"config": {"TLS": "tcp,sm,self"}}, "tcp,sm,self", "get_zcopy"),
    ],
    ids=["defaults", "gpu", "environment", "environment-gpu", "config-over-environment"],
)
def test_transports_and_rendezvous_scheme(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], kwargs: dict[str, object],
    tls: str, scheme: str,
) -> None:
    """kvbridge's defaults, unless the environment (or, above it, the caller) names them."""
    for name in ("UCX_TLS", "UCX_RNDV_SCHEME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)

    async def run() -> None:
        worker = UcxWorker(**kwargs)  # type: ignore[arg-type]
        try:
            config = worker._context.config
            assert (config["TLS"], config["RNDV_SCHEME"]) == (tls, scheme)
        finally:
            await worker.close()

    asyncio.run(run())


@pytest.mark.parametrize(("error", "kind", "text"), [
    (ucx_exc.UCXCanceledError("request canceled"), PeerClosedError, "canceled"),
    (ucx_exc.UCXMessageTruncatedError("too long"), ProtocolError, "larger than the posted"),
    (ucx_exc.UCXConnectionResetError("reset"), PeerClosedError, "reset"),
    (ucx_exc.UCXUnreachableError("no route"), PeerUnreachableError, "no route"),
    (ucx_exc.UCXTimedOutError("slow"), PeerTimeoutError, "slow"),
    (ucx_exc.UCXError("other"), TransferError, "UCXXError: other"),
])
def test_ucxx_exceptions_map_by_type(error: Exception, kind: type[TransferError],
                                     text: str) -> None:
    mapped = _map_ucx_error(error, "recv from peer")
    assert type(mapped) is kind
    assert "recv from peer" in str(mapped) and text in str(mapped)


def test_an_exception_is_not_mapped_by_its_name() -> None:
    class CancelledTruncatedLookalike(Exception):
        """Not a ucxx exception, whatever its name says."""

    mapped = _map_ucx_error(CancelledTruncatedLookalike("?"), "send")
    assert type(mapped) is TransferError


def other_address() -> str:
    """An IPv4 address of this host other than loopback (UCX's connection manager needs
    an address an interface has: 127.0.0.2 reaches loopback but has no interface)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields[1] != "lo":
            return fields[3].split("/")[0]
    raise AssertionError(f"this host has no IPv4 address but loopback:\n{out}")


def test_a_listener_binds_the_address_it_is_given_not_every_interface() -> None:
    """A listener bound to loopback is not reached at the host's other address, nor one
    bound to that address at loopback; "0.0.0.0" (the explicit opt-in) is reached at both."""
    other = other_address()

    async def reachable(bind: str, at: str) -> bool:
        async def on_connect(conn: UcxConnection) -> None:
            conn.abort()

        server, client = UcxWorker(), UcxWorker()
        try:
            port = server.listen(bind, 0, on_connect, timeout_s=5.0)
            try:
                conn = await client.connect(at, port, timeout_s=2.0)
            except (PeerUnreachableError, PeerTimeoutError):
                return False
            conn.abort()
            return True
        finally:
            await client.close()
            await server.close()

    async def run() -> None:
        assert await reachable(other, other)
        assert not await reachable(HOST, other)
        assert not await reachable(other, HOST)
        assert await reachable("0.0.0.0", other)
        assert await reachable("0.0.0.0", HOST)

    asyncio.run(run())


def test_listening_on_an_address_not_of_this_host_fails_typed() -> None:
    async def run() -> None:
        worker = UcxWorker()
        try:
            with pytest.raises(PeerUnreachableError, match="198.51.100.1"):
                worker.listen("198.51.100.1", 0, lambda conn: asyncio.sleep(0), timeout_s=1.0)
        finally:
            await worker.close()

    asyncio.run(run())


def test_connection_keys_are_64_random_bits_not_drawn_from_random() -> None:
    """vLLM seeds ``random`` with 0: keys must not follow it (tests/transfer/test_tag_injection.py
    shows what a predictable key allowed)."""
    import random

    async def keys() -> list[int]:
        random.seed(0)
        async with connected() as (conn, accepted, _):
            far = await asyncio.wait_for(accepted.get(), 5.0)
            return [conn.local_id, far.local_id]

    first, second = asyncio.run(keys()), asyncio.run(keys())
    assert len(set(first + second)) == 4
    assert all(key >> 36 for key in first + second)  # an id in the top 28 bits
    assert all(key & ((1 << 36) - 1) for key in first + second)  # and a mask below
