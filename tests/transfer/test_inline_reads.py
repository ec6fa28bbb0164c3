"""Reads made on the caller's thread (``transfer/reading/inline.py``), two agents in this process.

A server and a reader ``TransferAgent`` in one process are on one host: the
reader copies out of its own process on the server's grant board's word. The
tests reach into the read (between the board's first look and the copy) to
revoke a grant or move the server's blocks, and check that the bytes are then
never kept on the board's word; and that what the board refuses lands nothing.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvbridge.transfer.agent import TransferAgent
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.host_memory import kv_cache_zeros
from kvbridge.transfer.reading import copy_source, inline
from kvbridge.transfer.reading.jobs import ReadStats
from tests.transfer.inproc import BLOCK_SIZE, COMPAT, TOPOLOGY, caches
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process_vm_readv is Linux's")

CONFIG = AgentConfig(reply_timeout_s=5.0, read_timeout_s=20.0, lease_s=30.0)
NOTHING_INLINE = "test_a_read_the_board_does_not_allow_copies_nothing"


def in_shared_memory(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies in memfds (``kv_cache_zeros``), which a reader maps and memmoves from."""
    copies = [kv_cache_zeros(tuple(t.shape), t.dtype, shared=True) for t in tensors]
    for copy, tensor in zip(copies, tensors, strict=True):
        copy.copy_(tensor)
    return copies


@pytest.fixture(params=["private", "shared"])
def agents(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[TransferAgent, TransferAgent, list[torch.Tensor], list[torch.Tensor]]]:
    """A server and a reader; caches in private memory (copied with
    ``process_vm_readv``) or shared (the reader maps the server's: memmove)."""
    server = TransferAgent("p-inline", TOPOLOGY, 0, 0, COMPAT, config=CONFIG)
    reader = TransferAgent("d-inline", TOPOLOGY, 0, 0, COMPAT, config=CONFIG)
    p_caches, d_caches = caches(3), caches(None)
    moves: list[int] = []
    if request.param == "shared":
        p_caches, d_caches = in_shared_memory(p_caches), in_shared_memory(d_caches)

        real_memmove = inline.memmove

        def memmove(ours: Any, theirs: Any, nbytes: Any) -> None:
            moves.append(nbytes.value)
            real_memmove(ours, theirs, nbytes)

        monkeypatch.setattr(inline, "memmove", memmove)
    server.register_kv_caches(p_caches)
    reader.register_kv_caches(d_caches)
    server.start()
    reader.start()
    try:
        yield server, reader, p_caches, d_caches
        # Shared caches were copied from our map of them (by every test whose board
        # allowed an inline read); private ones never.
        copied_inline = not request.node.name.startswith(NOTHING_INLINE)
        assert bool(moves) is (request.param == "shared" and copied_inline)
    finally:
        reader.close()
        server.close()


def read_now(server: TransferAgent, reader: TransferAgent, request_id: str, blocks: list[int],
             local: list[int]) -> tuple[set[str], ReadStats]:
    """Issue, ``start_read``, and what ``get_finished`` said right after it; then the stats."""
    token = server.issue_grant(request_id, blocks, 1).grant
    reader.start_read(request_id, engine_id="p-inline", host="127.0.0.1", port=server.port,
                      remote_block_ids=blocks, local_block_ids=local, grant=token,
                      num_tokens=BLOCK_SIZE * len(blocks))
    finished = set(reader.get_finished()[1])
    if request_id not in finished:
        wait_until(lambda: request_id in reader.get_finished()[1], 10.0,
                   message=f"read {request_id}")
    got: list[ReadStats] = []
    wait_until(lambda: bool(got.extend(reader.get_stats()) or got), 5.0, message="stats")
    [stats] = [s for s in got if s.request_id == request_id]
    return finished, stats


def same(p_caches: list[torch.Tensor], blocks: list[int], d_caches: list[torch.Tensor],
         local: list[int]) -> bool:
    return all(torch.equal(p[:, blocks], d[:, local]) for p, d in zip(p_caches, d_caches,
                                                                       strict=True))


def test_a_read_on_the_boards_word_is_made_in_start_read(agents: tuple) -> None:
    server, reader, p_caches, d_caches = agents
    read_now(server, reader, "link", [1, 2], [3, 4])  # opens the link on the loop
    for n, (blocks, local) in enumerate([([5, 9, 7], [10, 11, 12]), ([5, 9, 7], [10, 11, 12]),
                                         ([20, 1], [2, 30])]):
        p_caches[0][:, blocks] += 1  # new bytes between reads of the same blocks
        finished, stats = read_now(server, reader, f"now-{n}", blocks, local)
        assert f"now-{n}" in finished  # done by the time start_read returned
        assert stats.ok and (stats.num_direct, stats.num_local_copies) == (1, 1), stats
        assert same(p_caches, blocks, d_caches, local)
    wait_until(lambda: len(server.grants) == 0, 5.0, message="done reports")  # sent later
    assert server.counters().num_board_copies == 4


