"""Same-host copies (``transfer/reading/same_host.py``) against a real second process.

A spawned child holds a buffer and a ``ProbeCell``; this process copies out of
it with ``process_vm_readv`` through ``CopySource`` and ``Copier``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import pytest
import torch

from kvbridge.transfer.errors import PeerClosedError, ProtocolError
from kvbridge.transfer.host_memory import kv_cache_zeros, shared_region
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.grant_board import GrantBoard
from kvbridge.transfer.protocol.host import ENV_SWITCH, ProbeCell, allowed
from kvbridge.transfer.reading.copier import Copier
from kvbridge.transfer.reading.copy_source import CopySource

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process_vm_readv is Linux's")

POOL_NBYTES = 24 << 20


def _holder(conn: Connection) -> None:
    probe = ProbeCell()
    pool = np.random.default_rng(7).integers(0, 256, POOL_NBYTES, dtype=np.uint8)
    conn.send((probe.host_info(), pool.ctypes.data))
    conn.recv()  # hold until told to go
    del pool


@dataclass
class Holder:
    info: wire.HostInfo
    base: int
    conn: Connection
    proc: mp.process.BaseProcess

    @property
    def pool(self) -> np.ndarray:
        return np.random.default_rng(7).integers(0, 256, POOL_NBYTES, dtype=np.uint8)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("go")
        self.proc.join(10)


@pytest.fixture
def holder() -> Iterator[Holder]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(30), "holder did not start"
    info, base = parent.recv()
    h = Holder(info, base, parent, proc)
    yield h
    h.stop()


def ranges(base: int, offsets: list[int], nbytes: int) -> np.ndarray:
    return np.array([[base + o, nbytes] for o in offsets], dtype=np.uint64)


def test_host_info_names_this_process() -> None:
    cell = ProbeCell()
    info = cell.host_info()
    assert info is not None and info.pid > 0 and len(info.probe) == 16
    # a copy of our own probe from ourselves checks out
    assert CopySource.open(info, "self") is not None


def test_copy_source_copies_scattered_ranges_exactly(holder: Holder) -> None:
    source = CopySource.open(holder.info, "holder")
    assert source is not None and source.pid == holder.info.pid
    offsets = [5 * 4096, 3, 17 << 20, 1 << 20]
    out = np.zeros(4 * 10_000, dtype=np.uint8)
    local = ranges(out.ctypes.data, [0, 10_000, 20_000, 30_000], 10_000)
    source.readv(local, ranges(holder.base, offsets, 10_000))
    pool = holder.pool
    want = np.concatenate([pool[o : o + 10_000] for o in offsets])
    assert np.array_equal(out, want)


def test_copier_splits_a_large_copy_over_threads(holder: Holder) -> None:
    source = CopySource.open(holder.info, "holder")
    assert source is not None
    run = 32 << 10
    order = np.random.default_rng(1).permutation(POOL_NBYTES // run)[:512]  # 16 MiB scattered
    out = np.zeros(order.size * run, dtype=np.uint8)
    local = ranges(out.ctypes.data, [i * run for i in range(order.size)], run)
    remote = ranges(holder.base, [int(b) * run for b in order], run)
    copier = Copier(3)
    try:
        asyncio.run(copier.copy(source, local, remote))
        assert copier._pool is not None  # it did split (16 MiB >= 2 * MIN_PART_NBYTES)
        # again, with a helper that takes long to start: this thread copies the rest
        out[:] = 0
        copier._pool.submit(time.sleep, 0.05)
        asyncio.run(copier.copy(source, local, remote))
    finally:
        copier.close()
    pool = holder.pool
    want = np.concatenate([pool[int(b) * run : (int(b) + 1) * run] for b in order])
    assert np.array_equal(out, want)


def test_copy_from_unmapped_memory_is_a_protocol_error(holder: Holder) -> None:
    source = CopySource.open(holder.info, "holder")
    assert source is not None
    out = np.zeros(128, dtype=np.uint8)
    with pytest.raises(ProtocolError, match="does not have"):
        source.readv(ranges(out.ctypes.data, [0], 64), ranges(4096, [0], 64))
    # the first range copies, the second faults: a short copy is an error too
    remote = np.concatenate([ranges(holder.base, [0], 64), ranges(4096, [0], 64)])
    with pytest.raises(ProtocolError, match="moved 64 of 128"):
        source.readv(ranges(out.ctypes.data, [0], 128), remote)
    assert np.array_equal(out[:64], holder.pool[:64])


def test_copy_from_a_process_that_exited_fails_typed(holder: Holder) -> None:
    source = CopySource.open(holder.info, "holder")
    assert source is not None
    holder.stop()
    out = np.zeros(64, dtype=np.uint8)
    with pytest.raises(PeerClosedError):
        source.readv(ranges(out.ctypes.data, [0], 64), ranges(holder.base, [0], 64))
    with pytest.raises(PeerClosedError):
        source.check()
    assert CopySource.open(holder.info, "gone") is None


@pytest.mark.parametrize("change", ["probe", "boot_id", "pid_namespace", "probe_address"])
def test_copy_source_refuses_what_it_cannot_verify(holder: Holder, change: str) -> None:
    value = {
        "probe": bytes(16),
        "boot_id": "00000000-0000-0000-0000-000000000000",
        "pid_namespace": "0:1",
        "probe_address": 4096,
    }[change]
    info = msgspec.structs.replace(holder.info, **{change: value})
    assert CopySource.open(info, "liar") is None
    assert CopySource.open(None, "nobody") is None


@pytest.mark.parametrize(
    ("enabled", "env", "expected"),
    [
        (True, {}, True),
        (False, {}, False),
        (True, {"KVBRIDGE_LOCAL_COPY": "0"}, False),
        (True, {"KVBRIDGE_LOCAL_COPY": "off"}, False),
        (True, {"UCX_TLS": "tcp"}, False),
        (True, {"UCX_TLS": "tcp,sm"}, True),
        (True, {"UCX_TLS": "all"}, True),
        (True, {"UCX_TLS": "tcp,cma,self"}, True),
        (True, {"UCX_TLS": "^cma"}, False),
        (True, {"UCX_TLS": "^ib"}, True),
    ],
)
def test_allowed_follows_config_and_environment(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, env: dict[str, str], expected: bool
) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert allowed(enabled) is expected


def _board_holder(conn: Connection) -> None:
    probe, board = ProbeCell(), GrantBoard(lambda: 5, 64)
    decoy = GrantBoard(lambda: 5, 64)  # the same size, another tag
    board.publish("engine-token-0000000", [1, 2, 3], 30.0, b"prompt")
    conn.send((probe.host_info(board), decoy.fd))
    while (cmd := conn.recv()) != "go":
        if cmd == "withdraw":
            board.withdraw("engine-token-0000000")
        conn.send("ok")


@pytest.mark.parametrize("fd", ["board", "none", "decoy", "not a board"])
def test_a_reader_reads_the_board_of_another_process_and_sees_a_withdrawal(fd: str) -> None:
    """Through a map of the board's memfd when the server offers it, else (no fd, or an
    fd that is not the board: another board's tag, another file's size) by copying
    the grant's window per look; the same answers either way."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_board_holder, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(30), "board holder did not start"
        info, decoy_fd = parent.recv()
        assert info.board_address and info.board_slots == 64 and info.board_fd >= 0
        board_fd = {"board": info.board_fd, "none": -1, "decoy": decoy_fd, "not a board": 1}[fd]
        source = CopySource.open(msgspec.structs.replace(info, board_fd=board_fd), "holder")
        assert source is not None and source.board_mapped is (fd == "board")
        spot = source.find_grant("engine-token-0000000", [3, 1], b"prompt", 5)
        assert spot is not None and source.check(spot)
        assert source.find_grant("engine-token-0000000", [3, 4], b"prompt", 5) is None
        assert source.find_grant("engine-token-0000000", [3], b"another prompt", 5) is None
        assert source.find_grant("other-token-00000000", [3], b"prompt", 5) is None
        parent.send("withdraw")
        assert parent.recv() == "ok"
        assert not source.check(spot)  # a copy made across the withdrawal is dropped
        assert source.find_grant("engine-token-0000000", [3], b"prompt", 5) is None
    finally:
        parent.send("go")
        proc.join(10)


