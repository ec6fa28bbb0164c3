"""Real UCX reads between agents over fused K/V caches (vLLM CPU), and per-rank port lists.

P's agents live in one child process, D's in another (``agent_proc.py``). After
a read, D's blocks must equal P's byte for byte: a fused block keeps K
transposed, so only whole blocks moved as they are will do, through every path
(direct into D's blocks, same-host copies, staged through pack/unpack) and with
heads split differently over TP ranks. What cannot be moved exactly (another
block size, a non-fused peer, a read starting inside a block) fails the read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.integration.reads import close_engine, issue, wait_read, wait_released
from tests.ports import free_port_base
from tests.transfer.agent_proc import AgentRef, Host, Spec, host_pair

pytestmark = pytest.mark.integration

BLOCK = 32
P_BLOCKS, D_BLOCKS = [9, 2, 14, 7], [1, 5, 3, 12]
NUM_TOKENS = 3 * BLOCK + 5  # the last block holds 5 tokens; it moves whole all the same

MODES: dict[str, dict[str, Any]] = {
    "copy": {"local_copy_min_nbytes": 0},  # same host: D copies out of P's memory
    "ucx": {"local_copy": False},  # direct, block memory to block memory over UCX
    "staged": {"direct_reads": False},  # packed, sent, unpacked
}


FUSED = Spec("", layout="HND", block_size=BLOCK, num_kv_heads=4, head_dim=16, num_layers=3,
             num_blocks=16, fused=True)


def fused_spec(engine_id: str, **kwargs: Any) -> Spec:
    """A rank of a small engine with fused caches (``fused=False``: plain HND ones)."""
    return replace(FUSED, engine_id=engine_id, **kwargs)


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    with host_pair() as pair:
        yield pair


def start_engine(host: Host, spec: Spec, *, any_port: bool = False) -> list[AgentRef]:
    """All ranks of ``spec``: on consecutive ports, or (``any_port``) each on any free one."""
    base = None if any_port else free_port_base(spec.tp_size)
    return [host.add(replace(spec, tp_rank=rank, port=0 if base is None else base + rank))
            for rank in range(spec.tp_size)]


def read(d_engine: list[AgentRef], p_engine: list[AgentRef], request_id: str, token: str,
         *, port: int | list[int] | None = None, first_token: int = 0,
         num_tokens: int = NUM_TOKENS) -> None:
    for agent in d_engine:
        agent.call(
            "read", request_id=request_id, engine_id=p_engine[0].spec.engine_id,
            host="127.0.0.1", port=p_engine[0].port if port is None else port,
            remote_block_ids=P_BLOCKS, local_block_ids=D_BLOCKS, grant=token,
            num_tokens=num_tokens - first_token, first_token=first_token,
        )


def blocks(engine: list[AgentRef], block_ids: list[int]) -> torch.Tensor:
    """The engine's blocks, all layers, heads of all ranks in rank order, as raw int16.

    Fused: ``[layers, blocks, heads, block_size, 2 * head_dim]``, each head's
    K^T | V run. Plain: ``[layers, 2, blocks, heads, block_size, head_dim]``.
    """
    fused = engine[0].spec.fused
    ranks = [torch.stack(agent.call("caches")) for agent in engine]
    picked = [rank[:, block_ids] if fused else rank[:, :, block_ids] for rank in ranks]
    return torch.cat(picked, dim=2 if fused else 3).view(torch.int16)


def outcomes(d_engine: list[AgentRef], request_id: str) -> list[dict[str, Any]]:
    return [wait_read(agent, request_id) for agent in d_engine]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize(("p_tp", "d_tp", "num_kv_heads"),
                         [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 1, 2), (1, 2, 2)])
def test_fused_blocks_arrive_byte_for_byte(
    hosts: tuple[Host, Host], mode: str, p_tp: int, d_tp: int, num_kv_heads: int,
) -> None:
    name = f"{mode}-{p_tp}{d_tp}{num_kv_heads}"
    p_engine = start_engine(hosts[0], fused_spec(f"p-{name}", tp_size=p_tp, seed=p_tp + d_tp,
                                                 num_kv_heads=num_kv_heads))
    d_engine = start_engine(hosts[1], fused_spec(f"d-{name}", tp_size=d_tp, seed=-1,
                                                 num_kv_heads=num_kv_heads, config=MODES[mode]))
    try:
        token = issue(p_engine, "req", P_BLOCKS, max(1, d_tp // p_tp))
        read(d_engine, p_engine, "req", token)
        for outcome in outcomes(d_engine, "req"):
            assert outcome["failed"] == set(), outcome["stats"]
            [stats] = outcome["stats"]
            assert stats.ok and stats.num_remote_ranks == max(1, p_tp // d_tp)
            assert stats.num_direct == (0 if mode == "staged" else stats.num_remote_ranks)
            assert stats.num_local_copies == (stats.num_direct if mode == "copy" else 0)
        assert torch.equal(blocks(d_engine, D_BLOCKS), blocks(p_engine, P_BLOCKS))
        for agent in p_engine:
            wait_released(agent, "req")
            stats, num_live = agent.call("grant_stats")
            assert (stats.num_released_done, num_live) == (1, 0)
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_read_from_a_block_boundary_leaves_the_blocks_before_alone(
    hosts: tuple[Host, Host], mode: str,
) -> None:
    p_engine = start_engine(hosts[0], fused_spec(f"p-hit-{mode}", tp_size=2, seed=5))
    d_engine = start_engine(hosts[1], fused_spec(f"d-hit-{mode}", seed=-1, config=MODES[mode]))
    try:
        token = issue(p_engine, "req", P_BLOCKS, 1)
        read(d_engine, p_engine, "req", token, first_token=BLOCK)  # D holds block 0 itself
        [outcome] = outcomes(d_engine, "req")
        assert outcome["failed"] == set(), outcome["stats"]
        assert torch.equal(blocks(d_engine, D_BLOCKS[1:]), blocks(p_engine, P_BLOCKS[1:]))
        assert not blocks(d_engine, D_BLOCKS[:1]).any()
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


def assert_failed(d_engine: list[AgentRef], request_id: str, *texts: str) -> None:
    """The read failed on every D rank, all its blocks reported, nothing written."""
    for outcome in outcomes(d_engine, request_id):
        assert outcome["failed"] == set(D_BLOCKS), outcome["stats"]
        [stats] = outcome["stats"]
        assert not stats.ok
        for text in texts:
            assert text in stats.error, stats.error
    assert not blocks(d_engine, D_BLOCKS).any()


@pytest.mark.parametrize("mode", ["copy", "staged"])
def test_another_block_size_is_refused(hosts: tuple[Host, Host], mode: str) -> None:
    p_engine = start_engine(hosts[0], fused_spec(f"p-bs-{mode}", block_size=64, seed=6))
    d_engine = start_engine(hosts[1], fused_spec(f"d-bs-{mode}", seed=-1, config=MODES[mode]))
    try:
        token = issue(p_engine, "req", P_BLOCKS[:2], 1)
        read(d_engine, p_engine, "req", token)
        assert_failed(d_engine, "req", "IncompatibleTopologyError",
                      "equal block sizes: local 32, remote 64", "--block-size")
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


@pytest.mark.parametrize("p_fused", [True, False])
def test_fused_and_plain_caches_are_refused(
    hosts: tuple[Host, Host], p_fused: bool,
) -> None:
    p_engine = start_engine(hosts[0], fused_spec(f"p-mix-{p_fused}", fused=p_fused, seed=7))
    d_engine = start_engine(hosts[1], fused_spec(f"d-mix-{p_fused}", fused=not p_fused, seed=-1))
    try:
        token = issue(p_engine, "req", P_BLOCKS, 1)
        read(d_engine, p_engine, "req", token)
        assert_failed(d_engine, "req", "RejectedError", "compat")
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


def test_a_read_starting_inside_a_block_is_refused(hosts: tuple[Host, Host]) -> None:
    p_engine = start_engine(hosts[0], fused_spec("p-mid", seed=8))
    d_engine = start_engine(hosts[1], fused_spec("d-mid", seed=-1, config=MODES["staged"]))
    try:
        token = issue(p_engine, "req", P_BLOCKS, 1)
        read(d_engine, p_engine, "req", token, first_token=BLOCK + 3)
        [outcome] = outcomes(d_engine, "req")
        assert outcome["failed"] == set(D_BLOCKS[1:]), outcome["stats"]  # from token 35 on
        [stats] = outcome["stats"]
        assert "first token 35 is inside a block of 32 tokens" in stats.error, stats.error
        assert not blocks(d_engine, D_BLOCKS).any()
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


def test_a_per_rank_port_list_reaches_ranks_on_any_ports(
    hosts: tuple[Host, Host],
) -> None:
    p_engine = start_engine(hosts[0], fused_spec("p-ports", tp_size=2, seed=9), any_port=True)
    d_engine = start_engine(hosts[1], fused_spec("d-ports", seed=-1))
    ports = [agent.port for agent in p_engine]
    try:
        token = issue(p_engine, "req", P_BLOCKS, 1)
        read(d_engine, p_engine, "req", token, port=ports)
        [outcome] = outcomes(d_engine, "req")
        assert outcome["failed"] == set(), outcome["stats"]
        assert torch.equal(blocks(d_engine, D_BLOCKS), blocks(p_engine, P_BLOCKS))
        # a done notice with the list reaches every rank too: both free at once
        token = issue(p_engine, "unneeded", [4, 5], 1)
        d_engine[0].call("notify", {"request_id": "unneeded", "engine_id": "p-ports",
                                    "host": "127.0.0.1", "port": ports, "grant": token})
        for agent in p_engine:
            wait_released(agent, "unneeded")
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


def test_a_port_list_too_short_fails_the_read(hosts: tuple[Host, Host]) -> None:
    p_engine = start_engine(hosts[0], fused_spec("p-short", tp_size=2, seed=10), any_port=True)
    d_engine = start_engine(hosts[1], fused_spec("d-short", seed=-1))
    try:
        token = issue(p_engine, "req", P_BLOCKS, 1)
        read(d_engine, p_engine, "req", token, port=[p_engine[0].port])
        [outcome] = outcomes(d_engine, "req")
        assert outcome["failed"] == set(D_BLOCKS), outcome["stats"]
        [stats] = outcome["stats"]
        assert "MissingPortError" in stats.error and "needs rank 1" in stats.error, stats.error
        # the agent goes on: a read with the whole list lands
        token = issue(p_engine, "again", P_BLOCKS, 1)
        read(d_engine, p_engine, "again", token, port=[agent.port for agent in p_engine])
        [outcome] = outcomes(d_engine, "again")
        assert outcome["failed"] == set(), outcome["stats"]
        assert torch.equal(blocks(d_engine, D_BLOCKS), blocks(p_engine, P_BLOCKS))
    finally:
        close_engine(p_engine)
        close_engine(d_engine)


@pytest.mark.parametrize(("case", "ports"), [("empty", []), ("zero", [0, 5601]),
                                             ("too_big", [70000]), ("text", ["5600"])])
def test_a_port_list_that_names_no_ports_is_refused_at_once(
    hosts: tuple[Host, Host], case: str, ports: list[Any],
) -> None:
    [reader] = start_engine(hosts[1], fused_spec(f"d-bad-{case}", seed=-1))
    try:
        with pytest.raises(RuntimeError, match="per-rank port list must be non-empty ints"):
            reader.call("read", request_id="req", engine_id="p", host="127.0.0.1", port=ports,
                        remote_block_ids=P_BLOCKS, local_block_ids=D_BLOCKS, grant="g" * 16,
                        num_tokens=NUM_TOKENS)
        assert reader.call("poll")[1:3] == (set(), {})  # nothing started
    finally:
        close_engine([reader])
