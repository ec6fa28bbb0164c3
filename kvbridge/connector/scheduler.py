"""``ConnectorScheduler``: the connector's half that lives beside the engine's scheduler.

It decides, per request, what moves between engines, and tells the workers
through one ``ConnectorMetadata`` per step (``metadata.py``). It never touches
KV memory or the network; the workers' ``ConnectorWorker`` do.

The engine's calls, in order (names mirror vLLM's ``KVConnectorBase_V1``)::

    schedule a waiting request:
        hits, num_local = manager.get_computed_blocks(req)
        num_ext, is_async = conn.get_num_new_matched_tokens(req, num_local)
        if is_async:   # D: load [num_local, num_local + num_ext) from P, then decode
            manager.allocate_slots(req, 0, num_local, hits,
                                   num_external_computed_tokens=num_ext, delay_cache_blocks=True)
            conn.update_state_after_alloc(req, manager.get_blocks(req_id), num_ext)
            -> request waits for its KV (not scheduled)
        else:          # prefill locally as usual (num_ext == 0)
    each step:  meta = conn.build_connector_meta()  -> every worker: start_load_kv(meta),
                (forward), wait_for_save(), get_output()  -> KVOutputAggregator
                outcome = conn.update_connector_output(aggregated)
                for rid, first_bad in outcome.loads_ended.items():   # the wait is over
                    num_computed = num_local + num_ext if first_bad is None else first_bad
                    (or fail the request: the engine's load-failure policy; then
                     cache_blocks, schedule the rest of the prompt: at least its
                     last token, whose logits the first sampled token needs)
                for rid in outcome.to_free: manager.free(rid)
    a request ends (finished or aborted):
        delay, params = conn.request_finished(req, block_ids, aborted=...)
        free now unless delay; return params to the client (P)

Two parts hold the state, one per side of a hand-off, and this class routes
the engine's calls to them: :class:`~kvbridge.connector.loads.RemoteLoads`
(``loads.py``; D: plans each load, records its blocks, tracks it to its finish,
with the token arithmetic) and :class:`~kvbridge.connector.held_grants.HeldGrants`
(``held_grants.py``; P: holds a finished prefill's blocks under a grant for
readers). An engine with role ``"both"`` does either per request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvbridge.connector.held_grants import HeldGrants
from kvbridge.connector.loads import LoadEnd, LoadState, RemoteLoads
from kvbridge.connector.metadata import ConnectorMetadata
from kvbridge.connector.outputs import TransferStats, WorkerOutput
from kvbridge.connector.params import KVTransferParams, params_key
from kvbridge.connector.request import BlockIds, ConnectorRequest
from kvbridge.connector.stats import ConnectorStats
from kvbridge.errors import ConfigError
from kvbridge.topology import CacheGroup, EngineTopology

__all__ = ["ConnectorScheduler", "Role", "StepOutcome"]

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one step's worker output settled (``ConnectorScheduler.update_connector_output``).

    Attributes:
        loads_ended: requests whose load ended (well or not; they may run now),
            each with the token index of its first block without valid KV,
            or ``None`` when all of it arrived.
        to_free: finished requests whose blocks the connector kept and the
            engine may free now. On P: every reader reported, the lease ended
            or the grant was revoked. On D: a request aborted during its load,
            now that the load has ended.
    """

    loads_ended: Mapping[str, int | None]
    to_free: frozenset[str]


