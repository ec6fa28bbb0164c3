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
                conn.update_connector_output(aggregated)
                for rid in conn.take_finished_recving():      # the wait is over
                    first_bad = conn.handle_load_failure(req, conn's invalid ids)
                    num_computed = num_local + num_ext if first_bad is None else first_bad
                    (then cache_blocks, schedule the rest of the prompt: at least its
                     last token, whose logits the first sampled token needs)
                for rid in conn.take_finished_sending(): manager.free(rid)
    a request ends (finished or aborted):
        delay, params = conn.request_finished(req, block_ids, aborted=...)
        free now unless delay; return params to the client (P)

Token arithmetic (D). P computed the KV of prompt tokens ``[0, n)``. The last
prompt token is always recomputed on D (its logits give the first token), so
D loads at most up to ``end = min(n, num_prompt_tokens - 1)``::

    prompt     0 ............................................ num_prompt_tokens
    local hit  |==== num_local ====|                             (D's prefix cache)
    loaded                         |===== num_ext =====|         (from P)
    computed on D                                      |== >= 1 ==|
                                                      end

``num_ext = end - num_local``; zero (a full local hit, or a one-token prompt)
means no load: the grant is given back to P with a notice. After a successful
load ``num_computed_tokens = num_local + num_ext <= num_prompt_tokens - 1``, so
the engine never needs to subtract anything itself.

P and D block sizes may differ. ``num_local`` is a multiple of D's block size;
a load starting inside a P block reads that P block and skips its first tokens
on arrival. Every request is loaded at most once and a loaded request is never
served onward (no transfer loops).

Each grant is bound to the prompt tokens it holds and to their blocks
(``binding.py``): P issues it with the digest of its prompt, D reads with the
digest of its own, and P refuses a read whose digest differs, so D never loads
one prompt's KV under another prompt (D then recomputes, as for any failed load).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvbridge.connector.binding import kv_digest
from kvbridge.connector.metadata import (
    ConnectorMetadata,
    NotifyRequest,
    RecvRequest,
    SendRequest,
)
from kvbridge.connector.outputs import KVConnectorOutput, TransferStats
from kvbridge.connector.params import KVTransferParams
from kvbridge.connector.stats import ConnectorStats
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.topology import EngineTopology

__all__ = ["BlockIds", "ConnectorRequest", "ConnectorScheduler", "KVLoadError", "Role"]

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]
LoadFailurePolicy = Literal["recompute", "fail"]


class KVLoadError(KVBridgeError):
    """A request's KV could not be loaded and the policy is ``"fail"``.

    Attributes:
        request_id: the request.
        invalid_block_ids: its local blocks that hold no valid KV.
        first_bad_token: first token whose KV is missing.
    """

    def __init__(self, request_id: str, invalid_block_ids: set[int], first_bad_token: int) -> None:
        super().__init__(
            f"request {request_id!r}: loading its KV from the prefill engine failed "
            f"({len(invalid_block_ids)} blocks invalid from token {first_bad_token})"
        )
        self.request_id = request_id
        self.invalid_block_ids = invalid_block_ids
        self.first_bad_token = first_bad_token


class ConnectorRequest(Protocol):
    """What the connector reads of an engine request (read-only)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def kv_transfer_params(self) -> KVTransferParams | None: ...

    @property
    def num_computed_tokens(self) -> int: ...


class BlockIds(Protocol):
    """A request's blocks as the engine hands them over (``paged.manager.KVCacheBlocks``,
    vLLM's ``KVCacheBlocks``): block ids per KV cache group."""

    def get_block_ids(self) -> tuple[list[int], ...]: ...


@dataclass(slots=True)
class _Load:
    """D: one request's load, from planning to its finish."""

    params: KVTransferParams
    first_token: int
    num_tokens: int
    kv_digest: bytes  # of D's own prompt and the params' blocks (binding.py)
    recv: RecvRequest | None = None  # set once blocks are allocated
    dispatched: bool = False  # in a metadata the workers received
    aborted: bool = False
    invalid_block_ids: set[int] = field(default_factory=set)

    def written_block_ids(self, block_size: int) -> list[int]:
        assert self.recv is not None
        end_block = math.ceil(self.recv.end_token / block_size)
        return self.recv.local_block_ids[self.first_token // block_size : end_block]


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
        load_failure_policy: ``"recompute"`` rolls a request back to its first
            bad block; ``"fail"`` raises :class:`KVLoadError`.
        clock: wall clock (epoch seconds) for ``expires_at``.

    Raises:
        ConfigError: bad role, policy, port, lease or block size.
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
        load_failure_policy: LoadFailurePolicy = "recompute",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if role not in ("prefill", "decode", "both"):
            raise ConfigError(f"role must be prefill, decode or both, got {role!r}")
        if load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(f"load_failure_policy must be recompute or fail, "
                              f"got {load_failure_policy!r}")
        if block_size != topology.block_size:
            raise ConfigError(f"block_size {block_size} != topology block size "
                              f"{topology.block_size}")
        if not 0 <= base_port <= 65535 - topology.world_size + 1 or not engine_id or not host:
            raise ConfigError(f"engine {engine_id!r} at {host!r}: base_port {base_port} must "
                              f"leave room for {topology.world_size} ports below 65536")
        if not math.isfinite(lease_s) or lease_s <= 0:
            raise ConfigError(f"lease_s must be finite and > 0, got {lease_s}")
        self.engine_id, self.role, self.topology = engine_id, role, topology
        self.host, self.base_port, self.block_size = host, base_port, block_size
        self.lease_s, self.load_failure_policy = lease_s, load_failure_policy
        self._clock = clock
        self._ports: list[int] = []  # per global rank, when base_port is 0
        self._planned: dict[str, _Load] = {}  # asked, blocks not allocated yet
        self._loads: dict[str, _Load] = {}  # allocated, until the workers finish
        self._block_owner: dict[int, str] = {}  # written block id -> loading request
        self._consumed: set[str] = set()  # remote params used up (load at most once)
        self._held: dict[str, int] = {}  # P: request -> blocks held for readers
        self._to_send: list[SendRequest] = []
        self._to_release: list[str] = []
        self._to_notify: list[NotifyRequest] = []
        self._finished_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._failed: dict[str, tuple[list[int], set[int]]] = {}  # request -> (ids, bad)
        self._stats = ConnectorStats()

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
        self._ports = ports

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
            True)`` to load (module docstring), else ``(0, False)``: prefill locally.
        """
        params = request.kv_transfer_params
        request_id = request.request_id
        if params is None or not params.do_remote_prefill:
            return 0, False
        if request_id in self._consumed or request_id in self._loads:
            return 0, False
        if self.role == "prefill":
            logger.warning("request %r asks a prefill-only engine to load KV: prefilling "
                           "locally", request_id)
            self._give_back(request_id, params, ok=False)
            return 0, False
        if params.expires_at is not None and params.expires_at <= self._clock():
            logger.warning("request %r: the remote prefill's lease ended %.1fs ago; "
                           "prefilling locally", request_id, self._clock() - params.expires_at)
            self._consumed.add(request_id)
            return 0, False
        assert params.remote_block_size is not None  # parse_kv_transfer_params checked
        num_prompt = request.num_prompt_tokens
        end = min(params.remote_num_tokens, num_prompt - 1)
        start = num_computed_tokens
        if end <= start:
            self._stats.num_local_hits_skipped += 1
            self._give_back(request_id, params, ok=True)
            return 0, False
        if start % self.block_size:  # not a prefix hit: blocks before it are not whole
            logger.info("request %r: cannot load from token %d (block size %d); prefilling "
                        "locally", request_id, start, self.block_size)
            self._give_back(request_id, params, ok=True)
            return 0, False
        try:
            # D's own prompt, not P's: P refuses the read unless they are the same
            digest = kv_digest(request.prompt_token_ids[: params.remote_num_tokens],
                               params.remote_block_ids)
        except ValueError as exc:
            logger.warning("request %r: %s; prefilling locally", request_id, exc)
            self._give_back(request_id, params, ok=False)
            return 0, False
        self._planned[request_id] = _Load(params, start, end - start, digest)
        return end - start, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        """Record where the request's remote tokens land.

        Args:
            request: the request just allocated.
            blocks: ALL its blocks, from token 0 (prefix hits first), e.g.
                ``manager.get_blocks(request_id)``; one KV cache group.
            num_external_tokens: tokens the engine allocated for loading: the
                planned number, or 0 when it decided to prefill locally after all.

        Raises:
            ConfigError: more external tokens than planned, several groups, or
                too few blocks for the tokens (nothing recorded).
        """
        request_id = request.request_id
        load = self._planned.get(request_id)
        if load is None:
            return
        block_groups = blocks.get_block_ids()
        num_needed = math.ceil((load.first_token + num_external_tokens) / self.block_size)
        if (num_external_tokens > load.num_tokens or len(block_groups) != 1
                or len(block_groups[0]) < num_needed):
            raise ConfigError(
                f"request {request_id!r}: {num_external_tokens} external tokens (planned "
                f"{load.num_tokens}) from token {load.first_token} need {num_needed} blocks in "
                f"1 group, got {[len(group) for group in block_groups]}"
            )
        del self._planned[request_id]
        self._consumed.add(request_id)
        if num_external_tokens == 0:
            self._give_back(request_id, load.params, ok=True)
            return
        p = load.params
        assert p.remote_engine_id and p.remote_host and p.remote_port and p.grant
        assert p.remote_block_size is not None
        load.num_tokens = num_external_tokens
        load.recv = RecvRequest(
            request_id=request_id, local_block_ids=block_groups[0][:num_needed],
            first_token=load.first_token, num_tokens=num_external_tokens,
            remote_engine_id=p.remote_engine_id, remote_host=p.remote_host,
            remote_port=p.remote_port, remote_ports=list(p.remote_ports),
            remote_tp_size=p.remote_tp_size,
            remote_pp_size=p.remote_pp_size, remote_block_size=p.remote_block_size,
            remote_block_ids=list(p.remote_block_ids), grant=p.grant,
            kv_digest=load.kv_digest,
        )
        self._loads[request_id] = load
        for block_id in load.written_block_ids(self.block_size):
            self._block_owner[block_id] = request_id

    # ---------------------------------------------------------------- every step
    def build_connector_meta(self, scheduler_output: object | None = None) -> ConnectorMetadata:
        """This step's work for every worker; the pending work is then cleared.

        Args:
            scheduler_output: unused (kept for vLLM's signature).
        """
        recvs = [load.recv for load in self._loads.values() if not load.dispatched]
        for load in self._loads.values():
            load.dispatched = True
        self._stats.num_loads_started += len(recvs)
        meta = ConnectorMetadata(
            reqs_to_recv=[recv for recv in recvs if recv is not None],
            reqs_to_send=self._to_send, reqs_to_release=self._to_release,
            reqs_to_notify=self._to_notify,
        )
        self._to_send, self._to_release, self._to_notify = [], [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Take in one step's aggregated worker output (finished, failed, stats)."""
        self._record_transfer_stats(output)
        for block_id in output.invalid_block_ids:
            owner = self._block_owner.get(block_id)
            if owner is not None:
                self._loads[owner].invalid_block_ids.add(block_id)
            else:
                logger.warning("invalid block %d belongs to no load in flight", block_id)
        for request_id in output.finished_recving or ():
            self._finish_load(request_id)
        for request_id in output.finished_sending or ():
            if self._held.pop(request_id, None) is not None:
                self._stats.num_grants_released += 1
            self._finished_sending.add(request_id)

    def _finish_load(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is None:
            logger.warning("finished load of unknown request %r", request_id)
            return
        written = load.written_block_ids(self.block_size)
        for block_id in written:
            self._block_owner.pop(block_id, None)
        if load.invalid_block_ids:
            self._stats.num_loads_failed += 1
        if load.aborted:  # its blocks were kept only until the workers let go
            self._finished_sending.add(request_id)
            return
        if load.invalid_block_ids:
            assert load.recv is not None
            self._failed[request_id] = (load.recv.local_block_ids, set(load.invalid_block_ids))
            self._invalid_block_ids |= load.invalid_block_ids
        self._finished_recving.add(request_id)

    def take_finished_recving(self) -> set[str]:
        """Requests whose load ended (ok or not) since the last call; they may run now.

        Check each with ``handle_load_failure`` before trusting its KV.
        """
        done, self._finished_recving = self._finished_recving, set()
        return done

    def take_finished_sending(self) -> set[str]:
        """Finished requests whose delayed blocks may be freed now.

        On P: every reader reported, the lease ended or the grant was revoked.
        On D: a request aborted during its load, now that the load has ended.
        """
        done, self._finished_sending = self._finished_sending, set()
        return done

    def take_invalid_block_ids(self) -> set[int]:
        """Local block ids of finished loads that failed, since the last call."""
        bad, self._invalid_block_ids = self._invalid_block_ids, set()
        return bad

    def handle_load_failure(
        self, request: ConnectorRequest, invalid_block_ids: Iterable[int]
    ) -> int | None:
        """Where a request whose load finished must resume computing.

        Args:
            request: a request from ``take_finished_recving``.
            invalid_block_ids: invalid block ids (``take_invalid_block_ids``); the
                request's own failed blocks are also remembered here.

        Returns:
            ``None`` when the request's loaded KV is complete; else the token
            index of its first bad block (policy ``"recompute"``): the engine sets
            ``num_computed_tokens`` to it and recomputes from there.

        Raises:
            KVLoadError: the load failed and the policy is ``"fail"``.
        """
        block_ids, bad = self._failed.pop(request.request_id, ([], set()))
        bad = bad | (set(invalid_block_ids) & set(block_ids))
        indices = [index for index, block_id in enumerate(block_ids) if block_id in bad]
        if not indices:
            return None
        first_bad_token = indices[0] * self.block_size
        if self.load_failure_policy == "fail":
            raise KVLoadError(request.request_id, bad, first_bad_token)
        logger.info("request %r: KV load failed, recomputing from token %d",
                    request.request_id, first_bad_token)
        return first_bad_token

    # ---------------------------------------------------------------- request end
    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], *, aborted: bool = False
    ) -> tuple[bool, KVTransferParams | None]:
        """A request finished or was aborted: keep its blocks? params for the client?

        Args:
            request: the request (its prompt was fully computed unless ``aborted``).
            block_ids: its blocks in token order (one group).
            aborted: it was cancelled or failed rather than finished.

        Returns:
            ``(delay_free, params)``. ``delay_free``: do not free the blocks now;
            they are freed when ``take_finished_sending`` names the request.
            ``params``: for the client (P answering a ``do_remote_decode``
            request: where D reads the prompt's KV), else ``None``.
        """
        request_id = request.request_id
        try:
            return self._finish_request(request, block_ids, aborted)
        finally:
            self._consumed.discard(request_id)
            self._failed.pop(request_id, None)

    def _finish_request(
        self, request: ConnectorRequest, block_ids: list[int], aborted: bool
    ) -> tuple[bool, KVTransferParams | None]:
        request_id = request.request_id
        self._planned.pop(request_id, None)
        load = self._loads.get(request_id)
        if load is not None:
            if load.dispatched:  # a worker may be writing into the blocks: wait for it
                load.aborted = True
                return True, None
            del self._loads[request_id]
            for block_id in load.written_block_ids(self.block_size):
                self._block_owner.pop(block_id, None)
            self._give_back(request_id, load.params, ok=False)
            return False, None
        params = request.kv_transfer_params
        if params is None:
            return False, None
        if params.do_remote_prefill:
            if request_id not in self._consumed:  # ended before its load was planned
                self._give_back(request_id, params, ok=False)
            return False, None
        if aborted or not params.do_remote_decode:
            return False, None
        return self._hold_for_readers(request, block_ids)

    def _hold_for_readers(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        request_id = request.request_id
        if self.role == "decode":
            logger.warning("request %r asks a decode-only engine to serve its KV", request_id)
            return False, None
        num_tokens = min(request.num_prompt_tokens, len(block_ids) * self.block_size)
        if num_tokens < 2:  # D recomputes the last prompt token anyway: nothing to read
            return False, None
        if not (self.base_port or self._ports):
            logger.warning("request %r: the workers' ports are not known yet; not serving "
                           "its KV", request_id)
            return False, None
        held = block_ids[: math.ceil(num_tokens / self.block_size)]
        try:
            # binds the grant to these tokens in these blocks (binding.py): D sends
            # the digest of its own prompt and P's reads are refused unless it is equal
            digest = kv_digest(request.prompt_token_ids[:num_tokens], held)
        except ValueError as exc:
            logger.warning("request %r: cannot serve its KV: %s", request_id, exc)
            return False, None
        grant = secrets.token_urlsafe(16)
        self._to_send.append(SendRequest(
            request_id=request_id, block_ids=held, grant=grant, lease_s=self.lease_s,
            kv_digest=digest))
        self._held[request_id] = len(held)
        self._stats.num_grants_issued += 1
        topo = self.topology
        return True, KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_host=self.host,
            remote_port=self._ports[0] if self._ports else self.base_port,
            remote_ports=list(self._ports), remote_block_ids=held, remote_tp_size=topo.tp_size,
            remote_pp_size=topo.pp_size, remote_block_size=self.block_size,
            remote_num_tokens=num_tokens, grant=grant, expires_at=self._clock() + self.lease_s,
        )

    def revoke(self, request_id: str) -> bool:
        """Give a held request's blocks back now (e.g. shutdown); readers then fail.

        Returns:
            True if the request was held (its release follows in a later step).
        """
        if request_id not in self._held:
            return False
        self._to_release.append(request_id)
        return True

    # ---------------------------------------------------------------- queries
    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping (polling its workers) for us.

        Work to dispatch, loads in flight or blocks held for readers: each ends
        through worker outputs, which only arrive with steps (empty ones count).
        """
        return bool(self._to_send or self._to_release or self._to_notify
                    or self._loads or self._held)

    def load_state(self, request_id: str) -> Literal["planned", "allocated", "dispatched"] | None:
        """Where a request's load stands: planned (asked, no blocks yet), allocated
        (blocks recorded, workers not told yet), dispatched (workers reading), or None.
        """
        if request_id in self._planned:
            return "planned"
        load = self._loads.get(request_id)
        if load is None:
            return None
        return "dispatched" if load.dispatched else "allocated"

    @property
    def num_held_blocks(self) -> int:
        """Blocks held for remote readers right now."""
        return sum(self._held.values())

    def get_stats(self) -> ConnectorStats:
        """A snapshot of the counters and current gauges."""
        stats = self._stats.copy()
        stats.num_held_blocks = self.num_held_blocks
        stats.num_held_requests = len(self._held)
        stats.num_loads_in_flight = sum(1 for load in self._loads.values() if load.dispatched)
        return stats

    # ---------------------------------------------------------------- internals
    def _give_back(self, request_id: str, params: KVTransferParams, *, ok: bool) -> None:
        """Tell P (through the workers) that this engine will not read the request."""
        self._consumed.add(request_id)
        if not (params.remote_engine_id and params.remote_host and params.remote_port
                and params.grant):
            return
        self._to_notify.append(NotifyRequest(
            request_id=request_id, remote_engine_id=params.remote_engine_id,
            remote_host=params.remote_host, remote_port=params.remote_port,
            remote_ports=list(params.remote_ports), grant=params.grant, ok=ok,
        ))

    def _record_transfer_stats(self, output: KVConnectorOutput) -> None:
        stats = output.kv_connector_stats
        if not isinstance(stats, TransferStats):
            return
        self._stats.num_transfers += stats.num_transfers
        self._stats.num_failures += stats.num_failures
        self._stats.nbytes += stats.nbytes
        self._stats.num_local_copies += stats.num_local_copies
        self._stats.record_durations(stats.durations_s)
