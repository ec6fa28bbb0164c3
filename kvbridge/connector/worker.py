"""``ConnectorWorker``: the connector's half inside each TP/PP worker process.

It owns the worker's ``TransferAgent`` and carries out the ``ConnectorMetadata``
that the scheduler side builds each step. Per step the engine calls, on every
worker, with the same metadata::

    worker.start_load_kv(meta)   # hold finished prefills' blocks under their grants (P);
                                 # start reads (D), notices, revocations; returns at once
    ... forward pass ...
    worker.wait_for_save()       # nothing left to do: kept for the engines' call order
    out = worker.get_output()    # -> KVOutputAggregator -> ConnectorScheduler

A prefill in ``meta.reqs_to_send`` finished in an earlier step, whose forward
has ended (its token was sampled), so its KV is complete before this step's
forward: its grant is issued before that forward, not after. The engine has
already returned that token with the params, and D's read may be at P's door;
a grant issued after a long forward (another prompt's prefill) would keep that
read waiting (``grant_wait_s``) for nothing.

Steps without requests count too: the engine keeps stepping while
``ConnectorScheduler.has_pending_work()``.

Host-buffer mode (``host_buffer=True``) stages transfers through a host copy of
the cache: the agent registers the host copy; blocks are copied device -> host
before a grant is issued and host -> device once a read has landed, both with
``kernels.copy_blocks``. Without a GPU the "device" cache is a CPU tensor too,
which still runs every step of the path.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence

import msgspec
import torch

from kvbridge.connector.metadata import ConnectorMetadata, RecvRequest
from kvbridge.connector.outputs import TransferStats, WorkerOutput
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.kernels import copy_blocks, on_device
from kvbridge.topology import EngineTopology, KVLayout, describe_cache
from kvbridge.transfer.agent import AgentConfig, TransferAgent
from kvbridge.transfer.protocol.security import CompatInfo

__all__ = ["ConnectorWorker", "WorkerHandshake"]

logger = logging.getLogger(__name__)


class WorkerHandshake(msgspec.Struct, frozen=True, kw_only=True):
    """Where this worker's transfer agent listens and what it holds (for /health, logs)."""

    engine_id: str
    tp_rank: int
    pp_rank: int
    global_rank: int
    host: str
    port: int
    layout: str
    block_size: int
    num_blocks: int
    host_buffer: bool


