"""Drive agents in child processes through a read: issue a grant, read it, wait for both ends.

Shared by the multi-process transfer tests (``tests/integration/test_transfer_*.py``,
``test_local_copy.py``, ``test_fused_kv_reads.py``) and the fault tests
(``tests/faults/``). The agents are :class:`AgentRef` s of ``tests/transfer/agent_proc.py``;
an "engine" is the list of one engine's ranks.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from tests.ports import free_port_base
from tests.transfer.agent_proc import AgentRef, Host, Spec
from tests.waiting import wait_until


def start_engine(host: Host, spec: Spec) -> list[AgentRef]:
    """One agent per TP rank of ``spec`` in ``host``, on consecutive free ports."""
    base = free_port_base(spec.tp_size)
    return [host.add(replace(spec, tp_rank=r, port=base + r)) for r in range(spec.tp_size)]


def close_engine(engine: list[AgentRef]) -> None:
    for agent in engine:
        agent.call("close")


def issue(engine: list[AgentRef], request_id: str, blocks: list[int], num_readers: int) -> str:
    """Issue one grant for ``blocks`` on every rank of ``engine``; returns its token."""
    token = secrets.token_urlsafe(16)
    for agent in engine:
        assert agent.call("issue", request_id, blocks, num_readers, None, token) == token
    return token


def read(
    d_engine: list[AgentRef], p_engine: list[AgentRef], request_id: str, token: str,
    p_blocks: list[int], d_blocks: list[int], num_tokens: int,
) -> None:
    """Start the read of ``p_blocks`` into ``d_blocks`` on every rank of ``d_engine``."""
    for agent in d_engine:
        agent.call(
            "read", request_id=request_id, engine_id=p_engine[0].spec.engine_id,
            host="127.0.0.1", port=p_engine[0].port, remote_block_ids=p_blocks,
            local_block_ids=d_blocks, grant=token, num_tokens=num_tokens,
        )


def wait_read(reader: AgentRef, request_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll ``reader`` until its read ``request_id`` ended.

    Returns:
        ``{"failed": the read's failed local block ids, "stats": its TransferStats}``.
    """

    def finished() -> bool:
        _, recving, failed, stats = reader.call("poll")
        reader.finished |= recving
        reader.failed.update(failed)
        reader.stats.extend(stats)
        return request_id in reader.finished

    wait_until(finished, timeout_s, message=f"read {request_id} to finish",
               describe=lambda _: f"finished {sorted(reader.finished)}, failed {reader.failed}")
    mine = [s for s in reader.stats if s.request_id == request_id]
    return {"failed": reader.failed.get(request_id, set()), "stats": mine}


def wait_released(server: AgentRef, request_id: str, timeout_s: float = 10.0) -> None:
    """Poll ``server`` until it reported the grant of ``request_id`` released."""

    def released() -> bool:
        sending, _, _, _ = server.call("poll")
        server.released |= sending
        return request_id in server.released

    wait_until(released, timeout_s, message=f"grant of {request_id} to be released",
               describe=lambda _: f"released {sorted(server.released)}")
