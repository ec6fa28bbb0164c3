"""The connector's scheduler half in vLLM: vLLM's scheduler calls onto ``ConnectorScheduler``.

Lives in vLLM's engine-core process. The calls map one to one (see
``kvbridge.connector.scheduler`` for what each decides); this module only
translates vLLM's objects and covers where vLLM's contract differs from
kvbridge's own engine. It never edits vLLM's objects: what vLLM acts on (the
requests received, sent, failed) comes from the workers' own reports.

- vLLM recomputes or fails a request whose load failed by itself (its
  ``kv_load_failure_policy``), from the blocks the workers report
  (``get_block_ids_with_load_errors``); ``ConnectorScheduler``'s outcome of
  each step (where each load's valid KV ends) is not needed here.
- A request aborted while waiting for its KV keeps its blocks in vLLM until
  the workers report it received. If the workers were never told to read it,
  nothing would ever report it: the next step's metadata asks every worker to
  report it received (``StepMetadata.report_received``).
- P's workers listen on ports of their own choosing (zero config): the
  scheduler learns them from vLLM's handshake (``set_worker_addresses``) and
  announces them in every ``kv_transfer_params`` it returns.
- A model with a recurrent state (Mamba, linear attention) in the classic
  flow: D recomputes the prompt's last token and needs the state before it,
  which P's state after the whole prompt cannot be rewound to. P therefore
  leaves that token out before scheduling the request
  (:meth:`VllmSchedulerSide.on_new_request`, as vLLM's NixlConnector does);
  only a request marked ``first_token_flow`` (D continues after P's token)
  is computed whole.
- Small loads are synchronous (``VllmSettings.sync_load_max_bytes``): vLLM
  schedules the request in the step that allocates it and the workers finish
  the read before that step's forward. vLLM must then not hear of the request
  as received (it is running, not waiting for KV): the workers report the end
  of its read to this side only (``SyncLoadsEnded``, vLLM's worker metadata,
  counted here until every worker has reported it). A
  failed synchronous load reports its blocks in the same step, so vLLM drops
  the token computed on them and recomputes or fails as its policy says. So
  does one still running at its deadline (``sync_load_deadline_s``): the
  workers cancel its read and report its blocks once nothing of it writes
  them any more (``worker_side.py``), or, for a read the cancel could not
  stop, at once under ``fail``: its request, failed, then keeps its blocks
  (``delay_free``) until every worker's read has ended; the next step's
  metadata then asks the workers to report it received, and vLLM frees them.
  A load is synchronous only from a P this engine has read from before
  without a failure (a *warm* P): the first read from a P connects and
  handshakes with each of its ranks, which is no work for a forward to wait
  on; a P whose read failed is cold again until an asynchronous read from it
  succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvbridge.connector.aggregator import KVOutputAggregator
from kvbridge.connector.outputs import WorkerOutput
from kvbridge.connector.params import KVTransferParams, parse_kv_transfer_params
from kvbridge.connector.request import BlockIds
from kvbridge.connector.scheduler import ConnectorScheduler
from kvbridge.connector.stats import ConnectorStats
from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.facts import EngineFacts
from kvbridge.integrations.vllm.groups import NULL_BLOCK_ID, has_state
from kvbridge.integrations.vllm.messages import StepMetadata, SyncLoadsEnded, WorkerAddress
from kvbridge.integrations.vllm.settings import VllmSettings
from kvbridge.integrations.vllm.stats import KVBridgeStats
from kvbridge.topology import CacheGroup

__all__ = ["VllmSchedulerSide"]

logger = logging.getLogger(__name__)

_FINISHED_OK = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})


@dataclass(frozen=True, slots=True)
class _TransferBlocks:
    """A request's block ids of the transfer groups (``BlockIds``)."""

    block_ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.block_ids