def test_done_reports_of_reads_back_to_back_all_reach_the_server(agents: tuple) -> None:
    """Inline reads' done reports go out in batches (the first at once, then every
    millisecond while more come): none is lost, every grant is released and its
    request reported done sending; a read after a pause is reported too."""
    server, reader, p_caches, d_caches = agents
    read_now(server, reader, "link", [1, 2], [3, 4])
    ids = [f"burst-{n}" for n in range(40)]
    for request_id in ids:
        token = server.issue_grant(request_id, [5, 6], 1).grant
        reader.start_read(request_id, engine_id="p-inline", host="127.0.0.1",
                          port=server.port, remote_block_ids=[5, 6], local_block_ids=[7, 8],
                          grant=token, num_tokens=2 * BLOCK_SIZE)
    sent: set[str] = set()
    wait_until(lambda: bool(sent.update(server.get_finished()[0])) or set(ids) <= sent, 10.0,
               message="done reports of the burst")
    assert len(server.grants) == 0
    assert same(p_caches, [5, 6], d_caches, [7, 8])
    time.sleep(0.05)  # the batches stopped; the next report wakes the loop again
    finished, stats = read_now(server, reader, "after-pause", [9], [10])
    assert "after-pause" in finished and stats.num_local_copies == 1
    wait_until(lambda: "after-pause" in server.get_finished()[0], 5.0, message="its report")


@pytest.mark.parametrize("what", ["revoked", "moved"])
def test_a_copy_whose_grant_changed_meanwhile_is_not_kept(
    agents: tuple, monkeypatch: pytest.MonkeyPatch, what: str,
) -> None:
    """Between the board's first look and the copy the server revokes the grant (its
    blocks go back) or its caches move: the seq read after the copy differs, the
    inline copy is dropped (and zeroed), and the read goes to the loop, which asks the
    server. A revoked grant is refused there (typed, blocks failed, nothing left in
    them); moved caches are copied from their new place."""
    server, reader, p_caches, d_caches = agents
    read_now(server, reader, "link", [1, 2], [3, 4])
    wait_until(lambda: len(server.grants) == 0, 5.0, message="link's done report")
    real_find = copy_source.find_grant
    changed: list[str] = []

    def find_then_change(*args: Any) -> Any:
        spot = real_find(*args)
        if spot is not None and not changed:  # the board said yes; the copy comes next
            changed.append(what)
            if what == "revoked":
                assert server.grants.revoke("changed")
            else:  # the board withdraws every grant published while the caches were elsewhere
                for n, layer in enumerate(p_caches):
                    p_caches[n] = layer.clone()
                    server._local.layers[n] = p_caches[n]  # type: ignore[union-attr]
                assert server.grants.refresh_board() == 1
        return spot

    monkeypatch.setattr(copy_source, "find_grant", find_then_change)
    _, stats = read_now(server, reader, "changed", [6, 8], [12, 13])
    # Not kept inline: a revoked grant fails the read and moved caches are read on the
    # server's go, not counted as a copy on the board's word (below). Whether the read
    # was done when start_read returned says nothing: the loop may already have heard
    # the server's answer by the time get_finished is called (a loaded machine).
    assert changed == [what]
    if what == "revoked":
        assert not stats.ok and "RejectedError" in stats.error, stats
        assert reader.get_failed_block_ids() == {"changed": {12, 13}}
        # the copy made before the revoke was noticed is not left behind
        assert not any(layer[:, [12, 13]].any() for layer in d_caches)
    else:
        assert stats.ok, stats
        assert same(p_caches, [6, 8], d_caches, [12, 13])
    assert server.counters().num_board_copies == 1  # "link" only


def test_prepared_copies_follow_the_servers_go(agents: tuple) -> None:
    """A read repeated with the same blocks reuses its prepared ranges; they are kept per
    link, so a reader of two servers never copies from one where the other's go said."""
    server, reader, p_caches, d_caches = agents
    other = TransferAgent("p-other", TOPOLOGY, 0, 0, COMPAT, config=CONFIG)
    o_caches = caches(9)
    other.register_kv_caches(o_caches)
    other.start()
    try:
        for agent, data in [(server, p_caches), (other, o_caches), (server, p_caches)]:
            for n in range(2):
                token = agent.issue_grant(f"{agent.engine_id}-{n}-{time.monotonic()}",
                                          [3, 4], 1)
                reader.start_read(token.request_id, engine_id=agent.engine_id,
                                  host="127.0.0.1", port=agent.port, remote_block_ids=[3, 4],
                                  local_block_ids=[5, 6], grant=token.grant,
                                  num_tokens=2 * BLOCK_SIZE)
                wait_until(lambda rid=token.request_id: rid in reader.get_finished()[1], 10.0,
                           message="read")
                assert reader.get_failed_block_ids() == {}
                assert same(data, [3, 4], d_caches, [5, 6])
    finally:
        other.close()
    assert np.sum([s.num_local_copies for s in reader.get_stats()]) == 6


