"""Tests of ``kvbridge.transfer.rma``.

Pure parts (packed-key checks, range planning) run in-process; puts and gets
run for real between this process (P, the writer) and a spawned child (D, the
owner of the destination KV layer), over UCX on loopback. D sends its windows
and packed keys on an ordinary control frame, P writes scattered blocks into
D's layer tensor, and D checks every byte and reports on the control channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import signal
import struct
import zlib
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ConfigError
from kvbridge.transfer import rma
from kvbridge.transfer.errors import PeerClosedError, PeerTimeoutError
from kvbridge.transfer.ucx import UcxConnection, UcxWorker

T = TypeVar("T")
NUM_BLOCKS = 24
LAYER_SHAPE = (2, NUM_BLOCKS, 16, 8, 128)  # NHD bf16: K plane + V plane = 64 KiB a block
PLANE_NBYTES = 16 * 8 * 128 * 2
TIMEOUT_S = 20.0
_WINDOWS = struct.Struct("<QQQQ")  # layer address, nbytes, readable address, nbytes
_KEY_LENS = struct.Struct("<HH")


def _source_layer() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(-(2**15), 2**15, LAYER_SHAPE, generator=gen, dtype=torch.int16)


def _readable() -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(11).integers(0, 256, NUM_BLOCKS * 2 * PLANE_NBYTES, np.uint8)


# ----------------------------------------------------------------------- pure parts
def _key(md_map: int, tl_sizes: list[int], mem_type: int = 0, trailer: bytes = b"\xff") -> bytes:
    body = b"".join(bytes([n]) + bytes(range(n)) for n in tl_sizes)
    return struct.pack("<QB", md_map, mem_type) + body + trailer


def test_parse_packed_rkey_reads_well_formed_keys() -> None:
    assert rma.parse_packed_rkey(_key(0b1, [0])) == {0: 0}
    assert rma.parse_packed_rkey(_key(0b10101, [0, 12, 24], trailer=b"")) == {0: 0, 2: 12, 4: 24}
    assert rma.parse_packed_rkey(_key(0, [], trailer=b"")) == {}  # TCP only: RMA emulated


@pytest.mark.parametrize(
    ("packed", "words"),
    [
        (b"", "outside"),
        (struct.pack("<QB", 1, 0), "ends before domain 0"),
        (_key(1, [200] * 1) + bytes(5000), "outside"),
        (_key(1, [4], mem_type=1), "memory type 1"),
        (struct.pack("<QB", 0, 0)[:8], "outside"),
        (_key(0b111, [4, 4, 4])[:-6], "ends before domain"),
        (_key(0b1, [4], trailer=b"\xff\x00\x00"), "the key has"),
        (_key(0b11, [3], trailer=b""), "ends before domain 1"),
    ],
)
def test_parse_packed_rkey_rejects_malformed_keys(packed: bytes, words: str) -> None:
    with pytest.raises(rma.RkeyError, match=words):
        rma.parse_packed_rkey(packed)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_parse_packed_rkey_never_fails_untyped(packed: bytes) -> None:
    try:
        sizes = rma.parse_packed_rkey(packed)
    except rma.RkeyError:
        return
    md_map = int.from_bytes(packed[:8], "little")
    assert sorted(sizes) == [i for i in range(64) if md_map >> i & 1]
    assert packed[8] == 0 and len(packed) - (9 + sum(1 + n for n in sizes.values())) in (0, 1)


@st.composite
def _copies(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Non-overlapping copies inside 512-byte windows, often adjacent on both sides."""
    num = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(1, 16), min_size=num, max_size=num))
    local, remote, local_at, remote_at = [], [], 0, 0
    for size in sizes:
        local_at += draw(st.sampled_from([0, 0, 3, 17]))
        remote_at += draw(st.sampled_from([0, 0, 5]))
        local.append(local_at)
        remote.append(remote_at)
        local_at += size
        remote_at += size
    return local, remote, sizes


