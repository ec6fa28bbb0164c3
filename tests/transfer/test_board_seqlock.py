"""The grant board's seqlock under a concurrent writer in another process.

A spawned child hammers one slot of a real ``GrantBoard`` with two grants for the
same token that never coexist: A (place 1, blocks 0..255) and B (place 2, blocks
1000..1255). This process maps the board as a same-host reader does
(``map_shared``) and reads it with the reader's own functions (``find_grant``
with ``memory_fence()``, then ``slot_seq``). A read that the seqlock accepts
for place 2 with block 255, or place 1 with block 1255, saw half of A and half
of B: a torn slot. With the board's writer none may be accepted (while
consistent reads of A and B are); with a writer that rewrites the live slot in
place, a field at a time (the protection off), the same reader must see some,
so the check can fail.

The hammer runs with this CPU's fence and with libatomic's (the one aarch64
uses), forced here on x86.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

import pytest

from kvbridge.transfer.protocol import grant_board
from kvbridge.transfer.protocol.grant_board import (
    SLOT_NBYTES,
    TAG_NBYTES,
    WINDOW,
    GrantBoard,
    find_grant,
    grant_digest,
    home_slot,
    memory_fence,
    slot_seq,
)
from kvbridge.transfer.protocol.host import map_shared

TOKEN = "tok-" + "s" * 18
NUM_SLOTS = 4
A = (1, list(range(256)))
B = (2, list(range(1000, 1256)))
# (block wanted, place): torn when the place is one grant's and the block the other's
CONSISTENT = ((255, 1), (1255, 2))
TORN = ((255, 2), (1255, 1))


def _force_libatomic() -> None:
    """Use libatomic's fence as a CPU without ordered loads would (x86 or not)."""
    grant_board._ORDERED_MACHINES = frozenset()  # type: ignore[misc]
    memory_fence.cache_clear()


def _writer(conn: Connection, mode: str, libatomic: bool, stop: Event) -> None:
    if libatomic:
        _force_libatomic()
    place = [A[0]]
    board = GrantBoard(lambda: place[0], NUM_SLOTS)
    conn.send((os.getpid(), board.fd, board.nbytes))
    turn = 0
    if mode == "board":  # the real writer: publish, renew, withdraw, one grant at a time
        while turn % 16 or not stop.is_set():
            place[0], blocks = (A, B)[turn % 2]
            assert board.publish(TOKEN, blocks, 600.0, None)
            for _ in range(4):  # live a while, its deadline moving under the reader
                board.renew(TOKEN, 600.0)
                time.sleep(0.00005)  # and still: the reader must get some whole reads in
            board.withdraw(TOKEN)
            turn += 1
    else:  # protection off: the live slot rewritten in place, a field at a time
        assert board.publish(TOKEN, A[1], 600.0, None)
        slot = board._slot_of[TOKEN]
        while not stop.is_set():
            value, blocks = (B, A)[turn % 2]
            board._words[slot, 7] = value  # the place, then each block id
            for index, block in enumerate(blocks):
                board._ids[slot, index] = block
            turn += 1
    conn.send(turn)


def _hammer(mode: str, libatomic: bool, enough: Callable[[int, int, int], bool],
            max_reads: int = 5_000_000) -> tuple[int, int, int]:
    """Read the child's slot until ``enough(torn, consistent, reads)`` (or ``max_reads``);
    (torn accepted, consistent accepted, the writer's turns)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    stop = ctx.Event()
    child = ctx.Process(target=_writer, args=(theirs, mode, libatomic, stop), daemon=True)
    child.start()
    try:
        pid, fd, nbytes = ours.recv()
        board = map_shared(pid, fd, nbytes + TAG_NBYTES, populate=True)
        assert board is not None
        fence = memory_fence()
        assert fence is not None
        digest = grant_digest(TOKEN)
        first = home_slot(digest, NUM_SLOTS) * SLOT_NBYTES
        assert first + WINDOW * SLOT_NBYTES <= nbytes
        torn = consistent = 0
        for turn in range(max_reads):
            if turn % 64 == 0 and enough(torn, consistent, turn):
                break
            block, place = (TORN if turn % 2 else CONSISTENT)[(turn // 2) % 2]
            spot = find_grant(board, first, 0, digest, [block], b"", 0.0, place, fence)
            if spot is None or slot_seq(board, spot.seq_address, fence) != spot.seq:
                continue
            if turn % 2:
                torn += 1
            else:
                consistent += 1
        stop.set()
        writes = ours.recv()
        board.close()
        return torn, consistent, writes
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()


@pytest.mark.parametrize("libatomic", [False, True], ids=["cpu-fence", "libatomic-fence"])
def test_no_torn_slot_is_accepted_under_a_concurrent_writer(libatomic: bool) -> None:
    if libatomic and grant_board._libatomic_fence() is None:
        pytest.skip("libatomic.so.1 not loadable here")
    torn, consistent, writes = _hammer(
        "board", libatomic, lambda torn, consistent, reads: consistent >= 200 and reads >= 20_000)
    assert writes > 10 and consistent >= 200  # the reader got through, often, while written
    assert torn == 0


def test_the_hammer_sees_torn_slots_when_the_writer_ignores_the_seqlock() -> None:
    torn, _, writes = _hammer("unguarded", False, lambda torn, consistent, reads: torn > 0)
    assert writes > 0 and torn > 0


def test_without_a_fence_there_is_no_board(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without ordered loads and no libatomic: no board is written or mapped
    (the reader asks the server), never one read in the wrong order."""
    monkeypatch.setattr(grant_board, "_ORDERED_MACHINES", frozenset())
    monkeypatch.setattr(grant_board, "_libatomic_fence", lambda: None)
    memory_fence.cache_clear()
    try:
        assert memory_fence() is None and not grant_board.board_supported()
        with pytest.raises(RuntimeError, match="board_supported"):
            GrantBoard(lambda: 1, NUM_SLOTS)
    finally:
        memory_fence.cache_clear()


def test_x86_needs_no_fence_and_others_get_libatomics(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setattr(grant_board.platform, "machine", lambda: "x86_64")
        memory_fence.cache_clear()
        assert memory_fence() is grant_board._no_fence
        monkeypatch.setattr(grant_board.platform, "machine", lambda: "aarch64")
        memory_fence.cache_clear()
        fence = memory_fence()
        if grant_board._libatomic_fence() is None:
            assert fence is None
        else:
            assert fence is not None and fence is not grant_board._no_fence
            fence()  # callable here too: the same C11 fence an aarch64 host runs
    finally:
        memory_fence.cache_clear()
