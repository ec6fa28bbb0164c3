"""A read from a stopped server (SIGSTOP), cancelled by its engine, ends at once and
lands nothing in its blocks when the server goes on (issue #29, bounded
synchronous loads).

P's agent runs in a child process this test stops; D's in another. D's read is a
same-host copy that must ask P first (P's grant board off: a stopped P never
answers with its go) or a direct read over UCX (receives posted into D's
blocks, P never sends). D cancels it (``TransferAgent.cancel_reads``), zeroes the
blocks (what D would recompute into them), P is resumed and serves the read it
was asked for, and D's blocks stay zero; then D reads again from P.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator

import pytest
import torch

from tests.transfer.agent_proc import AgentRef, Host, Spec, host_pair
from tests.waiting import wait_until

BLOCKS = [3, 9, 4, 12]
LOCAL = [0, 1, 2, 3]
#: Generous: a loaded machine may starve the loop (the engine's own bound is 2 s).
QUIESCE_S = 10.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    with host_pair() as pair:
        yield pair


def read(d: AgentRef, p: AgentRef, request_id: str, grant: str, remote: list[int],
         local: list[int]) -> None:
    d.call("read", request_id=request_id, engine_id=p.spec.engine_id, host="127.0.0.1",
           port=p.port, remote_block_ids=remote, local_block_ids=local, grant=grant,
           num_tokens=16 * len(remote))


def outcome(d: AgentRef, request_id: str) -> tuple[bool, str]:
    def ended() -> bool:
        _, recving, failed, stats = d.call("poll")
        d.finished |= recving
        d.failed.update(failed)
        d.stats.extend(stats)
        return request_id in d.finished

    wait_until(ended, 30.0, message=f"read {request_id} to end")
    [stats] = [s for s in d.stats if s.request_id == request_id]
    return stats.ok, stats.error


def blocks(agent: AgentRef, ids: list[int]) -> list[torch.Tensor]:
    return [layer[:, ids].clone() for layer in agent.call("caches")]


@pytest.mark.parametrize("same_host", [True, False], ids=["same_host_copy", "direct_ucx"])
def test_a_read_from_a_stopped_p_is_cancelled_and_lands_nothing_later(
    hosts: tuple[Host, Host], same_host: bool
) -> None:
    p_host, d_host = hosts
    kind = "copy" if same_host else "direct"
    p = p_host.add(Spec(f"p-{kind}", seed=5, config={"grant_board": False}))
    d = d_host.add(Spec(f"d-{kind}", seed=-1, config={"local_copy": same_host}))
    grant = secrets.token_urlsafe(16)
    p.call("issue", "warm", [1], 1, 30.0, grant)
    read(d, p, "warm", grant, [1], [20])  # the link and its handshake are up
    assert outcome(d, "warm")[0]

    grant = secrets.token_urlsafe(16)
    p.call("issue", "late", BLOCKS, 1, 30.0, grant)
    os.kill(p_host.process.pid, signal.SIGSTOP)
    try:
        read(d, p, "late", grant, BLOCKS, LOCAL)
        assert d.call("cancel", ["late"], QUIESCE_S) == {"late"}  # P still stopped
        ok, error = outcome(d, "late")
        assert not ok and "ReadCancelledError" in error, error
        assert d.failed["late"] == set(LOCAL)
        d.call("zero")  # what D recomputes into them
    finally:
        os.kill(p_host.process.pid, signal.SIGCONT)
    # P serves what it was asked for while stopped, to a reader that gave up, and
    # releases the grant once that read ended (D said it gave up)
    wait_until(lambda: p.call("counters"), 30.0,
               until=lambda c: c.num_serving_reads == 0 and c.num_copy_holds == 0
               and c.num_grants == 0,
               message="P to serve the cancelled read and let its grant go")
    if not same_host:  # its chunks came, found no receive, and were dropped
        assert p.call("counters").num_data_bytes_sent > 0
        wait_until(lambda: d.call("counters").num_ucx_stray_dropped, 30.0,
                   message="D to drop the chunks of the cancelled read")
    assert all(bool((layer == 0).all()) for layer in blocks(d, LOCAL))

    grant = secrets.token_urlsafe(16)
    p.call("issue", "next", BLOCKS, 1, 30.0, grant)
    read(d, p, "next", grant, BLOCKS, LOCAL)
    assert outcome(d, "next")[0]
    assert all(torch.equal(mine, theirs)
               for mine, theirs in zip(blocks(d, LOCAL), blocks(p, BLOCKS), strict=True))
