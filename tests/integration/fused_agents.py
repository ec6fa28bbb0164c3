"""Transfer agents over fused K/V caches (vLLM's CPU layout) in a child process (test helper).

Like ``tests/transfer/agent_proc.py``, whose :class:`AgentRef` and polling helpers
work with these agents too, but the caches are laid out as vLLM's CPU attention
backend hands them to a connector: one ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` tensor per layer, all views of one storage. A spec with
``fused=False`` gives ordinary HND caches of the same model (to pair against).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from kvbridge.layout import KVLayout
from kvbridge.topology import EngineTopology
from kvbridge.transfer.config import AgentConfig
from kvbridge.transfer.security import CompatInfo
from tests.child_host import ChildHost, serve_commands
from tests.transfer.agent_proc import CALL_TIMEOUT_S, AgentRef

if TYPE_CHECKING:  # imported in the child only: the parent stays free of ucxx
    from kvbridge.transfer.agent import TransferAgent


@dataclass(frozen=True)
class FusedSpec:
    """One rank of an engine with fused (or, ``fused=False``, plain HND) caches."""

    engine_id: str
    tp_size: int = 1
    tp_rank: int = 0
    port: int = 0
    block_size: int = 32
    num_kv_heads: int = 4
    head_size: int = 16
    num_layers: int = 3
    num_blocks: int = 16
    fused: bool = True
    seed: int = 0  # < 0: zeros
    config: dict[str, Any] = field(default_factory=dict)

    def topology(self) -> EngineTopology:
        return EngineTopology(
            tp_size=self.tp_size, pp_size=1, block_size=self.block_size,
            num_kv_heads=self.num_kv_heads, is_mla=False, layout=KVLayout.HND,
            num_layers=self.num_layers, fused_kv=self.fused,
        )

    def compat(self) -> CompatInfo:
        return CompatInfo("tiny", "bfloat16", num_kv_heads=self.num_kv_heads,
                          head_dim=self.head_size, num_layers=self.num_layers,
                          layout=KVLayout.HND, block_size=self.block_size, is_mla=False,
                          fused_kv=self.fused)


def make_caches(spec: FusedSpec) -> list[torch.Tensor]:
    """This rank's per-layer caches, views of one storage, seeded random bf16 (or zeros)."""
    heads = spec.topology().num_heads_per_rank
    if spec.fused:  # vLLM CPU: per block and head, K^T [D, B] then V [B, D]
        shape: tuple[int, ...] = (spec.num_blocks, heads, spec.block_size, 2 * spec.head_size)
    else:
        shape = (2, spec.num_blocks, heads, spec.block_size, spec.head_size)
    if spec.seed < 0:
        store = torch.zeros((spec.num_layers, *shape), dtype=torch.bfloat16)
    else:
        gen = torch.Generator().manual_seed(spec.seed * 1000 + spec.tp_rank)
        store = torch.randn((spec.num_layers, *shape), generator=gen).to(torch.bfloat16)
    return list(store.unbind(0))


def _child(conn: Connection) -> None:
    import logging

    from kvbridge.transfer.agent import TransferAgent

    logging.basicConfig(level=logging.WARNING)
    agents: dict[str, tuple[TransferAgent, list[torch.Tensor]]] = {}

    def handle(cmd: str, name: str, args: Any) -> Any:
        if cmd == "add":
            spec: FusedSpec = args
            agent = TransferAgent(spec.engine_id, spec.topology(), spec.tp_rank, 0,
                                  spec.compat(), port=spec.port, config=AgentConfig(**spec.config))
            caches = make_caches(spec)
            agent.register_kv_caches(caches)
            agents[name] = (agent, caches)
            return agent.start()
        agent, caches = agents[name]
        if cmd == "issue":  # (request_id, block_ids, num_readers, lease_s, token)
            request_id, block_ids, num_readers, lease_s, token = args
            return agent.issue_grant(request_id, block_ids, num_readers, lease_s=lease_s,
                                     token=token).token
        if cmd == "read":
            agent.start_read(**args)
            return None
        if cmd == "notify":
            agent.notify_done(**args[0])
            return None
        if cmd == "poll":
            sending, recving = agent.get_finished()
            return sending, recving, agent.get_failed_block_ids(), agent.get_stats()
        if cmd == "caches":
            return caches
        if cmd == "grant_stats":
            return agent.grants.stats(), len(agent.grants)
        if cmd == "close":
            agent.close()
            del agents[name]
            return None
        raise ValueError(cmd)

    def close_all() -> None:
        for agent, _ in agents.values():
            agent.close()

    serve_commands(conn, handle, close_all)


class FusedHost(ChildHost):
    """A child process hosting agents over fused (or plain HND) caches."""

    what = "fused agent host"
    call_timeout_s = CALL_TIMEOUT_S

    def __init__(self) -> None:
        super().__init__(_child)

    def add(self, spec: FusedSpec) -> AgentRef:
        name = f"{spec.engine_id}/{spec.tp_rank}"
        port = self.call("add", name, spec)
        return AgentRef(self, name, spec, port)  # type: ignore[arg-type]
