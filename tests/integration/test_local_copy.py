"""Same-host copies between agents in real processes: the protocol, its holds, its failures.

The serving agent runs in a child process. Some tests drive it from a raw UCX
client in this process (handshake helpers, ``CopySource``), to see exactly what
the server says and pins; the others use a reader agent in a second child.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from kvbridge.transfer.blocks.ranges import block_offsets, plane_ranges
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.reading.copy_source import CopySource
from tests.integration.raw_peer import CODEC, MAX_FRAME, SECRET, connect, me
from tests.integration.reads import issue, read, wait_read, wait_released
from tests.ports import free_port_base
from tests.transfer.agent_proc import AgentRef, Host, Spec, host_pair, logical, make_caches
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

P_SPEC = Spec("p-x", seed=11, secret=SECRET, config={"lease_s": 30.0})
D_SPEC = Spec("d-x", seed=-1, secret=SECRET, config={"local_copy_min_nbytes": 0})


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    with host_pair() as pair:
        yield pair


def add(host: Host, spec: Spec, **config: Any) -> AgentRef:
    return host.add(replace(spec, port=free_port_base(1), config={**spec.config, **config}))


def wait_counter(agent: AgentRef, name: str, value: int, timeout_s: float) -> None:
    wait_until(lambda: getattr(agent.call("counters"), name), timeout_s,
               until=lambda now: now == value, message=f"{name} to reach {value}")


def read_ok(server: AgentRef, reader: AgentRef, request_id: str, blocks: list[int],
            local: list[int]) -> Any:
    token = issue([server], request_id, blocks, 1)
    read([reader], [server], request_id, token, blocks, local, 16 * len(blocks))
    outcome = wait_read(reader, request_id)
    assert outcome["failed"] == set(), outcome["stats"]
    got = logical(reader.call("caches"), reader.spec, local, 16 * len(blocks))
    assert torch.equal(got, logical(server.call("caches"), server.spec, blocks,
                                    16 * len(blocks)))
    [stats] = outcome["stats"]
    return stats


def test_raw_reader_copies_what_the_go_says_and_copy_done_unpins(
    hosts: tuple[Host, Host],
) -> None:
    server = add(hosts[0], P_SPEC)
    blocks = [9, 3, 40]
    token = issue([server], "raw", blocks, 1)
    want = logical(server.call("caches"), server.spec, blocks, 48)

    async def copy() -> tuple[torch.Tensor, int]:
        worker, conn = await connect(server.port)
        try:
            meta = await reader_handshake_meta(conn)
            assert meta.host is not None
            source = CopySource.open(meta.host, conn.peer)
            assert source is not None
            request = wire.ReadRequest(7, token, blocks, 0, 8, 0, 4, 8, direct=True,
                                       local_copy=True)
            await send(conn, request)
            go = await recv(conn)
            assert isinstance(go, wire.CopyGo) and go.xfer_id == 7, go
            holds = server.call("counters").num_copy_holds
            origins = np.frombuffer(go.origins, dtype=np.uint64)
            assert origins.size == 4 * 2  # 4 layers, K and V
            remote = plane_ranges(origins, block_offsets(np.array(blocks), go.block_stride,
                                                         go.span_offset), go.span_nbytes)
            # [layer, kv, block, token, head, dim], in the order of the ranges
            out = torch.zeros(4, 2, len(blocks), 16, 8, 64, dtype=torch.bfloat16)
            local = plane_ranges(np.array([out.data_ptr()], dtype=np.uint64),
                                 np.arange(remote.shape[0], dtype=np.uint64) * go.span_nbytes,
                                 go.span_nbytes)
            source.readv(local, remote)
            await send(conn, wire.CopyDone(7, True))
            await send(conn, wire.ReadDone(token, "raw-reader", True))
            return out, holds
        finally:
            await asyncio.sleep(0.2)
            conn.abort()
            await worker.close()

    out, holds_during = asyncio.run(copy())
    assert holds_during == 1
    got = out.reshape(4, 2, 48, 8, 64)  # blocks in a row are the tokens in a row
    assert torch.equal(got, want)
    wait_released(server, "raw")  # done by its one reader
    stats, live = server.call("grant_stats")
    assert (stats.num_released_done, live) == (1, 0)
    counters = server.call("counters")
    assert (counters.num_copy_holds, counters.num_reads_served) == (0, 1)


def test_a_copy_withdrawn_before_its_grant_is_never_pinned(hosts: tuple[Host, Host]) -> None:
    """A reader that asked before the grant existed and then copied on the board's word
    says ``CopyDone(ok=False)`` while the server still waits for the grant: once the
    grant comes, the server pins nothing for that ask and sends no go (issue #40); the
    next ask on the connection is served as usual."""
    server = add(hosts[0], P_SPEC)
    blocks = [9, 3, 40]
    token = secrets.token_urlsafe(16)

    async def ask_withdraw_ask() -> tuple[int, wire.Message]:
        worker, conn = await connect(server.port)
        try:
            await reader_handshake_meta(conn)
            await send(conn, wire.ReadRequest(7, token, blocks, 0, 8, 0, 4, 8, direct=True,
                                              local_copy=True))
            await send(conn, wire.CopyDone(7, False))  # before the grant: withdrawn
            await asyncio.sleep(0.2)  # the server reads both while it waits for the grant
            assert issue_token(server, "late", blocks, token) == token
            await asyncio.sleep(0.3)  # a go for 7 would be sent now
            holds = server.call("counters").num_copy_holds
            await send(conn, wire.ReadRequest(8, token, blocks, 0, 8, 0, 4, 8, direct=True,
                                              local_copy=True))
            reply = await recv(conn)  # the first message since: 8's go, never 7's
            await send(conn, wire.CopyDone(8, True))
            return holds, reply
        finally:
            await asyncio.sleep(0.2)
            conn.abort()
            await worker.close()

    holds, reply = asyncio.run(ask_withdraw_ask())
    assert holds == 0
    assert isinstance(reply, wire.CopyGo) and reply.xfer_id == 8, reply
    wait_counter(server, "num_copy_holds", 0, 5.0)
    assert server.call("counters").num_serving_reads == 0


def issue_token(server: AgentRef, request_id: str, blocks: list[int], token: str) -> str:
    return server.call("issue", request_id, blocks, 1, None, token)


async def reader_handshake_meta(conn: Any) -> wire.AgentMetadata:
    from kvbridge.transfer.protocol.handshake import reader_handshake

    return await reader_handshake(conn, CODEC, me(), "p-x", 0, max_nbytes=MAX_FRAME,
                                  timeout_s=5)


async def send(conn: Any, msg: wire.Message) -> None:
    from kvbridge.transfer.protocol.handshake import send_msg

    await send_msg(conn, CODEC, msg, 5.0)


async def recv(conn: Any) -> wire.Message:
    from kvbridge.transfer.protocol.handshake import recv_msg

    return await recv_msg(conn, CODEC, MAX_FRAME, 5.0)


def test_a_copy_never_reported_done_is_unpinned_at_its_hold(hosts: tuple[Host, Host]) -> None:
    """A reader that got its go and went quiet (connection dropped, no CopyDone) holds
    the grant only until the hold ends; then the lease releases it, once."""
    # a hold long past the lease, so that "inside the hold" holds on a loaded machine too
    server = add(hosts[0], P_SPEC, chunk_timeout_s=3.0)
    token = secrets.token_urlsafe(16)
    server.call("issue", "quiet", [4, 5], 1, 0.5, token)

    async def ask_and_leave() -> wire.Message:
        worker, conn = await connect(server.port)
        try:
            await reader_handshake_meta(conn)
            await send(conn, wire.ReadRequest(1, token, [4, 5], 0, 8, 0, 4, 8, direct=True,
                                              local_copy=True))
            return await recv(conn)
        finally:
            conn.abort()
            await worker.close()

    go = asyncio.run(ask_and_leave())
    assert isinstance(go, wire.CopyGo) and go.hold_s == pytest.approx(3.0)
    time.sleep(0.7)  # past the lease, inside the hold: pinned
    assert server.call("counters").num_copy_holds == 1
    assert "quiet" not in server.call("poll")[0]
    wait_released(server, "quiet", timeout_s=10.0)
    stats, live = server.call("grant_stats")
    assert (stats.num_released_expired, live) == (1, 0)
    wait_counter(server, "num_copy_holds", 0, 2.0)


@pytest.mark.parametrize("case", ["not_offered", "not_direct"])
def test_a_copy_the_server_cannot_serve_is_rejected(hosts: tuple[Host, Host], case: str) -> None:
    server = add(hosts[0], P_SPEC, local_copy=case != "not_offered")
    token = issue([server], "refused", [1, 2], 1)

    async def ask() -> tuple[wire.AgentMetadata, wire.Message]:
        worker, conn = await connect(server.port)
        try:
            meta = await reader_handshake_meta(conn)
            await send(conn, wire.ReadRequest(1, token, [1, 2], 0, 8, 0, 4, 8,
                                              direct=case != "not_direct", local_copy=True))
            return meta, await recv(conn)
        finally:
            conn.abort()
            await worker.close()

    meta, reply = asyncio.run(ask())
    assert (meta.host is None) == (case == "not_offered")
    assert isinstance(reply, wire.Reject) and reply.reason == wire.RejectReason.BAD_REQUEST
    assert server.call("counters").num_copy_holds == 0
    reader = add(hosts[1], D_SPEC)
    stats = read_ok(server, reader, "after", [6, 7], [10, 11])
    assert stats.num_local_copies == (0 if case == "not_offered" else 1)


@pytest.mark.parametrize("side", ["server", "reader"])
def test_either_side_can_turn_copies_off(hosts: tuple[Host, Host], side: str) -> None:
    server = add(hosts[0], P_SPEC, local_copy=side != "server")
    reader = add(hosts[1], D_SPEC, local_copy=side != "reader")
    stats = read_ok(server, reader, "ucx", [2, 9, 30], [5, 6, 7])
    assert (stats.num_direct, stats.num_local_copies) == (1, 0)
    assert server.call("counters").num_data_bytes_sent > 0  # through UCX


@pytest.mark.parametrize("board", [True, False])
def test_copies_after_the_first_start_before_the_go_and_stay_exact(
    hosts: tuple[Host, Host], board: bool,
) -> None:
    """With the board every read copies on its word (no question to the server at all:
    the handshake said where the blocks are); without it the second read of a shape
    copies while the server checks. The bytes must still be the server's, also after
    its caches were rewritten between reads."""
    server = add(hosts[0], P_SPEC, grant_board=board)
    reader = add(hosts[1], D_SPEC)
    server.call("caches")  # (sending them here moves them once: see the next test)
    for n, blocks in enumerate([[1, 2, 3], [7, 8, 9], [3, 1, 2]]):
        stats = read_ok(server, reader, f"again-{n}", blocks, [20, 21, 22])
        assert stats.num_local_copies == 1
        reader.call("zero")
    for n in range(3):
        wait_released(server, f"again-{n}")  # the reader's done reports count
    counters = server.call("counters")
    assert counters.num_data_bytes_sent == 0  # nothing went through UCX
    assert counters.num_board_copies == (3 if board else 0)
    assert counters.num_reads_served == 3 and counters.num_copy_holds == 0
    assert counters.num_bytes_served == 3 * 3 * 4 * 2 * 16 * 8 * 64 * 2


def test_caches_that_moved_are_never_copied_from_their_old_place(
    hosts: tuple[Host, Host],
) -> None:
    """Pickling a tensor to another process moves its storage into shared memory. The
    server's caches move so when ``read_ok`` first fetches them to compare: the next read
    must not copy from where the handshake said the blocks were."""
    server = add(hosts[0], P_SPEC)
    reader = add(hosts[1], D_SPEC)
    for request_id, blocks, board_copies in [
        ("before", [1, 2], 1),  # on the board; then the caches move
        ("moved", [5, 6], 1),  # the board's place differs: asks
        ("settled", [7, 8], 2),  # the new go's place: on the board
    ]:
        read_ok(server, reader, request_id, blocks, [3, 4])
        wait_released(server, request_id)  # its done report (counted by the server) arrived
        assert server.call("counters").num_board_copies == board_copies, request_id


@pytest.mark.parametrize("case", ["outside", "prompt", "expired", "released"])
def test_the_board_never_allows_what_the_server_refuses(
    hosts: tuple[Host, Host], case: str,
) -> None:
    """A read the board does not allow asks the server, which refuses it as always:
    the reader reports the blocks failed and copies nothing on the board's word."""
    server = add(hosts[0], P_SPEC, expire_every_s=60.0)  # leases end, nothing expires them
    reader = add(hosts[1], D_SPEC)
    server.call("caches")  # moved once, before any go
    read_ok(server, reader, "first", [1, 2], [3, 4])  # the shape's go is known now
    digest = b"the prompt the grant holds"
    token = secrets.token_urlsafe(16)
    lease_s = 0.3 if case == "expired" else None
    server.call("issue", "bad", [5, 6], 1, lease_s, token, digest)
    blocks, prompt = [5, 6], digest
    if case == "outside":
        blocks = [5, 7]
    elif case == "prompt":
        prompt = b"another prompt"
    elif case == "expired":
        time.sleep(0.5)
    else:  # read again after the one reader reported: the grant is gone
        reader.call("read", request_id="ok", engine_id="p-x", host="127.0.0.1",
                    port=server.port, remote_block_ids=blocks, local_block_ids=[8, 9],
                    grant=token, num_tokens=32, prompt_digest=prompt)
        assert wait_read(reader, "ok")["failed"] == set()
        wait_released(server, "bad")
    reader.call("read", request_id="refused", engine_id="p-x", host="127.0.0.1",
                port=server.port, remote_block_ids=blocks, local_block_ids=[8, 9],
                grant=token, num_tokens=32, prompt_digest=prompt)
    outcome = wait_read(reader, "refused")
    assert outcome["failed"] == {8, 9}
    [stats] = outcome["stats"]
    assert "RejectedError" in stats.error, stats
    counters = server.call("counters")  # "first", and "ok" when there was one
    assert counters.num_board_copies == (2 if case == "released" else 1)


@pytest.mark.parametrize("inline", [True, False])
def test_copies_on_the_boards_word_never_keep_a_grant_alive(
    hosts: tuple[Host, Host], inline: bool,
) -> None:
    """Issue #29, finding 4, for copies that never ask: the server hears of a copy on
    its grant board's word only from the done report after it, pins nothing for it
    and renews nothing for it (the reader sends no renewal for such a read, and the
    server would refuse one as ``no_read``). So a reader copying so, over and over,
    cannot keep a grant alive: the lease ends as issued, the board withdraws the
    grant before its blocks go back (a copy overlapping that is dropped by the seq
    check), and the next read asks and is refused. ``inline``: 50 MiB copies on the
    caller's thread; else on the agent's loop, in slices, long past ``renew_every_s``
    (a reader that renewed every read it made, asked or not, moved the lease)."""
    shape = {"head_dim": 128, "num_blocks": 220}  # 256 KiB blocks
    server = add(hosts[0], replace(P_SPEC, manual_clock=True, **shape))
    config: dict[str, Any] = {"renew_every_s": 1e-4}
    if not inline:
        config.update(inline_copy_max_nbytes=0, copy_threads=1)  # ~10 ms a copy
    reader = add(hosts[1], replace(D_SPEC, **shape), **config)
    server.call("caches")  # moved once, before any go
    read_ok(server, reader, "link", [1, 2], [3, 4])  # opens the link (on the board's word)
    token = secrets.token_urlsafe(16)
    blocks = list(range(8, 208))  # 200 blocks: 50 MiB (a board slot holds 256 ids)
    server.call("issue", "held", blocks, 100, 5.0, token)  # 100 readers: never all reported
    expires_at = server.call("next_expiry")

    def read_held(request_id: str) -> dict[str, Any]:
        read([reader], [server], request_id, token, blocks, list(range(len(blocks))),
             16 * len(blocks))
        return wait_read(reader, request_id)

    num_copies = 5
    for n in range(num_copies):
        outcome = read_held(f"copy-{n}")
        assert outcome["failed"] == set(), outcome["stats"]
        [stats] = outcome["stats"]
        assert stats.num_local_copies == 1
    wait_counter(server, "num_board_copies", 1 + num_copies, 10.0)  # their done reports
    counters = server.call("counters")
    assert counters.num_copy_holds == 0 and counters.num_data_bytes_sent == 0  # never asked
    assert server.call("next_expiry") == expires_at  # no copy moved the lease
    server.call("advance", 5.0)  # the lease as issued
    wait_released(server, "held")
    stats, num_live = server.call("grant_stats")
    assert (stats.num_released_expired, num_live) == (1, 0)
    outcome = read_held("late")
    assert outcome["failed"] == set(range(len(blocks)))  # off the board: asked, refused
    [stats] = outcome["stats"]
    assert "expired_grant" in stats.error, stats
    assert server.call("counters").num_board_copies == 1 + num_copies


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "loop"])
def test_a_read_before_its_grant_completes_while_the_servers_interpreter_is_held(
    hosts: tuple[Host, Host], inline: bool,
) -> None:
    """Issue #40: a read that came before its grant (it missed the grant board and asked)
    is done as soon as the grant is on the board, even while the server's process
    holds its interpreter lock (a C call that keeps it: its agent's thread, which
    would answer the ask, cannot run). The reader looks at the board again while it
    waits, copies on its word and withdraws its ask: once the server runs again it
    pins nothing for it (no hold left) and the grant is released by the done report.
    ``inline``: the read's size would be copied on the caller's thread (it missed the
    board there first); else the agent's thread copies it in slices."""
    server = add(hosts[0], P_SPEC)
    config = {} if inline else {"inline_copy_max_nbytes": 0, "copy_threads": 1}
    reader = add(hosts[1], D_SPEC, **config)
    server.call("caches")  # moved once, before the handshake
    read_ok(server, reader, "link", [1, 2], [3, 4])  # opens the link: the board's map
    token = secrets.token_urlsafe(16)
    blocks, local = [9, 30, 5], [7, 8, 10]
    read([reader], [server], "early", token, blocks, local, 48)  # no grant yet: asks
    hold_s = 8
    ended: list[float] = []
    holder = threading.Thread(target=lambda: ended.append(
        server.call("issue_hold_gil", "early", blocks, token, hold_s)))
    holder.start()
    try:
        outcome = wait_read(reader, "early", timeout_s=hold_s + 10)
        assert holder.is_alive() and not ended, "the read waited for the server's interpreter"
        assert outcome["failed"] == set(), outcome["stats"]
        [stats] = outcome["stats"]
        assert stats.num_local_copies == 1, stats
        assert stats.grant_s <= stats.duration_s and stats.ended_at > 0, stats
    finally:
        holder.join(hold_s + 15)
    got = logical(reader.call("caches"), reader.spec, local, 48)
    assert torch.equal(got, logical(server.call("caches"), server.spec, blocks, 48))
    wait_released(server, "early")  # the done report, read once the server runs again
    wait_counter(server, "num_copy_holds", 0, 5.0)
    # (the server may also have answered before it held its lock: then the read copied
    # after its go, and the go's hold ended with the reader's CopyDone)
    assert server.call("counters").num_serving_reads == 0


