"""Run a TransferAgent in a child process and drive it over a pipe (test helper).

A :class:`Host` is a "spawn" child process (``tests/child_host.py``) that hosts
any number of agents (each with its own loop thread and UCX worker), so tests
pay the interpreter start-up once per process. Every call has a timeout: a
wedged agent fails the test instead of hanging it.

A spec with ``fused=True`` (``layout="HND"``) lays its caches out as vLLM's CPU
attention backend hands them to a connector: one ``[num_blocks, num_kv_heads,
block_size, 2 * head_dim]`` tensor per layer, all views of one storage.

A spec with ``manual_clock=True`` gives the agent's grant table a ``ManualClock``
that moves only on the ``advance`` command: leases end when a test says so.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.clock import ManualClock
from kvbridge.transfer.protocol.security import CompatInfo
from tests.child_host import ChildHost, serve_commands

if TYPE_CHECKING:  # imported in the child only: the parent stays free of ucxx
    from kvbridge.transfer.agent import TransferAgent

CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Spec:
    engine_id: str
    tp_size: int = 1
    tp_rank: int = 0
    port: int = 0
    block_size: int = 16
    layout: str = "NHD"
    num_kv_heads: int = 8
    head_dim: int = 64
    num_layers: int = 4
    num_blocks: int = 64
    is_mla: bool = False
    seed: int = 0
    secret: bytes | None = None
    model: str = "tiny"
    fused: bool = False  # vLLM CPU caches (K^T | V per block and head); needs HND
    config: dict[str, Any] = field(default_factory=dict)
    manual_clock: bool = False  # the grant table's clock moves only on ``advance``
    shared: bool = False  # caches in shared memory (``kv_cache_zeros(shared=True)``)
    seed_random: int | None = None  # random.seed() in the child first, as vLLM seeds it
    #: zero config as a user whose home is this: the secret is what
    #: ``cluster_secret("127.0.0.1")`` finds there (``secret`` must be None)
    zero_config_home: str | None = None

    def topology(self) -> EngineTopology:
        return EngineTopology(
            tp_size=self.tp_size, pp_size=1, block_size=self.block_size,
            num_kv_heads=1 if self.is_mla else self.num_kv_heads, is_mla=self.is_mla,
            layout=KVLayout.parse(self.layout), num_layers=self.num_layers,
            fused_kv=self.fused,
        )

    def compat(self) -> CompatInfo:
        return CompatInfo(
            self.model, "bfloat16", num_kv_heads=1 if self.is_mla else self.num_kv_heads,
            head_dim=self.head_dim, num_layers=self.num_layers,
            layout=KVLayout.parse(self.layout), block_size=self.block_size, is_mla=self.is_mla,
            fused_kv=self.fused,
        )


def make_caches(spec: Spec) -> list[torch.Tensor]:
    """Seeded caches of this rank (zeros when seed < 0)."""
    topo = spec.topology()
    heads = topo.num_heads_per_rank
    if spec.is_mla:
        shape: tuple[int, ...] = (spec.num_blocks, spec.block_size, spec.head_dim)
    elif spec.fused:  # per block and head, K^T [D, B] then V [B, D]
        shape = (spec.num_blocks, heads, spec.block_size, 2 * spec.head_dim)
    elif spec.layout == "NHD":
        shape = (2, spec.num_blocks, spec.block_size, heads, spec.head_dim)
    else:
        shape = (2, spec.num_blocks, heads, spec.block_size, spec.head_dim)
    # replicas (MLA, or more ranks than KV heads) hold the same bytes, as in an engine
    key = topo.heads_of(spec.tp_rank).start if topo.replicates_kv_cache else spec.tp_rank
    gen = torch.Generator().manual_seed(max(spec.seed, 0) * 1000 + key)
    if spec.fused:  # all layers views of one storage, as vLLM CPU allocates them
        full = (spec.num_layers, *shape)
        store = (torch.zeros(full, dtype=torch.bfloat16) if spec.seed < 0
                 else torch.randn(full, generator=gen).to(torch.bfloat16))
        return list(store.unbind(0))
    caches = []
    for _ in range(spec.num_layers):
        if spec.seed < 0:
            caches.append(torch.zeros(shape, dtype=torch.bfloat16))
        else:
            caches.append(torch.randn(shape, generator=gen).to(torch.bfloat16))
    if spec.shared:
        from kvbridge.transfer.host_memory import kv_cache_zeros

        caches = [kv_cache_zeros(shape, torch.bfloat16, shared=True).copy_(layer)
                  for layer in caches]
    return caches


def logical(
    caches: list[torch.Tensor], spec: Spec, block_ids: list[int], num_tokens: int
) -> torch.Tensor:
    """Tokens of ``block_ids`` as ``[layers, kv, num_tokens, heads, head_dim]``."""
    out = []
    for layer in caches:
        if spec.is_mla:
            planes = layer.unsqueeze(0).unsqueeze(3)  # [1, nb, bs, 1, d]
        elif spec.layout == "HND":
            planes = layer.transpose(2, 3)
        else:
            planes = layer
        picked = planes[:, block_ids]  # [kv, n, bs, h, d]
        flat = picked.reshape(picked.shape[0], -1, *picked.shape[3:])
        out.append(flat[:, :num_tokens])
    return torch.stack(out)


def new_agent(
    spec: Spec, clock: ManualClock | None = None
) -> tuple[TransferAgent, list[torch.Tensor]]:
    """Child side: an agent for ``spec`` with its seeded caches registered (not started).

    ``clock``: its grant table's clock (default: the monotonic clock).
    """
    from kvbridge.transfer.agent import TransferAgent

    secret = spec.secret
    if spec.zero_config_home is not None:
        import os

        from kvbridge.transfer.protocol.cluster_secret import cluster_secret

        for name in ("KVBRIDGE_SECRET", "KVBRIDGE_SECRET_DIR", "XDG_CACHE_HOME"):
            os.environ.pop(name, None)
        os.environ["HOME"] = spec.zero_config_home
        secret = cluster_secret("127.0.0.1")
    agent = TransferAgent(
        spec.engine_id, spec.topology(), spec.tp_rank, 0, spec.compat(),
        port=spec.port, secret=secret, config=AgentConfig(**spec.config), clock=clock,
    )
    caches = make_caches(spec)
    agent.register_kv_caches(caches)
    return agent, caches


def _child(conn: Connection) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    agents: dict[str, tuple[TransferAgent, list[torch.Tensor]]] = {}
    clocks: dict[str, ManualClock] = {}
    memmoves = _count_memmoves()

    def handle(cmd: str, name: str, args: Any) -> Any:
        if cmd == "add":
            if args.seed_random is not None:
                import random

                random.seed(args.seed_random)
            if args.manual_clock:
                clocks[name] = ManualClock(1000.0)
            agent, caches = new_agent(args, clocks.get(name))
            agents[name] = (agent, caches)
            return agent.start()
        if cmd == "slow_serving":  # (seconds,): every server here waits before each chunk
            from tests.slow_serving import install

            install(args[0])
            return None
        if cmd == "advance":  # (seconds,): move a manual_clock spec's grant clock
            return clocks[name].advance(args[0])
        agent, caches = agents[name]
        if cmd == "issue":  # (request_id, block_ids, num_readers, lease_s, token[, digest])
            request_id, block_ids, num_readers, lease_s, token, *digest = args
            return agent.issue_grant(request_id, block_ids, num_readers, lease_s=lease_s,
                                     grant=token, prompt_digest=digest[0] if digest else None,
                                     ).grant
        if cmd == "issue_hold_gil":  # (request_id, block_ids, token, seconds): issue the
            # grant, then hold this process's interpreter lock that long (a C call that keeps
            # it, as a long operator of a forward pass does): the agent's thread cannot run
            request_id, block_ids, token, hold_s = args
            agent.issue_grant(request_id, block_ids, 1, grant=token)
            ctypes.PyDLL(None).sleep(int(hold_s))
            return time.monotonic()
        if cmd == "read":
            agent.start_read(**args)
            return None
        if cmd == "read_now":  # start_read, then what get_finished says at once (no wait)
            agent.start_read(**args)
            return agent.get_finished()[1], agent.get_failed_block_ids(), agent.get_stats()
        if cmd == "cancel":  # (request_ids, quiesce_s): the ids cancel_reads says are quiet
            return agent.cancel_reads(args[0], args[1]).result(args[1] + 10.0)
        if cmd == "notify":
            agent.notify_done(**args[0])
            return None
        if cmd == "poll":
            sending, recving = agent.get_finished()
            return sending, recving, agent.get_failed_block_ids(), agent.get_stats()
        if cmd == "wait":  # seconds spent in wait_finished, and what it returned
            started = time.monotonic()
            ready = agent.wait_finished(args[0])
            return time.monotonic() - started, ready
        if cmd == "caches":
            return caches
        if cmd == "zero":
            for layer in caches:
                layer.zero_()
            return None
        if cmd == "grant_stats":
            return agent.grants.stats(), len(agent.grants)
        if cmd == "next_expiry":  # the earliest lease end of the live grants (grant clock)
            return agent.grants.next_expiry()
        if cmd == "counters":
            return agent.counters()
        if cmd == "memmoves":  # bytes copied from maps of servers' caches, in this process
            return sum(memmoves)
        if cmd == "close":
            agent.close()
            del agents[name]
            return None
        raise ValueError(cmd)

    def close_all() -> None:
        for agent, _ in agents.values():
            agent.close()

    serve_commands(conn, handle, close_all)


def _count_memmoves() -> list[int]:
    """Count the bytes inline reads take from maps of a server's caches in this
    process; the list they are added to."""
    from kvbridge.transfer.reading import inline

    moved: list[int] = []

    def counted(ours: Any, theirs: Any, nbytes: Any, real: Any = inline.memmove) -> Any:
        moved.append(nbytes.value)  # ready-made ctypes arguments (``memmove_rows``)
        return real(ours, theirs, nbytes)

    inline.memmove = counted  # type: ignore[attr-defined]
    return moved


class Host(ChildHost):
    """A child process hosting any number of agents.

    ``chunk_delay_s``: every agent of this host, as a server, waits this long
    before each data chunk (``tests/slow_serving.py``), so that a test can kill,
    cut or hang up mid-transfer.
    """

    what = "agent host"
    call_timeout_s = CALL_TIMEOUT_S

    def __init__(self, chunk_delay_s: float = 0.0) -> None:
        super().__init__(_child)
        if chunk_delay_s:
            self.call("slow_serving", "", (chunk_delay_s,))

    def add(self, spec: Spec) -> AgentRef:
        name = f"{spec.engine_id}/{spec.tp_rank}"
        port = self.call("add", name, spec)
        return AgentRef(self, name, spec, port)


@contextmanager
def host_pair() -> Iterator[tuple[Host, Host]]:
    """``(p_host, d_host)``: two agent hosts, closed on exit (for fixtures)."""
    p_host, d_host = Host(), Host()
    try:
        yield p_host, d_host
    finally:
        p_host.close()
        d_host.close()


@dataclass
class AgentRef:
    """One agent inside a :class:`Host`."""

    host: Host
    name: str
    spec: Spec
    port: int
    released: set[str] = field(default_factory=set)  # done_sending seen so far
    finished: set[str] = field(default_factory=set)  # done_recving seen so far
    failed: dict[str, set[int]] = field(default_factory=dict)
    stats: list[Any] = field(default_factory=list)

    def call(self, cmd: str, *args: Any, **kwargs: Any) -> Any:
        return self.host.call(cmd, self.name, kwargs if cmd in ("read", "read_now") else args)