@settings(max_examples=200, deadline=None)
@given(_copies())
def test_plan_ranges_moves_the_same_bytes_with_maximal_merging(
    copies: tuple[list[int], list[int], list[int]],
) -> None:
    local, remote, sizes = copies
    source = np.arange(512, dtype=np.int64)

    def apply(src_at: list[int], dst_at: list[int], nbytes: list[int]) -> np.ndarray[Any, Any]:
        out = np.full(512, -1, dtype=np.int64)
        for s, d, n in zip(src_at, dst_at, nbytes, strict=True):
            out[d : d + n] = source[s : s + n]
        return out

    got_local, got_remote, got_sizes = rma.plan_ranges(local, remote, sizes, 512, 512)
    assert np.array_equal(
        apply(got_local.tolist(), got_remote.tolist(), got_sizes.tolist()),
        apply(local, remote, sizes),
    )
    ends_local, ends_remote = got_local + got_sizes, got_remote + got_sizes
    assert not ((got_local[1:] == ends_local[:-1]) & (got_remote[1:] == ends_remote[:-1])).any()


@pytest.mark.parametrize(
    ("local", "remote", "nbytes", "words"),
    [
        ([0, 100], [0, 100], 16, "copy 1 of 16 bytes"),  # local end 116 > 112
        ([0], [200], 16, "remote \\[200, 216\\)"),
        ([-1], [0], 4, "copy 0"),
        ([0], [0], 0, "copy 0 of 0 bytes"),
        ([0, 1], [0], 1, "equal counts"),
        ([], [], 1, "equal counts"),
    ],
)
def test_plan_ranges_rejects_ranges_outside_the_windows(
    local: list[int], remote: list[int], nbytes: int, words: str
) -> None:
    with pytest.raises(rma.OutOfRegionError, match=words):
        rma.plan_ranges(local, remote, nbytes, 112, 208)


def test_rma_needs_the_rma_feature() -> None:
    async def run() -> None:
        worker = UcxWorker()
        try:
            with pytest.raises(ConfigError, match="RMA feature"):
                rma.Rma(worker)
            rma.Rma(worker, require_feature=False).close()
        finally:
            await worker.close()

    asyncio.run(run())


# ------------------------------------------------------------------- the D process
def _serve_d(port_queue: Any, config: dict[str, str]) -> None:
    asyncio.run(_serve_d_async(port_queue, config))


async def _serve_d_async(port_queue: Any, config: dict[str, str]) -> None:
    worker = rma.new_rma_worker(config)
    engine = rma.Rma(worker)
    layer = torch.zeros(LAYER_SHAPE, dtype=torch.int16)
    readable = _readable()
    layer_reg = engine.register_tensor(layer, remote_write=True)
    readable_reg = engine.register_tensor(readable, remote_read=True)
    source = _source_layer()
    shutdown = asyncio.Event()

    def check(pairs: list[tuple[int, int]]) -> str:
        expected = torch.zeros_like(layer)
        for remote_block, local_block in pairs:
            expected[:, local_block] = source[:, remote_block]
        if torch.equal(layer, expected):
            return "ok"
        wrong = (layer != expected).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        return f"wrong local blocks {wrong}"

    async def on_connect(conn: UcxConnection) -> None:
        hello = _WINDOWS.pack(layer_reg.address, layer_reg.nbytes, readable_reg.address,
                              readable_reg.nbytes)
        keys = _KEY_LENS.pack(len(layer_reg.packed_rkey), len(readable_reg.packed_rkey))
        await conn.send_frame(hello + keys + layer_reg.packed_rkey + readable_reg.packed_rkey,
                              timeout_s=TIMEOUT_S)
        while True:
            try:
                frame = await conn.recv_frame(max_nbytes=1 << 16, timeout_s=120.0)
            except Exception:  # the test aborted this connection on purpose
                return
            command, _, body = frame.partition(b" ")
            if command == b"zero":
                layer.zero_()
                reply = "ok"
            elif command == b"check":
                pairs = np.frombuffer(body, dtype=np.int64).reshape(-1, 2).tolist()
                reply = check([(a, b) for a, b in pairs])
            elif command == b"crc":
                reply = str(zlib.crc32(layer.numpy().tobytes()))
            else:
                if command == b"shutdown":
                    shutdown.set()
                conn.abort()
                return
            await conn.send_frame(reply.encode(), timeout_s=TIMEOUT_S)

    port_queue.put(worker.listen(0, on_connect, timeout_s=TIMEOUT_S))
    await asyncio.wait_for(shutdown.wait(), 300.0)
    engine.close()
    await worker.close()


