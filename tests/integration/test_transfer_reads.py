"""Real UCX reads between agents in two processes on loopback; every byte checked.

Serving engines (P) live in one child process, reading engines (D) in another.
Each scenario compares what D holds after the read with P's tokens, as logical
``[layer, kv, token, head, dim]`` tensors, with ``torch.equal``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from tests.integration.reads import (
    close_engine,
    issue,
    read,
    start_engine,
    wait_read,
    wait_released,
)
from tests.transfer.agent_proc import AgentRef, Host, Spec, host_pair, logical

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    with host_pair() as pair:
        yield pair


def gather_logical(engine: list[AgentRef], block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """All ranks' tokens, heads concatenated in rank order (replicas: one copy each)."""
    spec = engine[0].spec
    parts = [logical(a.call("caches"), a.spec, block_ids, num_tokens) for a in engine]
    if spec.is_mla:
        return parts[0]
    if spec.tp_size > spec.num_kv_heads:
        step = spec.tp_size // spec.num_kv_heads
        parts = parts[::step]
    return torch.cat(parts, dim=3)


# Which scenarios read direct (block memory to block memory, no staging): same
# layout, block size and dtype, and the moved heads one run per block plane.
# Those not named *_ucx copy out of the server's process (same host, local_copy.py),
# at any size (COPY_ALL; by default only reads of a few MiB and up do).
COPY_ALL = {"local_copy_min_nbytes": 0}
DIRECT = {"mla_p2_to_d1", "hnd_p2_to_d1_direct", "hnd_p1_to_d2_direct", "nhd_same_chunked",
          "hnd_p2_to_d1_ucx", "nhd_same_chunked_ucx", "mla_p2_to_d1_ucx"}

