"""The grant board (``kvbridge.transfer.protocol.grant_board``): slots, sequence numbers, lookups.

Lookups here read the board's bytes in this process; ``test_local_copy.py`` reads
one in another process through ``CopySource`` like a reader does.
"""

from __future__ import annotations

import math
import time

import pytest

from kvbridge.transfer.clock import ManualClock
from kvbridge.transfer.protocol.grant_board import (
    MAX_BLOCKS,
    SLOT_NBYTES,
    WINDOW,
    BoardSpot,
    GrantBoard,
    find_grant,
    grant_digest,
    home_slot,
)
from kvbridge.transfer.serving.grants import GrantTable

TOKEN = "tok-" + "a" * 18
PROMPT = b"p" * 32


PLACE = 5  # where the caches are, as the boards here are told


def look(board: GrantBoard, token: str, blocks: list[int], prompt: bytes = b"",
         now: float = 0.0, place: int = PLACE) -> BoardSpot | None:
    """What a reader finds: the token's window copied out of the board."""
    home = home_slot(grant_digest(token), board.num_slots)
    window = board._buf[home * SLOT_NBYTES : (home + WINDOW) * SLOT_NBYTES].tobytes()
    return find_grant(window, 0, board.address + home * SLOT_NBYTES, grant_digest(token),
                      blocks, prompt, now, place)


def new_board(num_slots: int = 64) -> GrantBoard:
    return GrantBoard(lambda: PLACE, num_slots)


def seq_at(board: GrantBoard, spot: BoardSpot) -> int:
    offset = spot.seq_address - board.address
    return int(board._buf[offset : offset + 8].view("<u8")[0])


def test_a_published_grant_allows_its_blocks_and_nothing_else() -> None:
    board = new_board()
    assert board.publish(TOKEN, [7, 3, 9], 30.0, None)
    spot = look(board, TOKEN, [3, 9])
    assert spot is not None and spot.seq % 2 == 0 and seq_at(board, spot) == spot.seq
    assert look(board, TOKEN, [7, 3, 9, 4]) is None  # a block outside the grant
    assert look(board, "tok-" + "b" * 18, [3]) is None  # another token
    assert look(board, TOKEN, [3], now=1e12) is None  # past the deadline
    assert look(board, TOKEN, [3], prompt=PROMPT) is not None  # unbound: any prompt
    assert look(board, TOKEN, [3], place=6) is None  # the go's origins are from elsewhere
    assert look(board, TOKEN, [3], place=0) is None  # a go that did not say


def test_grants_published_before_the_caches_moved_come_off_the_board() -> None:
    place = [PLACE]
    board = GrantBoard(lambda: place[0], 64)
    board.publish(TOKEN, [1], 30.0, None)
    assert board.withdraw_moved() == 0 and look(board, TOKEN, [1]) is not None
    place[0] = 7  # a cache tensor moved
    board.publish("tok-" + "d" * 18, [2], 30.0, None)  # published after the move
    assert board.withdraw_moved() == 1
    assert look(board, TOKEN, [1]) is None
    assert look(board, "tok-" + "d" * 18, [2], place=7) is not None


def test_a_prompt_bound_grant_needs_the_same_prompt() -> None:
    board = new_board()
    board.publish(TOKEN, [1, 2], 30.0, PROMPT)
    assert look(board, TOKEN, [1], prompt=PROMPT) is not None
    assert look(board, TOKEN, [1], prompt=b"q" * 32) is None
    assert look(board, TOKEN, [1]) is None  # a reader that names no prompt


def test_withdraw_changes_the_seq_before_anything_else_and_a_reuse_never_repeats_it() -> None:
    board = new_board(1)  # one window: every token shares it
    board.publish(TOKEN, [1], 30.0, None)
    spot = look(board, TOKEN, [1])
    assert spot is not None
    board.withdraw(TOKEN)
    assert seq_at(board, spot) == spot.seq + 1  # odd: a copy made meanwhile is dropped
    assert look(board, TOKEN, [1]) is None
    board.withdraw(TOKEN)  # idempotent
    other = "tok-" + "c" * 18
    board.publish(other, [1], 30.0, None)  # the same slot, reused
    again = look(board, other, [1])
    assert again is not None and again.seq_address == spot.seq_address
    assert again.seq > spot.seq + 1


def test_renew_moves_the_deadline_without_touching_the_seq() -> None:
    board = new_board()
    board.publish(TOKEN, [5], 0.5, None)
    spot = look(board, TOKEN, [5])
    assert spot is not None
    board.renew(TOKEN, 1e6)
    later = look(board, TOKEN, [5], now=1e5)  # monotonic time far past the first deadline
    assert later == spot


def test_what_does_not_fit_stays_off_the_board() -> None:
    board = new_board(1)
    assert not board.publish(TOKEN, list(range(MAX_BLOCKS + 1)), 30.0, None)
    assert not board.publish(TOKEN, [1 << 32], 30.0, None)
    tokens = [f"tok-{i:018d}" for i in range(WINDOW + 1)]
    placed = [board.publish(t, [i], 30.0, None) for i, t in enumerate(tokens)]
    assert placed == [True] * WINDOW + [False]  # the window is full
    assert look(board, tokens[-1], [WINDOW]) is None
    assert len(board) == WINDOW


def table_with_board(clock: ManualClock) -> tuple[GrantTable, GrantBoard]:
    table = GrantTable(clock, default_lease_s=10.0, max_lease_s=100.0)
    board = new_board()
    table.attach_board(board)
    return table, board


@pytest.mark.parametrize("end", ["done", "expired", "revoked"])
def test_the_table_takes_a_grant_off_the_board_when_its_release_is_decided(end: str) -> None:
    clock = ManualClock()
    table, board = table_with_board(clock)
    grant = table.issue("r", [4, 5], 1)
    assert look(board, grant.grant, [4, 5]) is not None
    table.begin_read(grant.grant, [4])  # an asked read pins it: the release waits
    if end == "done":
        table.reader_done(grant.grant, "d:0")
    elif end == "expired":
        clock.advance(11.0)
        table.expire()
    else:
        table.revoke("r")
    assert look(board, grant.grant, [4]) is None  # off at once, although still held
    assert table.drain_released() == []
    table.end_read(grant.grant)
    assert [r.reason for r in table.drain_released()] == [end]
    assert len(board) == 0


def test_a_grant_is_on_the_board_under_the_token_its_issuer_chose() -> None:
    """One token: the engine's, published as is, looked up and withdrawn by it."""
    table, board = table_with_board(ManualClock())
    chosen = "engine-chosen-token-xyz"
    table.issue("r", [2], 1, grant=chosen)
    assert look(board, chosen, [2]) is not None
    table.revoke("r")
    assert look(board, chosen, [2]) is None and len(board) == 0


def test_the_table_publishes_the_lease_and_renewals() -> None:
    clock = ManualClock()
    table, board = table_with_board(clock)
    grant = table.issue("r", [1], 1, lease_s=2.0, prompt_digest=PROMPT)
    spot = look(board, grant.grant, [1], prompt=PROMPT)
    assert spot is not None
    in_5s = time.monotonic() + 5.0  # the board's deadlines are monotonic seconds
    assert look(board, grant.grant, [1], prompt=PROMPT, now=in_5s) is None
    table.begin_read(grant.grant, [1])  # a lease is renewed only for a read in flight
    table.renew(grant.grant, 50.0, until=math.inf)
    table.end_read(grant.grant)
    assert look(board, grant.grant, [1], prompt=PROMPT, now=in_5s) == spot  # same seq