@pytest.mark.parametrize("case", ["prompt", "outside"])
def test_a_read_the_board_does_not_allow_copies_nothing(agents: tuple, case: str) -> None:
    """The board is read before a byte is copied: a read naming another prompt, or a
    block outside its grant, leaves our blocks as they were (and the server refuses it)."""
    server, reader, _, d_caches = agents
    read_now(server, reader, "link", [1, 2], [3, 4])
    granted = b"the granted prompt"
    token = server.issue_grant("bound", [6, 8], 1, prompt_digest=granted).grant
    blocks, prompt = ([6, 8], b"another prompt") if case == "prompt" else ([6, 9], granted)
    reader.start_read("bound", engine_id="p-inline", host="127.0.0.1", port=server.port,
                      remote_block_ids=blocks, local_block_ids=[12, 13], grant=token,
                      num_tokens=2 * BLOCK_SIZE, prompt_digest=prompt)
    wait_until(lambda: "bound" in reader.get_finished()[1], 10.0, message="read")
    assert reader.get_failed_block_ids() == {"bound": {12, 13}}
    assert not any(layer[:, [12, 13]].any() for layer in d_caches)


def test_copies_of_a_dead_link_are_forgotten_when_a_new_link_copies(agents: tuple) -> None:
    """A prepared copy holds its link and, through it, the maps of that server's caches:
    once the server is gone, the next new link's first copy forgets them (a restarted
    server's old caches are not kept mapped by the reader)."""
    server, reader, p_caches, d_caches = agents
    inline_reader = reader._running.reads._inline  # type: ignore[union-attr]
    first = TransferAgent("p-first", TOPOLOGY, 0, 0, COMPAT, config=CONFIG)
    first.register_kv_caches(caches(5))
    first.start()
    try:
        for n in range(2):  # the link's first read opens it, the second is made inline
            token = first.issue_grant(f"first-{n}", [3], 1)
            reader.start_read(token.request_id, engine_id="p-first", host="127.0.0.1",
                              port=first.port, remote_block_ids=[3], local_block_ids=[4],
                              grant=token.grant, num_tokens=BLOCK_SIZE)
            wait_until(lambda rid=token.request_id: rid in reader.get_finished()[1], 10.0,
                       message="read")
        assert {p.link.peer for p in inline_reader._prepared.values()} == {
            f"127.0.0.1:{first.port}"}
    finally:
        first.close()
    wait_until(lambda: not any(p.link.alive for p in inline_reader._prepared.values()), 10.0,
               message="the link to see its server gone")
    for n in range(2):
        read_now(server, reader, f"next-{n}", [1], [2])
    assert all(p.link.alive for p in inline_reader._prepared.values())
    assert len(inline_reader._prepared) == 1


def board_maps(inode: int) -> int:
    """Maps of the memfd ``inode`` in this process (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        return sum(line.split()[4] == str(inode) for line in maps)


def test_a_server_gone_for_good_is_let_go_once_another_is_read_from(agents: tuple) -> None:
    """A server that dies and comes back as another engine (vLLM makes up a new engine
    id at each start) leaves a link to an engine nobody will name again. The reader
    lets go of its map of the dead server's grant board (4 MiB of the dead server's
    memory, and its caches where they are mapped) once the link is seen dead, and of
    the link once it opens another."""
    server, reader, _, _ = agents
    reads = reader._running.reads  # type: ignore[union-attr]
    first = TransferAgent("p-gone", TOPOLOGY, 0, 0, COMPAT, config=CONFIG)
    first.register_kv_caches(caches(5))
    first.start()
    board = first.grants._board
    assert board is not None and board.fd >= 0
    inode = os.fstat(board.fd).st_ino
    try:
        for n in range(2):
            token = first.issue_grant(f"gone-{n}", [3], 1)
            reader.start_read(token.request_id, engine_id="p-gone", host="127.0.0.1",
                              port=first.port, remote_block_ids=[3], local_block_ids=[4],
                              grant=token.grant, num_tokens=BLOCK_SIZE)
            wait_until(lambda rid=token.request_id: rid in reader.get_finished()[1], 10.0,
                       message="read")
        assert board_maps(inode) == 2  # the server's own, and the reader's
    finally:
        first.close()
    del first, board
    gc.collect()
    assert board_maps(inode) == 1  # the reader's
    wait_until(lambda: not any(link.alive for key, link in reads._links._links.items()
                               if key[0] == "p-gone"), 10.0, message="the link to die")

    def board_let_go() -> bool:  # the link fails (and lets go) just after its
        gc.collect()  # connection is seen closed, on the agent's loop
        return board_maps(inode) == 0

    wait_until(board_let_go, 10.0, message="the dead server's board let go, its link dead")
    for n in range(2):  # a link to another server (its second read is made inline)
        read_now(server, reader, f"after-gone-{n}", [1], [2])
    assert [key for key in reads._links._links if key[0] == "p-gone"] == []
