"""A serving agent dies and comes back at the same port with another shape (agents only).

The agent-level twin of test_restart.py, without engines or HTTP, on loopback:
P's agent lives in a child process that is SIGKILLed. Two things must hold:

- the new agent can listen on the old port at once, although the old agent's
  connections sit in TIME_WAIT (UCX's listener must reuse the address);
- D, whose cached link to the old agent is dead but not known to be (its next
  heartbeat is a minute away), must not read with the old handshake's metadata:
  the new agent has another block size and layout. The read must handshake
  again, succeed, and deliver the new agent's bytes exactly.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import torch

from tests.integration.reads import issue, read, wait_read, wait_released
from tests.ports import free_port_base
from tests.transfer.agent_proc import AgentRef, Host, Spec, logical

pytestmark = pytest.mark.faults

# D would notice a dead idle link only after a minute (a ping); P forgets nothing.
QUIET = {"heartbeat_s": 60.0, "server_idle_timeout_s": 300.0, "chunk_timeout_s": 5.0,
         "reply_timeout_s": 5.0, "connect_timeout_s": 5.0, "handshake_timeout_s": 5.0}
NUM_TOKENS = 16 * 5 + 3


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    started: list[Host] = []
    try:
        yield started
    finally:
        for host in started:
            host.close()


def read_and_check(p: AgentRef, d: AgentRef, p_blocks: list[int], d_blocks: list[int]) -> None:
    request_id = f"req-{secrets.token_hex(4)}"
    token = issue([p], request_id, p_blocks, 1)
    read([d], [p], request_id, token, p_blocks, d_blocks, NUM_TOKENS)
    outcome = wait_read(d, request_id)
    assert outcome["failed"] == set(), outcome["stats"]
    got = logical(d.call("caches"), d.spec, d_blocks, NUM_TOKENS)
    want = logical(p.call("caches"), p.spec, p_blocks, NUM_TOKENS)
    assert torch.equal(got, want)
    wait_released(p, request_id)


def test_agent_restarted_at_same_port_is_handshaken_again(hosts: list[Host]) -> None:
    port = free_port_base(1)
    hosts += [Host(), Host()]
    old_p_host, d_host = hosts
    p = old_p_host.add(Spec("p-restart", port=port, block_size=16, layout="NHD", seed=5,
                            config=QUIET))
    d = d_host.add(Spec("d-restart", port=free_port_base(1), block_size=16, layout="HND",
                        seed=-1, config=QUIET))
    read_and_check(p, d, [4, 9, 2, 30, 7, 11], [3, 1, 8, 20, 6, 5])

    old_p_host.kill()  # no goodbye: D's link to it stays cached, looking alive
    new_p_host = Host()
    hosts.append(new_p_host)
    # same engine id and port, another block size and layout (and other bytes)
    new_p = new_p_host.add(Spec("p-restart", port=port, block_size=32, layout="HND", seed=6,
                                config=QUIET))
    assert new_p.port == port
    read_and_check(new_p, d, [12, 3, 40], [10, 11, 12, 13, 14, 15])