def test_a_copy_that_outlives_its_hold_is_dropped(hosts: tuple[Host, Host]) -> None:
    """The reader keeps copied bytes only if the copy ended inside the server's hold
    (asked copies: without the board every copy asks)."""
    server = add(hosts[0], P_SPEC, chunk_timeout_s=1e-4, grant_board=False)  # no copy meets it
    reader = add(hosts[1], D_SPEC)
    token = issue([server], "late", [3, 4], 1)
    read([reader], [server], "late", token, [3, 4], [8, 9], 32)
    outcome = wait_read(reader, "late")
    assert outcome["failed"] == {8, 9}
    [stats] = outcome["stats"]
    assert not stats.ok and "hold" in stats.error, stats
    wait_counter(server, "num_copy_holds", 0, 2.0)


def test_a_server_gone_before_the_copy_fails_it_fast(hosts: tuple[Host, Host]) -> None:
    """With the link up and the go's shape known, the copy starts before any answer: a
    dead server is found by the copy itself (no such process), not by a timeout."""
    p_host, d_host = hosts
    server = add(p_host, P_SPEC)
    reader = add(d_host, replace(D_SPEC, config={"reply_timeout_s": 30.0, "heartbeat_s": 10.0}))
    read_ok(server, reader, "first", [1, 2], [3, 4])
    token = issue([server], "second", [1, 2], 1)
    p_host.kill()
    started = time.monotonic()
    read([reader], [server], "second", token, [1, 2], [3, 4], 32)
    outcome = wait_read(reader, "second", timeout_s=20.0)
    assert outcome["failed"] == {3, 4}
    assert time.monotonic() - started < 10.0, outcome["stats"]