SCENARIOS = {
    # P TP2 -> D TP1, NHD -> HND, P blocks of 16 -> D blocks of 32
    "p2_to_d1_relayout": (
        Spec("p-a", tp_size=2, seed=1),
        Spec("d-a", tp_size=1, layout="HND", block_size=32),
        16 * 7 + 5,
    ),
    # P TP1 -> D TP2, HND 32 -> NHD 16
    "p1_to_d2_relayout": (
        Spec("p-b", tp_size=1, layout="HND", block_size=32, seed=2),
        Spec("d-b", tp_size=2, layout="NHD", block_size=16),
        32 * 3 + 17,
    ),
    # MLA replicated on both P ranks: D reads one, notifies the other
    "mla_p2_to_d1": (
        Spec("p-c", tp_size=2, is_mla=True, seed=3),
        Spec("d-c", tp_size=1, is_mla=True, config=COPY_ALL),
        16 * 4,
    ),
    # 2 KV heads over P TP4 (each head on 2 ranks) -> D TP1
    "replicated_heads_p4_to_d1": (
        Spec("p-d", tp_size=4, num_kv_heads=2, seed=4),
        Spec("d-d", tp_size=1, num_kv_heads=2, layout="HND"),
        16 * 3 + 1,
    ),
    # HND both sides: each P rank's heads land at their offset in D's blocks
    "hnd_p2_to_d1_direct": (
        Spec("p-e", tp_size=2, layout="HND", seed=5),
        Spec("d-e", tp_size=1, layout="HND", config=COPY_ALL),
        16 * 5 + 3,
    ),
    # HND both sides: each D rank takes its half of P's heads
    "hnd_p1_to_d2_direct": (
        Spec("p-f", tp_size=1, layout="HND", seed=6),
        Spec("d-f", tp_size=2, layout="HND", config=COPY_ALL),
        16 * 6,
    ),
    # NHD both sides, all heads; tiny chunks: 3 messages of 3, 3 and 2 blocks
    "nhd_same_chunked": (
        Spec("p-g", tp_size=1, seed=7, config={"chunk_nbytes": 3 * 4 * 2 * 16 * 8 * 64 * 2}),
        Spec("d-g", tp_size=1, config={"chunk_nbytes": 3 * 4 * 2 * 16 * 8 * 64 * 2, **COPY_ALL}),
        16 * 7 + 9,
    ),
    # the direct ones again, through UCX (the reader copies nothing itself)
    "hnd_p2_to_d1_ucx": (
        Spec("p-e2", tp_size=2, layout="HND", seed=15),
        Spec("d-e2", tp_size=1, layout="HND", config={"local_copy": False}),
        16 * 5 + 3,
    ),
    "nhd_same_chunked_ucx": (
        Spec("p-g2", tp_size=1, seed=17, config={"chunk_nbytes": 3 * 4 * 2 * 16 * 8 * 64 * 2}),
        Spec("d-g2", tp_size=1, config={"chunk_nbytes": 3 * 4 * 2 * 16 * 8 * 64 * 2,
                                        "local_copy": False}),
        16 * 7 + 9,
    ),
    "mla_p2_to_d1_ucx": (
        Spec("p-c2", tp_size=2, is_mla=True, seed=13, config={"local_copy": False}),
        Spec("d-c2", tp_size=1, is_mla=True),
        16 * 4,
    ),
    # NHD both sides but D holds P's heads of two ranks: strided, so staged
    "nhd_p2_to_d1_staged": (
        Spec("p-h", tp_size=2, seed=8),
        Spec("d-h", tp_size=1),
        16 * 4 + 2,
    ),
    # the same blocks as nhd_same_chunked with direct reads switched off
    "nhd_same_forced_staged": (
        Spec("p-i", tp_size=1, seed=9),
        Spec("d-i", tp_size=1, config={"direct_reads": False}),
        16 * 7 + 9,
    ),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_read_matches_source(hosts: tuple[Host, Host], name: str) -> None:
    p_spec, d_spec, num_tokens = SCENARIOS[name]
    p_engine = start_engine(hosts[0], p_spec)
    d_engine = start_engine(hosts[1], replace(d_spec, seed=-1))
    try:
        p_blocks = [9, 2, 40, 7, 11, 63, 30, 31][: -(-num_tokens // p_spec.block_size)]
        d_blocks = [1, 5, 3, 60, 0, 8, 12, 13][: -(-num_tokens // d_spec.block_size)]
        num_readers = max(1, d_spec.tp_size // p_spec.tp_size)
        token = issue(p_engine, "req-1", p_blocks, num_readers)
        read(d_engine, p_engine, "req-1", token, p_blocks, d_blocks, num_tokens)
        for agent in d_engine:
            outcome = wait_read(agent, "req-1")
            assert outcome["failed"] == set(), outcome["stats"]
            assert all(s.ok and s.num_remote_ranks >= 1 for s in outcome["stats"])
            num_direct = sum(s.num_direct for s in outcome["stats"])
            assert (num_direct > 0) == (name in DIRECT), outcome["stats"]
            num_copies = sum(s.num_local_copies for s in outcome["stats"])
            assert num_copies == (num_direct if not name.endswith("_ucx") else 0)
        got = gather_logical(d_engine, d_blocks, num_tokens)
        want = gather_logical(p_engine, p_blocks, num_tokens)
        assert got.shape == want.shape
        assert torch.equal(got, want)
        for agent in p_engine:  # every expected reader reported: released once, as done
            wait_released(agent, "req-1")
            stats, num_live = agent.call("grant_stats")
            assert (stats.num_released_done, num_live) == (1, 0)
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


def test_wait_finished_sleeps_until_a_read_ends(hosts: tuple[Host, Host]) -> None:
    p_engine = start_engine(hosts[0], Spec("p-w", tp_size=1, seed=5))
    d_engine = start_engine(hosts[1], Spec("d-w", tp_size=1, seed=-1))
    [reader] = d_engine
    try:
        seconds, ready = reader.call("wait", 0.3)
        assert (ready, seconds >= 0.25) == (False, True)  # nothing in flight: times out
        token = issue(p_engine, "req-w", [3, 4], 1)
        read(d_engine, p_engine, "req-w", token, [3, 4], [7, 9], 32)
        seconds, ready = reader.call("wait", 20.0)
        assert ready and seconds < 20.0
        _, recving, failed, _ = reader.call("poll")
        assert recving == {"req-w"} and failed == {}
        seconds, ready = reader.call("wait", 0.2)  # taken: nothing ready any more
        assert not ready
        got = gather_logical(d_engine, [7, 9], 32)
        assert torch.equal(got, gather_logical(p_engine, [3, 4], 32))
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


def test_read_waits_for_a_grant_issued_after_it_arrives(hosts: tuple[Host, Host]) -> None:
    """D's read may reach P before P's engine step issues the grant (the token travels
    in the HTTP answer first): P holds the read, and the issue wakes it."""
    p_engine = start_engine(hosts[0], Spec("p-late", tp_size=1, seed=6))
    d_engine = start_engine(hosts[1], Spec("d-late", tp_size=1, seed=-1))
    try:
        token = secrets.token_urlsafe(16)
        read(d_engine, p_engine, "req-late", token, [8, 2], [4, 6], 32)
        time.sleep(0.3)
        assert p_engine[0].call("issue", "req-late", [8, 2], 1, None, token) == token
        outcome = wait_read(d_engine[0], "req-late")
        assert outcome["failed"] == set(), outcome["stats"]
        [stats] = outcome["stats"]
        assert stats.ok and stats.duration_s >= 0.3  # it did wait for the grant
        got = gather_logical(d_engine, [4, 6], 32)
        assert torch.equal(got, gather_logical(p_engine, [8, 2], 32))
    finally:
        close_engine(p_engine)
        close_engine(d_engine)