# ------------------------------------------------------------------- the P process
@dataclass
class Link:
    conn: UcxConnection
    layer_key: rma.RemoteKey
    readable_key: rma.RemoteKey
    hello: bytes


class Session:
    """P's side: a loop, a worker, the source layer and a link to D."""

    def __init__(self, port: int, config: dict[str, str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.port, self.config = port, config
        self.source = _source_layer()
        try:
            self.worker, self.engine, self.src_reg, self.link = self.run(self._open())
        except BaseException:
            self.loop.close()
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 60.0))

    async def _open(self) -> tuple[UcxWorker, rma.Rma, rma.Registration, Link]:
        worker = rma.new_rma_worker(self.config)
        try:
            engine = rma.Rma(worker)
            src_reg = engine.register_tensor(self.source)
            return worker, engine, src_reg, await self.connect(engine_of=(worker, engine))
        except BaseException:
            await worker.close()
            raise

    async def connect(self, engine_of: tuple[UcxWorker, rma.Rma] | None = None) -> Link:
        worker, engine = engine_of or (self.worker, self.engine)
        conn = await worker.connect("127.0.0.1", self.port, timeout_s=TIMEOUT_S)
        hello = await conn.recv_frame(max_nbytes=1 << 16, timeout_s=TIMEOUT_S)
        layer_at, layer_nbytes, readable_at, readable_nbytes = _WINDOWS.unpack_from(hello)
        layer_len, readable_len = _KEY_LENS.unpack_from(hello, _WINDOWS.size)
        keys = hello[_WINDOWS.size + _KEY_LENS.size :]
        layer_key = engine.unpack_rkey(conn, keys[:layer_len], layer_at, layer_nbytes)
        readable_key = engine.unpack_rkey(
            conn, keys[layer_len : layer_len + readable_len], readable_at, readable_nbytes
        )
        return Link(conn, layer_key, readable_key, hello)

    async def ask(self, command: bytes) -> str:
        await self.link.conn.send_frame(command, timeout_s=TIMEOUT_S)
        reply = await self.link.conn.recv_frame(max_nbytes=1 << 16, timeout_s=TIMEOUT_S)
        return reply.decode()

    async def put_blocks(self, pairs: list[tuple[int, int]]) -> int:
        """Put whole blocks (K plane and V plane) ``remote -> local`` into D's layer."""
        src = [plane * NUM_BLOCKS + b for plane in (0, 1) for b, _ in pairs]
        dst = [plane * NUM_BLOCKS + b for plane in (0, 1) for _, b in pairs]
        return await self.engine.put(
            self.src_reg, self.link.layer_key, np.array(src) * PLANE_NBYTES,
            np.array(dst) * PLANE_NBYTES, PLANE_NBYTES, timeout_s=TIMEOUT_S,
        )

    async def check(self, pairs: list[tuple[int, int]]) -> str:
        return await self.ask(b"check " + np.array(pairs, dtype=np.int64).reshape(-1).tobytes())

    def close(self) -> None:
        async def shut() -> None:
            # An unclosed UcxWorker hangs interpreter exit: close it whatever happened.
            try:
                await self.link.conn.send_frame(b"shutdown", timeout_s=TIMEOUT_S)
                await asyncio.sleep(0.2)
            finally:
                self.link.conn.abort()
                self.engine.close()
                await self.worker.close()

        self.run(shut())
        self.loop.close()