def test_reads_below_the_size_threshold_go_through_ucx(hosts: tuple[Host, Host]) -> None:
    server = add(hosts[0], P_SPEC)
    block_nbytes = 4 * 2 * 16 * 8 * 64 * 2  # 4 layers, K and V, 16 tokens x 8 heads x 64, bf16
    reader = add(hosts[1], D_SPEC, local_copy_min_nbytes=2 * block_nbytes)
    small = read_ok(server, reader, "small", [5], [1])
    assert (small.num_direct, small.num_local_copies) == (1, 0)
    big = read_ok(server, reader, "big", [6, 7], [2, 3])
    assert (big.num_direct, big.num_local_copies) == (1, 1)


def test_a_read_on_the_boards_word_is_done_when_start_read_returns(
    hosts: tuple[Host, Host],
) -> None:
    """The first read of a link already copies on the board's word (the handshake said
    where the blocks are), on the thread calling ``start_read``: its outcome is there
    when the call returns, and the server was never asked (its done report still comes)."""
    server = add(hosts[0], P_SPEC)
    reader = add(hosts[1], D_SPEC)
    server.call("caches")  # moves them once, before the handshake
    read_ok(server, reader, "link", [1, 2], [3, 4])  # opens the link (the loop's path)
    blocks, local = [9, 30, 5], [7, 8, 10]
    token = issue([server], "now", blocks, 1)
    finished, failed, [stats] = reader.call(
        "read_now", request_id="now", engine_id="p-x", host="127.0.0.1", port=server.port,
        remote_block_ids=blocks, local_block_ids=local, grant=token, num_tokens=48)
    assert (finished, failed) == ({"now"}, {})
    assert stats.ok and (stats.num_direct, stats.num_local_copies) == (1, 1), stats
    assert stats.num_messages == 2  # made inline (the loop's board copy counts 4)
    got = logical(reader.call("caches"), reader.spec, local, 48)
    assert torch.equal(got, logical(server.call("caches"), server.spec, blocks, 48))
    wait_released(server, "now")  # the done report, sent later by the reader's loop
    counters = server.call("counters")
    assert counters.num_board_copies == 2 and counters.num_data_bytes_sent == 0


