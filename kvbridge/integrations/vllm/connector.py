"""``KVBridgeConnector``: kvbridge as a vLLM KV connector (``KVConnectorBase_V1``).

vLLM builds the class once per role: in its engine-core process as the
scheduler's connector, and in every worker process as the worker's. The role
picks which half exists (``scheduler_side.VllmSchedulerSide`` or
``worker_side.VllmWorkerSide``); this class only forwards vLLM's calls to it.

Use (both P and D; nothing else is needed on one host)::

    python -m vllm.entrypoints.openai.api_server --model M --kv-transfer-config \\
      '{"kv_connector":"KVBridgeConnector","kv_connector_module_path":"kvbridge.integrations.vllm","kv_role":"kv_both"}'

A request sent to P with ``"kv_transfer_params": {"do_remote_decode": true}``
comes back with the params D needs (vLLM's ``NixlConnector`` keys plus
kvbridge's grant); sent to D with those params, D reads the prompt's KV from
P instead of computing it. ``kv_connector_extra_config``: ``settings.py``.

vLLM (0.32) calls ``start_load_kv`` after the step's forward unless the
step has synchronous loads: on a GPU that is after the forward's launch, a
few milliseconds in; on a CPU it is after the whole forward, which the
calling thread computes. There, P's grants for the prefills that ended in the
last step would be issued only after the next one (a whole prefill of another
prompt: D's read waited for it, issue #40's timeline showed P's "publish" at
~1.2 s for 2.4 s prefills), and D's reads would start after D's forward. So on
a CPU, a step that issues grants or starts reads asks vLLM to start them
before its forward (``SchedulerOutput.has_sync_kv_loads``, as vLLM's own
HiSparse connector does); issuing a grant and starting a read return at once
(a same-host read the grant board allows is copied then, on that thread).

It declares ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, and
block ids come per KV cache group (``groups.py``): sliding-window groups move
only their window, Mamba / linear-attention groups their state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvbridge.connector.outputs import TransferStats
from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.facts import engine_facts
from kvbridge.integrations.vllm.groups import cache_groups
from kvbridge.integrations.vllm.messages import StepMetadata, SyncLoadsEnded
from kvbridge.integrations.vllm.scheduler_side import VllmSchedulerSide
from kvbridge.integrations.vllm.settings import (
    for_data_parallel_rank,
    for_failure_policy,
    parse_settings,
)
from kvbridge.integrations.vllm.stats import KVBridgePromMetrics, KVBridgeStats
from kvbridge.integrations.vllm.worker_side import VllmWorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVBridgeConnector"]


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge's P/D connector for vLLM (see the module docstring).

    Args:
        vllm_config: the engine's config (``kv_transfer_config`` must be set).
        role: ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
        kv_cache_config: vLLM's KV cache config.

    Raises:
        ConfigError: bad ``kv_connector_extra_config`` or ``kv_role``, or KV
            cache groups kvbridge cannot move.
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None  # the base class checked
        settings = for_failure_policy(
            parse_settings(transfer_config.kv_connector_extra_config),
            transfer_config.kv_load_failure_policy)
        facts = engine_facts(vllm_config, settings.model_id)
        settings = for_data_parallel_rank(
            settings, vllm_config.parallel_config.data_parallel_rank,
            facts.tp_size * facts.pp_size)
        groups, transfer_ids, num_groups = None, None, 1
        if kv_cache_config is not None:
            groups = cache_groups(kv_cache_config, facts.block_size)
            transfer_ids = tuple(kv_cache_config.transfer_group_ids)
            num_groups = len(kv_cache_config.kv_cache_groups)
            if len(groups) > 1 and facts.pp_size > 1:
                raise ConfigError(f"kvbridge moves a model with {len(groups)} KV cache groups "
                                  f"(sliding window, Mamba) without pipeline parallelism; "
                                  f"pipeline_parallel_size is {facts.pp_size}")
        # vLLM takes a failed load of a model with several groups per request only
        self._per_request_failures = num_groups > 1
        self._scheduler: VllmSchedulerSide | None = None
        self._worker: VllmWorkerSide | None = None
        # Where a forward is computed by the calling thread (vLLM CPU), a step's grants
        # and reads start before it, not after it (``build_connector_meta``): see the
        # module docstring.
        self._start_before_forward = current_platform.is_cpu()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = VllmSchedulerSide(
                facts, settings, groups, transfer_ids, num_groups,
                num_blocks=kv_cache_config.num_blocks if kv_cache_config is not None else None)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            self._worker = VllmWorkerSide(
                facts, settings, get_tp_group().rank_in_group, get_pp_group().rank_in_group,
                recompute=transfer_config.kv_load_failure_policy == "recompute")

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker_side().address()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().start_load_kv(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads ended in start_load_kv; others before their step

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # P serves its blocks where they are: nothing to save per layer

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        metadata = self._connector_metadata
        return self._worker_side().get_finished(
            metadata if isinstance(metadata, StepMetadata) else None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_recving() if self._worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()),
            failed_recving=failed if self._per_request_failures else set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid = self._worker_side().take_invalid_block_ids()
        return set() if self._per_request_failures else invalid  # else: failed_recving

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:  # vLLM also asks the scheduler's connector
            return self._scheduler.take_stats() if self._scheduler is not None else None
        stats = self._worker.take_stats()
        num_sync_loads, num_late = self._worker.take_num_sync_loads()
        if (stats is None or stats.is_empty()) and not num_sync_loads and not num_late:
            return None
        return KVBridgeStats.of(stats or TransferStats(), num_sync_loads, num_late)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        ended = self._worker.take_sync_loads_ended()
        return SyncLoadsEnded({self._worker.global_rank: ended}) if ended else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ================================================================ scheduler side
    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._scheduler_side().build_connector_meta(
            scheduler_output.total_num_scheduled_tokens)
        work = meta.work
        if self._start_before_forward and (work.reqs_to_send or work.reqs_to_recv):
            # vLLM starts a step's loads after its forward unless it has synchronous
            # ones (vLLM's own HiSparse connector asks so the same way)
            scheduler_output.has_sync_kv_loads = True
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._scheduler_side().set_worker_addresses(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._scheduler_side().set_worker_addresses(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    # ================================================================ class-level
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads outside tokens in a block (a head slice is one run): vLLM's LBHNC."""
        model_config = vllm_config.model_config
        return None if model_config is None or model_config.use_mla else "LBHNC"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVBridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    # ================================================================ internals
    def _step_metadata(self) -> StepMetadata:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, StepMetadata):
            raise ConfigError(f"connector metadata is {type(metadata).__name__}, not kvbridge's")
        return metadata

    def _worker_side(self) -> VllmWorkerSide:
        if self._worker is None:
            raise ConfigError("a worker-side call reached the scheduler's connector")
        return self._worker

    def _scheduler_side(self) -> VllmSchedulerSide:
        if self._scheduler is None:
            raise ConfigError("a scheduler-side call reached a worker's connector")
        return self._scheduler