@dataclass(frozen=True, slots=True)
class _RequestView:
    """A vLLM ``Request`` as ``ConnectorRequest`` (its params parsed)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    num_prompt_tokens: int
    kv_transfer_params: KVTransferParams | None
    num_computed_tokens: int

    @classmethod
    def of(cls, request: Request) -> _RequestView:
        tokens = request.prompt_token_ids
        # a prompt given as embeddings has no token ids to bind a grant to: no transfer
        params = parse_kv_transfer_params(request.kv_transfer_params) if tokens else None
        return cls(request.request_id, tokens or [], request.num_prompt_tokens, params,
                   request.num_computed_tokens)


class VllmSchedulerSide:
    """kvbridge's scheduler half for one vLLM engine.

    Args:
        facts: the engine's facts.
        settings: the connector's settings.
        groups: the transfer groups (``groups.cache_groups``); None: one group.
        transfer_group_ids: which of vLLM's groups they are (None: all).
        num_groups: vLLM's KV cache groups, transferred or not.
        num_blocks: blocks of the engine's KV cache (None: unknown, holds not
            capped); ``settings.max_held_share`` of them may be held for readers.
    """

    def __init__(self, facts: EngineFacts, settings: VllmSettings,
                 groups: tuple[CacheGroup, ...] | None = None,
                 transfer_group_ids: tuple[int, ...] | None = None,
                 num_groups: int = 1, num_blocks: int | None = None) -> None:
        self.facts, self.settings = facts, settings
        max_held = None if num_blocks is None else int(num_blocks * settings.max_held_share)
        self._scheduler = ConnectorScheduler(
            facts.engine_id, facts.role, facts.topology(fused_kv=False), settings.host,
            settings.base_port, facts.block_size, lease_s=settings.lease_s,
            groups=groups, null_block_id=NULL_BLOCK_ID, secret=settings.secret(),
            max_held_blocks=max_held,
        )
        self._transfer_group_ids = transfer_group_ids
        self._stops_short = has_state(groups) and facts.role != "decode"
        self._per_request_failures = num_groups > 1  # vLLM's rule for invalid block ids
        self._to_report: set[str] = set()  # for the workers to report received next step
        self._reported: set[str] = set()  # asked for: vLLM's received, not kvbridge's
        self._sync: set[str] = set()  # loads made synchronously, until their reads end
        self._sync_ended: set[str] = set()  # of those, requests ended: free when read
        # counts each synchronous load's workers until all of them reported its end
        self._sync_reads = KVOutputAggregator(facts.tp_size * facts.pp_size)
        self._loading_from: dict[str, str] = {}  # load in flight -> P's engine id
        self._warm: set[str] = set()  # P engines read from, last read without failure
        self._num_refused_reported = 0
        self._gauges_reported: dict[str, int] | None = None

    @property
    def scheduler(self) -> ConnectorScheduler:
        """kvbridge's scheduler half (for stats and tests)."""
        return self._scheduler

    def set_worker_addresses(self, addresses: Mapping[Any, object]) -> None:
        """Take the workers' addresses from vLLM's handshake (any key; ranks are inside).

        Raises:
            ConfigError: an address is missing or not kvbridge's.
        """
        ports: dict[int, int] = {}
        for address in addresses.values():
            if not isinstance(address, WorkerAddress):
                raise ConfigError(
                    f"handshake metadata {address!r} is not a kvbridge address: every worker "
                    f"of this engine must run KVBridgeConnector (kvbridge wrapped with another "
                    f"connector, e.g. in MultiConnector, is not supported)")
            ports[address.global_rank] = address.port
        world_size = self.facts.tp_size * self.facts.pp_size
        if sorted(ports) != list(range(world_size)):
            raise ConfigError(f"handshake: addresses of ranks {sorted(ports)}, expected "
                              f"0..{world_size - 1}: a worker did not start its transfer agent "
                              f"(its log says why)")
        if self.settings.base_port == 0:
            self._scheduler.set_worker_ports([ports[rank] for rank in range(world_size)])

    # ---------------------------------------------------------------- serving (P)
    def on_new_request(self, request: Request) -> None:
        """P of a state model, classic flow: drop the prompt's last token before scheduling.

        D will recompute that token from the state before it, so P computes
        the prompt without it and its state (and KV) is the one D continues
        from; P's own token is sampled there and only the params matter
        (the classic flow throws P's token away). vLLM's NixlConnector does
        the same (``_truncate_request_for_prefill``). A request whose params
        say ``first_token_flow``, or that asks for prompt logprobs (vLLM then
        reads no prefix cache: D recomputes its whole prompt), is computed whole.
        """
        if not self._stops_short or request.kv_transfer_params is None:
            return
        params = parse_kv_transfer_params(request.kv_transfer_params)
        tokens = request.prompt_token_ids
        if (params is None or not params.do_remote_decode or params.first_token_flow
                or tokens is None or request.num_prompt_tokens < 3
                or request.num_computed_tokens or request.get_skip_reading_prefix_cache()):
            return
        del tokens[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1

    # ---------------------------------------------------------------- loading (D)
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """``(tokens to load, load asynchronously)``; small loads are synchronous."""
        view = _RequestView.of(request)
        num_tokens, is_async = self._scheduler.get_num_new_matched_tokens(
            view, num_computed_tokens)
        params = view.kv_transfer_params
        engine_id = params.remote_engine_id if params is not None else None
        if not is_async or engine_id is None:
            return num_tokens, is_async
        self._loading_from[request.request_id] = engine_id
        if self._per_request_failures or engine_id not in self._warm:
            return num_tokens, is_async
        block_size = self.facts.block_size
        num_blocks = -(-(num_computed_tokens + num_tokens) // block_size) - (
            num_computed_tokens // block_size)
        nbytes = num_blocks * block_size * self.facts.kv_bytes_per_token
        if nbytes > (self.settings.sync_load_max_bytes or 0):
            return num_tokens, True
        self._sync.add(request.request_id)
        return num_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: BlockIds,
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(
            _RequestView.of(request), _TransferBlocks(self._transfer(blocks.get_block_ids())),
            num_external_tokens)

    def _transfer(self, block_ids: Sequence[list[int]]) -> tuple[list[int], ...]:
        """The transfer groups' lists of vLLM's per-group block ids."""
        if self._transfer_group_ids is None:
            return tuple(block_ids)
        return tuple(block_ids[index] for index in self._transfer_group_ids)

    # ---------------------------------------------------------------- every step
    def build_connector_meta(self, num_scheduled_tokens: int) -> StepMetadata:
        """The step's work for the workers.

        Args:
            num_scheduled_tokens: tokens the step computes; 0 lets the workers wait
                for a transfer to end (``VllmSettings.idle_wait_s``).
        """
        pending = self._scheduler.has_pending_work()
        work = self._scheduler.build_connector_meta()
        idle = num_scheduled_tokens == 0 and pending and work.is_empty()
        sync = frozenset(r.request_id for r in work.reqs_to_recv if r.request_id in self._sync)
        report = frozenset(self._to_report)
        self._reported |= report
        self._to_report = set()
        return StepMetadata(work=work, idle_wait_s=self.settings.idle_wait_s if idle else 0.0,
                            sync_loads=sync, report_received=report)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Take in the workers' aggregated output (read only: vLLM acts on it itself)."""
        recving = set(output.finished_recving or ())
        echoed = recving & self._reported  # asked for by this side: no load of kvbridge's
        self._reported -= echoed
        sync_ended = self._sync_loads_ended(output.kv_connector_worker_meta)
        recving = (recving - echoed) | sync_ended
        invalid = set(output.invalid_block_ids)
        failed_recving = set(getattr(output, "failed_recving", None) or ())
        for request_id in failed_recving:
            invalid.update(self._scheduler.loading_block_ids(request_id))
        self._track_warm(recving, failed_recving, invalid)
        stats = output.kv_connector_stats
        self._scheduler.update_connector_output(WorkerOutput(
            finished_sending=output.finished_sending, finished_recving=recving,
            stats=stats.to_transfer_stats() if isinstance(stats, KVBridgeStats) else None,
            invalid_block_ids=invalid,
        ))
        self._sync -= sync_ended
        freed = self._sync_ended & sync_ended
        if freed:  # ended while their (late) read went on: vLLM may free their blocks now
            self._sync_ended -= freed
            self._to_report |= freed

    def _sync_loads_ended(self, meta: KVConnectorWorkerMetadata | None) -> set[str]:
        """Synchronous loads whose read has now ended on every worker."""
        if not isinstance(meta, SyncLoadsEnded):
            return set()
        num_workers = self.facts.tp_size * self.facts.pp_size
        merged = self._sync_reads.aggregate(
            [WorkerOutput(finished_recving=set(meta.by_rank.get(rank, ())))
             for rank in range(num_workers)])
        return set(merged.finished_recving or ()) if merged is not None else set()

    def _track_warm(self, finished: set[str], failed: set[str], invalid: set[int]) -> None:
        """A P whose load failed (a late synchronous one included: its blocks are
        reported before its read ends) is cold; one whose load ended well is warm."""
        if failed or invalid:
            for request_id, engine_id in list(self._loading_from.items()):
                if request_id in failed or invalid.intersection(
                        self._scheduler.loading_block_ids(request_id)):
                    del self._loading_from[request_id]
                    self._warm.discard(engine_id)
        for request_id in finished:
            if request_id in self._loading_from:
                self._warm.add(self._loading_from.pop(request_id))

    # ---------------------------------------------------------------- request end
    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Keep a finished prefill's blocks for D (returns its params), or let them go.

        Args:
            request: the finished request.
            block_ids: its blocks per KV cache group (vLLM's, all groups).
        """
        request_id = request.request_id
        load = self._scheduler.load_state(request_id)
        aborted = request.status not in _FINISHED_OK
        groups = self._transfer(block_ids)
        delay, params = self._scheduler.request_finished(
            _RequestView.of(request), list(groups[0]) if len(groups) == 1 else groups,
            aborted=aborted)
        if load != "dispatched":
            self._sync.discard(request_id)  # no worker will report it
            self._loading_from.pop(request_id, None)
        elif request_id in self._sync:  # a late synchronous read may still write into them
            self._sync_ended.add(request_id)
            return True, None
        if load is not None:
            # a load's blocks are vLLM's to hold until the request is reported received
            if load == "allocated":
                self._to_report.add(request_id)
            return False, None
        return delay, params.to_json_dict() if params is not None else None

    def has_pending_work(self) -> bool:
        """Work the engine must keep stepping for (vLLM steps anyway while blocks are held)."""
        return self._scheduler.has_pending_work()

    def take_stats(self) -> KVBridgeStats | None:
        """This side's part of vLLM's stats: params refused since the last call, and
        the held gauges when they changed (None: nothing new)."""
        stats = self._scheduler.get_stats()
        refused = stats.num_params_refused - self._num_refused_reported
        gauges = {"held_bytes": stats.num_held_blocks * self.facts.block_size
                  * self.facts.kv_bytes_per_token * self.facts.tp_size * self.facts.pp_size,
                  "held_requests": stats.num_held_requests}
        changed = gauges != self._gauges_reported
        if not refused and not changed:
            return None
        self._num_refused_reported, self._gauges_reported = stats.num_params_refused, gauges
        return KVBridgeStats.of_scheduler(refused, gauges if changed else None)

    def get_stats(self) -> ConnectorStats:
        """kvbridge's counters and gauges of this engine."""
        return self._scheduler.get_stats()