@pytest.mark.parametrize("config", [{"inline_copy_max_nbytes": 0},
                                    {"local_copy_min_nbytes": 1 << 30}])
def test_reads_off_the_callers_thread_when_told(hosts: tuple[Host, Host], config: Any) -> None:
    """``inline_copy_max_nbytes: 0`` sends every read to the agent's thread (a copy on
    the board's word still, made there); a read under ``local_copy_min_nbytes`` goes
    through UCX, also on the caller's thread's path."""
    server = add(hosts[0], P_SPEC)
    reader = add(hosts[1], D_SPEC, **config)
    server.call("caches")  # moves them once, before the handshake
    read_ok(server, reader, "link", [1, 2], [3, 4])
    token = issue([server], "later", [5, 6], 1)
    finished, failed, stats = reader.call(
        "read_now", request_id="later", engine_id="p-x", host="127.0.0.1", port=server.port,
        remote_block_ids=[5, 6], local_block_ids=[7, 8], grant=token, num_tokens=32)
    if "later" not in finished:  # (the loop may also have been done by the time it looked)
        outcome = wait_read(reader, "later")
        failed, stats = outcome["failed"], outcome["stats"]
    [stats] = stats
    assert not failed and stats.ok, stats
    wait_released(server, "later")  # its done report (with what it copied) has arrived
    counters = server.call("counters")
    if "inline_copy_max_nbytes" in config:
        assert (counters.num_board_copies, counters.num_data_bytes_sent) == (2, 0)
        assert stats.num_messages == 4  # a board copy on the loop; inline it counts 2
    else:
        assert counters.num_board_copies == 0 and counters.num_data_bytes_sent > 0
        assert stats.num_local_copies == 0