class ConnectorWorker:
    """Worker side of the connector: one per TP/PP worker.

    Args:
        engine_id: the engine's id (same on all its workers).
        topology: the engine's topology.
        tp_rank: this worker's TP rank.
        pp_rank: this worker's PP rank.
        compat: what peers must agree on (model, dtype, heads, ...).
        host: host the agent is reached at (reported in ``handshake_metadata``).
        base_port: the engine's transfer base port; this agent listens on
            ``base_port + global rank`` (0: any free port, for engines that only read).
        secret: cluster secret, or None for no authentication.
        host_buffer: stage transfers through a host copy of the cache.
        agent_config: transfer timeouts and buffer sizes.
        on_event: passed to the ``TransferAgent``: called from its thread when
            ``get_output`` may have news (a read ended, a grant was released),
            so an engine sleeping between steps can wake up.

    Raises:
        ConfigError: ranks out of range or a bad port.
    """

    def __init__(
        self,
        engine_id: str,
        topology: EngineTopology,
        tp_rank: int,
        pp_rank: int,
        compat: CompatInfo,
        *,
        host: str,
        base_port: int,
        secret: bytes | None,
        host_buffer: bool = False,
        agent_config: AgentConfig | None = None,
        on_event: Callable[[], None] | None = None,
    ) -> None:
        self.global_rank = topology.global_rank(tp_rank, pp_rank)
        if base_port and not 1 <= base_port + self.global_rank <= 65535:
            raise ConfigError(f"base_port {base_port} + rank {self.global_rank} is no port")
        self.engine_id, self.topology = engine_id, topology
        self.tp_rank, self.pp_rank, self.compat = tp_rank, pp_rank, compat
        self.host, self.base_port, self._secret = host, base_port, secret
        self.host_buffer, self._agent_config = host_buffer, agent_config
        self._on_event = on_event
        self.handshake_metadata: WorkerHandshake | None = None
        self._agent: TransferAgent | None = None
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] | None = None
        self._written: dict[str, list[int]] = {}  # read in flight -> blocks it writes
        self._failed: dict[str, set[int]] = {}  # failed read -> blocks, until it is reported
        self._sending: set[str] = set()  # grants given back without readers
        self._recving: set[str] = set()  # reads that ended before starting
        self._invalid: set[int] = set()
        self._failed_recving: set[str] = set()  # reads reported failed, until taken
        self._stats = TransferStats()

    @staticmethod
    def prefers_layout() -> KVLayout:
        """The cache layout this connector moves fastest: HND (a head slice is one run)."""
        return KVLayout.HND

    # ---------------------------------------------------------------- setup
    def register_kv_caches(self, caches: Sequence[torch.Tensor]) -> None:
        """Check the caches' layout, start the transfer agent and publish its address.

        Args:
            caches: one tensor per layer this worker holds, each laid out in
                memory as ``topology.layout`` says (a contiguous tensor, or a
                transposed view of one, e.g. logical NHD over HND memory). With
                ``topology.fused_kv`` (vLLM's CPU cache): contiguous
                ``[num_blocks, num_heads, block_size, 2 * head_size]`` tensors.

        Raises:
            ConfigError: a cache does not match the topology, or called twice.
            TransferError: the agent could not start (e.g. the port is taken).
        """
        if self._agent is not None:
            raise ConfigError("register_kv_caches called twice")
        self._device = [self._checked(index, t) for index, t in enumerate(caches)]
        served = self._device
        if self.host_buffer:
            pin = torch.cuda.is_available() and self._device[0].is_cuda
            self._host = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                for t in self._device
            ]
            served = self._host
        port = self.base_port + self.global_rank if self.base_port else 0
        agent = TransferAgent(
            self.engine_id, self.topology, self.tp_rank, self.pp_rank, self.compat,
            port=port, secret=self._secret, config=self._agent_config, on_event=self._on_event,
        )
        agent.register_kv_caches(served)
        agent.start()
        self._agent = agent
        first = self._device[0]
        self.handshake_metadata = WorkerHandshake(
            engine_id=self.engine_id, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
            global_rank=self.global_rank, host=self.host, port=agent.port,
            layout=str(self.topology.layout), block_size=self.topology.block_size,
            num_blocks=int(first.shape[0 if self.topology.is_mla else 1]),
            host_buffer=self.host_buffer,
        )

    def _checked(self, index: int, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` as a contiguous tensor in the topology's layout, or ConfigError.

        A fused K/V cache comes back as its single-plane view ``cache[None]``
        (``[1, num_blocks, num_heads, block_size, row]``), the form the kernels
        and the transfer agent take.
        """
        topo = self.topology
        if topo.fused_kv:
            return self._checked_fused(index, cache)
        views = [(topo.layout, cache)]
        if not topo.is_mla:  # a transposed view over memory in the topology's layout
            other = KVLayout.HND if topo.layout is KVLayout.NHD else KVLayout.NHD
            views.append((other, cache.transpose(2, 3)))
        problems = []
        for logical, view in views:
            try:
                facts = describe_cache(tuple(cache.shape), cache.stride(), logical, topo.is_mla,
                                       block_size=topo.block_size)
            except ConfigError as exc:
                problems.append(f"as {logical}: {exc}")
                continue
            if (facts.physical_layout is topo.layout and facts.is_dense and view.is_contiguous()
                    and not facts.cross_layers and (topo.is_mla or not facts.blocks_first)):
                return view
            problems.append(f"as {logical}: memory is {facts.physical_layout}, dense "
                            f"{facts.is_dense}, blocks first {facts.blocks_first}")
        raise ConfigError(
            f"layer {index} cache {tuple(cache.shape)} strides {cache.stride()} is not a "
            f"{topo.layout} cache of block size {topo.block_size}: {'; '.join(problems)}"
        )

    def _checked_fused(self, index: int, cache: torch.Tensor) -> torch.Tensor:
        """A fused K/V cache as ``[1, num_blocks, num_heads, block_size, row]``, or ConfigError."""
        topo = self.topology
        view = cache.unsqueeze(0) if cache.dim() == 4 else cache
        fits = (view.dim() == 5 and view.shape[0] == 1 and view.is_contiguous()
                and view.shape[2] == topo.num_heads_per_rank and view.shape[3] == topo.block_size
                and view.shape[4] % 2 == 0)
        if not fits:
            raise ConfigError(
                f"layer {index} cache {tuple(cache.shape)} strides {cache.stride()} is not a "
                f"contiguous fused K/V cache [num_blocks, {topo.num_heads_per_rank} heads, "
                f"block size {topo.block_size}, 2 * head_size] (vLLM CPU)"
            )
        return view

    # ---------------------------------------------------------------- every step
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Start this step's reads, notices and revocations; returns without waiting.

        Raises:
            ConfigError: ``register_kv_caches`` was not called.
        """
        agent = self._require_agent()
        for request_id in metadata.reqs_to_release:
            agent.grants.revoke(request_id)
        self._hold(agent, metadata)
        for notice in metadata.reqs_to_notify:
            agent.notify_done(
                notice.request_id, engine_id=notice.remote_engine_id, host=notice.remote_host,
                port=notice.ports, grant=notice.grant, ok=notice.ok,
            )
        for recv in metadata.reqs_to_recv:
            self._start_read(agent, recv)

    def _start_read(self, agent: TransferAgent, recv: RecvRequest) -> None:
        block_size = self.topology.block_size
        written = recv.local_block_ids[
            recv.first_token // block_size : math.ceil(recv.end_token / block_size)
        ]
        self._written[recv.request_id] = written
        if recv.missing_block_ids or not written:  # the load fails, read or not
            self._failed[recv.request_id] = set(recv.missing_block_ids)
        if not written:
            self._recving.add(recv.request_id)
            return
        try:
            agent.start_read(
                recv.request_id, engine_id=recv.remote_engine_id, host=recv.remote_host,
                port=recv.ports, remote_block_ids=recv.remote_block_ids,
                local_block_ids=recv.local_block_ids, grant=recv.grant,
                num_tokens=recv.num_tokens, first_token=recv.first_token,
                prompt_digest=recv.kv_digest,
            )
        except ConfigError as exc:  # reported as a failed load with the next output
            logger.warning("read of %r not started: %s", recv.request_id, exc)
            self._failed.setdefault(recv.request_id, set()).update(written)
            self._recving.add(recv.request_id)

    def wait_for_save(self) -> None:
        """Nothing to do: ``start_load_kv`` already held the step's finished prefills.

        Kept because engines call it after each forward (vLLM's connector API).
        """

    def _hold(self, agent: TransferAgent, meta: ConnectorMetadata) -> None:
        """Hold the finished prefills of ``meta`` for readers (issue their grants).

        A grant that cannot be issued is reported as finished sending at once,
        so the engine frees the blocks instead of holding them for nobody.
        Each grant is bound to its ``kv_digest``: reads naming another prompt
        (or the blocks in another order) are refused by the agent.
        """
        published: list[float] = []
        for send in meta.reqs_to_send:
            try:
                if self._host is not None:  # readers read the mirror at once: wait for it
                    with on_device(self._device[0]):
                        copy_blocks(self._device, self._host, send.block_ids)
                agent.issue_grant(send.request_id, send.block_ids, None, lease_s=send.lease_s,
                                  grant=send.grant, prompt_digest=send.kv_digest)
                if send.finished_at:  # the scheduler's clock: this host's monotonic one
                    published.append(max(0.0, time.monotonic() - send.finished_at))
            except KVBridgeError as exc:
                logger.warning("cannot hold %r for readers: %s", send.request_id, exc)
                self._sending.add(send.request_id)
        if published:
            self._stats = self._stats.aggregate(TransferStats(phases_s={"publish": published}))

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Return and forget ``(done_sending, done_recving)`` request ids of this worker.

        Failed reads are among ``done_recving``; their blocks go to the next
        ``get_output().invalid_block_ids``. In host-buffer mode, reads that
        landed are copied to the device cache before they are reported.
        """
        agent = self._agent
        if agent is None:
            return set(), set()
        # finished first, failures second: a read ending in between is reported
        # later with its failure, never earlier without it
        sending, recving = agent.get_finished()
        for request_id, block_ids in agent.get_failed_block_ids().items():
            self._failed.setdefault(request_id, set()).update(block_ids)
        sending |= self._sending
        recving |= self._recving
        self._sending, self._recving = set(), set()
        for request_id in recving:
            written = self._written.pop(request_id, [])
            bad = self._failed.pop(request_id, None)
            if bad is not None:
                self._invalid |= bad
                self._failed_recving.add(request_id)
            elif self._host is not None and written:
                copy_blocks(self._host, self._device, written)
        now = time.monotonic()
        for read in agent.get_stats():
            phases = ({"queue": [read.queue_s], "grant": [read.grant_s], "copy": [read.copy_s],
                       "collect": [max(0.0, now - read.ended_at)]} if read.ok else {})
            self._stats = self._stats.aggregate(TransferStats(
                num_transfers=int(read.ok), nbytes=read.nbytes,
                durations_s=[read.duration_s] if read.ok else [], num_failures=int(not read.ok),
                num_local_copies=int(read.ok and read.num_local_copies > 0), phases_s=phases,
            ))
        waits = agent.take_grant_waits()
        if waits:
            self._stats = self._stats.aggregate(TransferStats(phases_s={"grant_wait": waits}))
        return sending, recving

    def cancel_reads(self, request_ids: Collection[str], quiesce_s: float = 2.0
                     ) -> concurrent.futures.Future[set[str]]:
        """Cancel loads in flight (``TransferAgent.cancel_reads``): the future resolves
        with the ids whose reads no longer write their blocks, within about
        ``quiesce_s``. Each cancelled load is reported failed with a later
        ``get_output``, once (its blocks in ``invalid_block_ids``).

        Raises:
            ConfigError: ``register_kv_caches`` was not called.
        """
        return self._require_agent().cancel_reads(request_ids, quiesce_s)

    def take_failed_recving(self) -> set[str]:
        """Requests among ``done_recving`` whose load failed, since the last call.

        For engines that are told of failures per request rather than per
        block (vLLM with several KV cache groups).
        """
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_output(self) -> WorkerOutput:
        """This step's report for the aggregator (calls ``get_finished``)."""
        sending, recving = self.get_finished()
        stats, self._stats = self._stats, TransferStats()
        invalid, self._invalid = self._invalid, set()
        return WorkerOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            stats=None if stats.is_empty() else stats,
            invalid_block_ids=invalid,
        )

    def shutdown(self) -> None:
        """Stop the transfer agent and drop the caches. Idempotent."""
        if self._agent is not None:
            self._agent.close()
        self._device, self._host = [], None

    def _require_agent(self) -> TransferAgent:
        if self._agent is None:
            raise ConfigError("register_kv_caches must be called first")
        return self._agent