@contextlib.contextmanager
def _open_session(config: dict[str, str]) -> Iterator[tuple[Session, Any]]:
    """Spawn D, connect P to it; on exit shut both down and require a clean exit of D."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=_serve_d, args=(ports, config), daemon=True)
    child.start()
    try:
        sess = Session(ports.get(timeout=60), config)
        try:
            yield sess, child
        finally:
            sess.close()
        child.join(30)
        assert child.exitcode == 0, f"D exited with {child.exitcode}"
    finally:
        if child.is_alive():
            child.kill()


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    with _open_session({}) as (sess, _):
        yield sess


def test_put_scattered_blocks_lands_every_byte(session: Session) -> None:
    rng = random.Random(3)
    remote = rng.sample(range(NUM_BLOCKS), 9) + [20, 21, 22]  # a run, adjacent on both sides
    local = rng.sample(range(16), 9) + [17, 18, 19]
    pairs = list(zip(remote, local, strict=True))
    src = [p * NUM_BLOCKS + b for p in (0, 1) for b in remote]
    dst = [p * NUM_BLOCKS + b for p in (0, 1) for b in local]
    expected_ops = rma.plan_ranges(np.array(src) * PLANE_NBYTES, np.array(dst) * PLANE_NBYTES,
                                   PLANE_NBYTES, 1 << 30, 1 << 30)[0].size

    assert session.run(session.ask(b"zero")) == "ok"
    assert session.run(session.put_blocks(pairs)) == expected_ops < 2 * len(pairs)
    assert session.run(session.check(pairs)) == "ok"


def test_get_reads_the_peers_readable_region(session: Session) -> None:
    local = np.zeros(4 * PLANE_NBYTES, dtype=np.uint8)
    reg = session.engine.register_tensor(local)
    blocks = [5, 0, 33, 12]
    try:
        session.run(session.engine.get(
            reg, session.link.readable_key, np.arange(4) * PLANE_NBYTES,
            np.array(blocks) * PLANE_NBYTES, PLANE_NBYTES, timeout_s=TIMEOUT_S,
        ))
    finally:
        reg.close()
    expected = _readable().reshape(-1, PLANE_NBYTES)[blocks].reshape(-1)
    assert np.array_equal(local, expected)


def test_bad_keys_are_rejected_before_ucx_and_good_puts_go_on(session: Session) -> None:
    real = session.link.layer_key
    packed = session.link.hello[_WINDOWS.size + _KEY_LENS.size :][
        : _KEY_LENS.unpack_from(session.link.hello, _WINDOWS.size)[0]
    ]
    garbage = [
        bytes(random.Random(seed).getrandbits(8) for _ in range(40)) for seed in range(20)
    ]
    bad = [*garbage, packed[:-2], packed + b"\x00\x00", b"\x00" * 8 + packed[8:],
           packed[:8] + b"\x02" + packed[9:]]
    for key in bad:
        with pytest.raises(rma.RkeyError):
            session.engine.unpack_rkey(session.link.conn, key, real.base, real.nbytes)
    layout = rma.parse_packed_rkey(packed)
    foreign = _key(sum(1 << md for md in layout) | 1 << 40, [*layout.values(), 12])
    with pytest.raises(rma.RkeyError, match="keys of this host"):
        session.engine.unpack_rkey(session.link.conn, foreign, real.base, real.nbytes)
    for base, nbytes in ((0, 10), (real.base, 0), ((1 << 64) - 8, 16)):
        with pytest.raises(rma.RkeyError, match="window"):
            session.engine.unpack_rkey(session.link.conn, packed, base, nbytes)

    assert session.run(session.ask(b"zero")) == "ok"
    assert session.run(session.put_blocks([(1, 2)])) == 2
    assert session.run(session.check([(1, 2)])) == "ok"


def test_out_of_window_put_writes_nothing(session: Session) -> None:
    assert session.run(session.ask(b"zero")) == "ok"
    with pytest.raises(rma.OutOfRegionError, match="leaves its window"):
        session.run(session.engine.put(
            session.src_reg, session.link.layer_key, [0, 0],
            [0, session.link.layer_key.nbytes - 100], PLANE_NBYTES, timeout_s=TIMEOUT_S,
        ))
    assert session.run(session.check([])) == "ok"


def test_closed_keys_and_connections_fail_typed(session: Session) -> None:
    link = session.run(session.connect())
    link.layer_key.close()
    link.layer_key.close()  # idempotent
    with pytest.raises(PeerClosedError):
        session.run(session.engine.put(session.src_reg, link.layer_key, [0], [0], 16,
                                       timeout_s=TIMEOUT_S))
    link.conn.abort()
    with pytest.raises(PeerClosedError):
        session.run(session.engine.get(session.src_reg, link.readable_key, [0], [0], 16,
                                       timeout_s=TIMEOUT_S))
    with pytest.raises(PeerClosedError):
        session.run(session.engine.flush(link.conn, timeout_s=TIMEOUT_S))
    link.readable_key.close()
    session.run(session.engine.flush(session.link.conn, timeout_s=TIMEOUT_S))  # others go on


def test_register_rejects_bad_memory(session: Session) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        session.engine.register_tensor(torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="cannot register"):
        session.engine.register(0, 16, None)
    with pytest.raises(ValueError, match="cannot register"):
        session.engine.register(4096, 0, None)


def test_many_small_copies_cross_the_yield_points(session: Session) -> None:
    piece = 4096
    num_pieces = session.source.numel() * 2 // piece
    src = np.arange(0, num_pieces, 2) * piece  # every other piece: nothing merges
    dst = np.random.default_rng(5).permutation(num_pieces)[: src.size] * piece
    expected = np.zeros(session.source.numel() * 2, dtype=np.uint8)
    source = session.source.numpy().view(np.uint8).reshape(-1)
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        expected[d : d + piece] = source[s : s + piece]

    assert session.run(session.ask(b"zero")) == "ok"
    assert session.run(session.engine.put(session.src_reg, session.link.layer_key, src, dst,
                                          piece, timeout_s=TIMEOUT_S)) == src.size > 128
    assert session.run(session.ask(b"crc")) == str(zlib.crc32(expected.tobytes()))


def test_put_over_tcp_emulation_then_a_stalled_peer_times_out() -> None:
    # TCP only: puts are emulated with messages D must answer, so a stopped D stalls them.
    with _open_session({"TLS": "tcp"}) as (sess, child):
        pairs = [(3, 4), (9, 1), (10, 2)]
        assert sess.run(sess.ask(b"zero")) == "ok"
        sess.run(sess.put_blocks(pairs))
        assert sess.run(sess.check(pairs)) == "ok"

        link = sess.run(sess.connect())
        os.kill(child.pid, signal.SIGSTOP)
        try:
            big = [(b, b) for b in range(NUM_BLOCKS)]  # 3 MiB: more than socket buffers hold
            src = [p * NUM_BLOCKS + b for p in (0, 1) for b, _ in big]
            with pytest.raises(PeerTimeoutError, match="not done in"):
                sess.run(sess.engine.put(sess.src_reg, link.layer_key,
                                         np.array(src) * PLANE_NBYTES,
                                         np.array(src) * PLANE_NBYTES, PLANE_NBYTES,
                                         timeout_s=1.0))
            assert link.conn.closed  # a timed-out connection is never reused
        finally:
            os.kill(child.pid, signal.SIGCONT)
        sess.run(asyncio.sleep(0.5))  # the abandoned requests end; their handles are freed
        link.layer_key.close()
        link.readable_key.close()
        assert sess.run(sess.ask(b"zero")) == "ok"  # the first link still works


def test_ucs_status_codes_are_signed_bytes() -> None:
    lib = rma.UcpLibrary()
    assert lib.status_name(-25) == "Connection reset by remote peer"
    with pytest.raises(rma.RmaError, match="x: No such element") as caught:
        lib.check(-12, "x")
    assert caught.value.status == -12
    lib.check(0, "fine")