def test_reads_from_shared_caches_copy_from_a_map_and_are_exact(
    hosts: tuple[Host, Host],
) -> None:
    """Server caches in shared memory (``kv_cache_zeros(shared=True)``): an inline read
    of one part (up to 4 MiB) memmoves out of the reader's map of them; a 10 MiB read
    goes over the copy threads with ``process_vm_readv``; the bytes are exact."""
    server = add(hosts[0], replace(P_SPEC, shared=True, num_blocks=160))
    reader = add(hosts[1], replace(D_SPEC, num_blocks=160))
    expected = make_caches(server.spec)  # the server's values (asking it would move them)

    def read_exact(request_id: str, blocks: list[int], local: list[int]) -> Any:
        token = issue([server], request_id, blocks, 1)
        read([reader], [server], request_id, token, blocks, local, 16 * len(blocks))
        outcome = wait_read(reader, request_id)
        assert outcome["failed"] == set(), outcome["stats"]
        got = logical(reader.call("caches"), reader.spec, local, 16 * len(blocks))
        assert torch.equal(got, logical(expected, server.spec, blocks, 16 * len(blocks)))
        return outcome["stats"][0]

    read_exact("link", [1], [2])
    for request_id, blocks, local, mapped in [
        ("small", [40, 7, 99], [5, 6, 8], True),  # 3 x 128 KiB, one part: inline, mapped
        ("big", list(range(159, 79, -1)), list(range(80)), False),  # 80 x 128 KiB
    ]:
        before = reader.call("memmoves")
        stats = read_exact(request_id, blocks, local)
        assert stats.num_local_copies == 1 and stats.nbytes == len(blocks) * 128 * 1024
        assert reader.call("memmoves") - before == (stats.nbytes if mapped else 0)