def test_a_server_without_a_board_is_never_found_on_one(holder: Holder) -> None:
    source = CopySource.open(holder.info, "holder")
    assert source is not None and holder.info.board_address == 0
    assert source.find_grant("any-token-0000000000", [1], b"", 5) is None


def test_a_shared_copy_that_faults_stops_and_raises(holder: Holder) -> None:
    source = CopySource.open(holder.info, "holder")
    assert source is not None
    run = 32 << 10
    rows = 512  # 16 MiB: shared out in pieces over the threads
    out = np.zeros(rows * run, dtype=np.uint8)
    local = ranges(out.ctypes.data, [i * run for i in range(rows)], run)
    remote = ranges(holder.base, [i * run for i in range(rows)], run)
    remote[rows // 2, 0] = 4096  # memory the holder does not have
    copier = Copier(2)
    try:
        with pytest.raises(ProtocolError, match="moved|does not have"):  # short or refused
            asyncio.run(copier.copy(source, local, remote))
        assert np.array_equal(out[:run], holder.pool[:run])  # the first piece landed
    finally:
        copier.close()


def test_mapped_rows_stay_inside_the_maps_whatever_the_server_says() -> None:
    """A server's shared caches (``HostInfo.regions``) are mapped and rows inside them are
    translated; rows outside, straddling the end, or near 2**64 (wrapping when added)
    are not: those copies go through ``process_vm_readv``, which reports a bad address."""
    cache = kv_cache_zeros((2, 64, 16, 8, 64), torch.bfloat16, shared=True)
    region = shared_region(cache)
    assert region is not None
    probe = ProbeCell()  # alive while the source checks it
    info = msgspec.structs.replace(
        probe.host_info(), place=7,
        regions=np.array([[region.address, region.nbytes, region.fd, region.inode]],
                         dtype=np.uint64).tobytes())
    source = CopySource.open(info, "self")
    assert source is not None
    start, end = region.address, region.address + region.nbytes
    inside = source.mapped_rows(np.array([[start, 4096], [end - 64, 64]], dtype=np.uint64), 7)
    assert inside is not None and (inside[:, 1] == [4096, 64]).all()
    assert source.mapped_rows(np.array([[start, 4096]], dtype=np.uint64), 8) is None  # moved
    for row in ([end - 64, 65], [end, 1], [start - 1, 1], [2**64 - 16, 32],
                [start, 2**64 - start + 16]):
        assert source.mapped_rows(np.array([row], dtype=np.uint64), 7) is None, row