class ConnectorScheduler:
    """Scheduler side of the connector (see the module docstring for the call order).

    Args:
        engine_id: this engine's id, unique in the cluster.
        role: ``"prefill"`` only serves, ``"decode"`` only loads, ``"both"`` does
            either per request, as the request's params say.
        topology: this engine's topology.
        host: host P's readers connect to (this engine's transfer host).
        base_port: transfer base port; worker of global rank ``g`` listens on base + g.
            0: the workers listen on ports of their own choosing, given later
            with ``set_worker_ports`` (until then nothing is served).
        block_size: tokens per block (must equal ``topology.block_size``).
        lease_s: how long a finished prefill's blocks are held for readers.
        clock: wall clock (epoch seconds) for ``expires_at``.
        groups: the engine's KV cache groups when it has several (sliding
            window, recurrent state: ``kvbridge.topology.groups``); None or
            one ``tokens`` group: every block from token 0, one list.
        null_block_id: the engine's placeholder block in a group's list
            (vLLM's null block), never held nor written.
        secret: the cluster secret: P signs the params it hands out with a key
            derived from it, and D plans no read from params that do not
            verify (``params.py``). None: explicitly insecure, params unsigned
            and unchecked.
        max_held_blocks: at most this many blocks held for remote readers at
            once; the oldest holds go first (``held_grants.py``). None: no cap.

    Raises:
        ConfigError: bad role, port, lease or block size.
    """

    def __init__(
        self,
        engine_id: str,
        role: Role,
        topology: EngineTopology,
        host: str,
        base_port: int,
        block_size: int,
        *,
        lease_s: float,
        clock: Callable[[], float] = time.time,
        groups: Sequence[CacheGroup] | None = None,
        null_block_id: int | None = None,
        secret: bytes | None = None,
        max_held_blocks: int | None = None,
    ) -> None:
        if role not in ("prefill", "decode", "both"):
            raise ConfigError(f"role must be prefill, decode or both, got {role!r}")
        if block_size != topology.block_size:
            raise ConfigError(f"block_size {block_size} != topology block size "
                              f"{topology.block_size}")
        if not 0 <= base_port <= 65535 - topology.world_size + 1 or not engine_id or not host:
            raise ConfigError(f"engine {engine_id!r} at {host!r}: base_port {base_port} must "
                              f"leave room for {topology.world_size} ports below 65536")
        if not math.isfinite(lease_s) or lease_s <= 0:
            raise ConfigError(f"lease_s must be finite and > 0, got {lease_s}")
        if max_held_blocks is not None and max_held_blocks < 0:
            raise ConfigError(f"max_held_blocks must be >= 0, got {max_held_blocks}")
        self.engine_id, self.role, self.topology = engine_id, role, topology
        self.host, self.base_port, self.block_size = host, base_port, block_size
        self.lease_s = lease_s
        if groups is not None and len(groups) == 1 and groups[0].kind == "tokens":
            groups = None  # one list of every block: the general path (any block sizes)
        self.groups = tuple(groups) if groups is not None else None
        key = params_key(secret)
        self._loads = RemoteLoads(block_size, may_load=role != "prefill", clock=clock,
                                  groups=groups, null_block_id=null_block_id,
                                  tp_size=topology.tp_size, params_key=key)
        self._grants = HeldGrants(engine_id, host, base_port, topology, block_size,
                                  lease_s=lease_s, clock=clock, groups=groups,
                                  null_block_id=null_block_id, params_key=key,
                                  max_held_blocks=max_held_blocks)
        self._stats = ConnectorStats()  # the workers' transfer counters

    def set_worker_ports(self, ports: Sequence[int]) -> None:
        """Where each worker's transfer agent listens (index: global rank).

        For engines whose workers pick their own ports (``base_port`` 0): the
        ports are announced to readers in every grant's ``kv_transfer_params``.

        Raises:
            ConfigError: not one port in 1..65535 per worker.
        """
        ports = list(ports)
        if (len(ports) != self.topology.world_size
                or not all(isinstance(p, int) and 1 <= p <= 65535 for p in ports)):
            raise ConfigError(f"need one port in 1..65535 for each of "
                              f"{self.topology.world_size} workers, got {ports}")
        self._grants.set_ports(ports)

    # ---------------------------------------------------------------- D: loading
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens to load from the remote prefill after the local prefix hits.

        May be called again for the same request until ``update_state_after_alloc``
        (e.g. when allocation failed); the answer stays the same.

        Args:
            request: a waiting request.
            num_computed_tokens: its local prefix-cache hit (a block multiple).

        Returns:
            ``(num_external_tokens, load_is_async)``: ``(end - num_computed_tokens,
            True)`` to load (token arithmetic: ``loads.py``), else ``(0, False)``:
            prefill locally.
        """
        return self._loads.plan(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        """Record where the request's remote tokens land.

        Args:
            request: the request just allocated.
            blocks: ALL its blocks, from token 0 (prefix hits first), e.g.
                ``manager.get_blocks(request_id)``; one list per KV cache group.
            num_external_tokens: tokens the engine allocated for loading: the
                planned number, or 0 when it decided to prefill locally after all.

        Raises:
            ConfigError: more external tokens than planned, several groups, or
                too few blocks for the tokens (nothing recorded).
        """
        self._loads.record_allocation(request, blocks, num_external_tokens)

    # ---------------------------------------------------------------- every step
    def build_connector_meta(self, scheduler_output: object | None = None) -> ConnectorMetadata:
        """This step's work for every worker; the pending work is then cleared.

        Args:
            scheduler_output: unused (kept for vLLM's signature).
        """
        recvs, notices = self._loads.dispatch()
        sends, releases = self._grants.dispatch()
        return ConnectorMetadata(reqs_to_recv=recvs, reqs_to_send=sends,
                                 reqs_to_release=releases, reqs_to_notify=notices)

    def update_connector_output(self, output: WorkerOutput) -> StepOutcome:
        """Take in one step's aggregated worker output (finished, failed, stats).

        Returns:
            What the output settled: loads that ended and where each request's
            valid KV ends, and kept blocks the engine may free now. What to do
            with a load that failed (recompute, fail the request) is the
            engine's policy, not the connector's.
        """
        self._record_transfer_stats(output)
        self._loads.mark_invalid(output.invalid_block_ids)
        ended: dict[str, LoadEnd] = {}
        to_free: set[str] = set()
        for request_id in output.finished_recving or ():
            end = self._loads.finish(request_id)
            if end is not None and end.aborted:  # aborted during its load: free it now
                to_free.add(request_id)
            elif end is not None:
                ended[request_id] = end
        for request_id in output.finished_sending or ():
            self._grants.release(request_id)
            to_free.add(request_id)
        bad = set().union(*(end.invalid_block_ids for end in ended.values()))
        loads_ended = {request_id: end.first_bad_token(self.block_size, bad)
                       for request_id, end in ended.items()}
        for request_id, first_bad_token in loads_ended.items():
            if first_bad_token is not None:
                logger.info("request %r: KV load failed from token %d on",
                            request_id, first_bad_token)
        return StepOutcome(loads_ended, frozenset(to_free))

    # ---------------------------------------------------------------- request end
    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int] | tuple[list[int], ...], *,
        aborted: bool = False,
    ) -> tuple[bool, KVTransferParams | None]:
        """A request finished or was aborted: keep its blocks? params for the client?

        Args:
            request: the request (its prompt was fully computed unless ``aborted``).
            block_ids: its blocks in token order: a list (one group) or a tuple
                of one list per KV cache group.
            aborted: it was cancelled or failed rather than finished.

        Returns:
            ``(delay_free, params)``. ``delay_free``: do not free the blocks now;
            they are freed when a ``StepOutcome.to_free`` names the request.
            ``params``: for the client (P answering a ``do_remote_decode``
            request: where D reads the prompt's KV), else ``None``.
        """
        delay_free = self._loads.end_request(request)
        if delay_free is not None:  # it asked to load (D): never served onward
            return delay_free, None
        params = request.kv_transfer_params
        if aborted or params is None or not params.do_remote_decode:
            return False, None
        if self.role == "decode":
            logger.warning("request %r asks a decode-only engine to serve its KV",
                           request.request_id)
            return False, None
        held = self._grants.hold(request, block_ids)
        return held is not None, held

    def revoke(self, request_id: str) -> bool:
        """Give a held request's blocks back now (e.g. shutdown); readers then fail.

        Returns:
            True if the request was held (its release follows in a later step).
        """
        return self._grants.revoke(request_id)

    # ---------------------------------------------------------------- queries
    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping (polling its workers) for us.

        Work to dispatch, loads in flight or blocks held for readers: each ends
        through worker outputs, which only arrive with steps (empty ones count).
        """
        return self._loads.has_pending_work() or self._grants.has_pending_work()

    def load_state(self, request_id: str) -> LoadState | None:
        """Where a request's load stands: planned (asked, no blocks yet), allocated
        (blocks recorded, workers not told yet), dispatched (workers reading), or None.
        """
        return self._loads.state(request_id)

    def loading_block_ids(self, request_id: str) -> list[int]:
        """The local blocks a load in flight writes (empty if it has none)."""
        return self._loads.written_block_ids(request_id)

    @property
    def num_held_blocks(self) -> int:
        """Blocks held for remote readers right now."""
        return self._grants.num_held_blocks

    def get_stats(self) -> ConnectorStats:
        """A snapshot of the counters and current gauges."""
        stats = self._stats.copy()
        stats.num_loads_started = self._loads.num_started
        stats.num_loads_failed = self._loads.num_failed
        stats.num_local_hits_skipped = self._loads.num_local_hits_skipped
        stats.num_params_refused = sum(self._loads.num_refused.values())
        stats.num_grants_issued = self._grants.num_issued
        stats.num_grants_released = self._grants.num_released
        stats.num_holds_evicted = self._grants.num_evicted
        stats.num_held_blocks = self._grants.num_held_blocks
        stats.num_held_requests = self._grants.num_held_requests
        stats.num_loads_in_flight = self._loads.num_in_flight
        return stats

    def _record_transfer_stats(self, output: WorkerOutput) -> None:
        stats = output.stats
        if not isinstance(stats, TransferStats):
            return
        self._stats.num_transfers += stats.num_transfers
        self._stats.num_failures += stats.num_failures
        self._stats.nbytes += stats.nbytes
        self._stats.num_local_copies += stats.num_local_copies
        self._stats.record_durations(stats.durations_s)
        self._stats.record_phases(stats.phases_s)
