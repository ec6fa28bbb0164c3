"""``LLMEngine``: the reference engine's synchronous core (scheduler + TP workers + connector).

One engine owns a :class:`~kvbridge.reference.engine.scheduler.Scheduler` over a
``KVCacheManager``, a :class:`~kvbridge.reference.engine.workers.WorkerGroup` of TP worker
processes and, when configured, the connector (scheduler side here, one worker
side per TP rank). Callers add requests and call :meth:`LLMEngine.step` until
:meth:`LLMEngine.has_unfinished` is False; ``AsyncEngine`` runs that loop in a
thread for the HTTP server, :meth:`LLMEngine.generate` for scripts and tests.

One step::

    scheduler.schedule() --> [workers] start_load_kv(meta)   (connector only)
                             [workers] execute(batch)          -> sampled tokens
                             [workers] finish_step()           -> connector outputs
    aggregator.aggregate(outputs) --> scheduler.update_from_output(...) -> RequestOutputs

Not thread-safe: one thread drives an engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.connector.aggregator import KVOutputAggregator
from kvbridge.connector.params import KVTransferParams, parse_kv_transfer_params
from kvbridge.connector.scheduler import ConnectorScheduler
from kvbridge.connector.stats import ConnectorStats
from kvbridge.connector.worker import WorkerHandshake
from kvbridge.errors import KVBridgeError
from kvbridge.reference.engine import connector_host
from kvbridge.reference.engine.engine_config import EngineConfig
from kvbridge.reference.engine.request import EngineRequest, RequestOutput, SamplingParams
from kvbridge.reference.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from kvbridge.reference.engine.tokenizer import ByteTokenizer
from kvbridge.reference.engine.wakeup import Wakeup
from kvbridge.reference.engine.worker_ipc import WorkerGroupConfig
from kvbridge.reference.engine.workers import WorkerGroup
from kvbridge.reference.paged.hashing import BlockHasher
from kvbridge.reference.paged.manager import KVCacheManager

__all__ = ["EngineStats", "InvalidRequestError", "LLMEngine"]

logger = logging.getLogger(__name__)

#: Pause of ``generate`` when a step had nothing to run (requests wait for KV).
_IDLE_SLEEP_S = 0.001


class InvalidRequestError(KVBridgeError, ValueError):
    """A request the engine cannot serve (bad prompt, too long, duplicate id)."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Engine figures for logs and ``/metrics``.

    Attributes:
        scheduler: Request, block and prefix-cache counts.
        connector: The connector's counters (``None`` without a connector).
        num_steps: Steps run since start.
    """

    scheduler: SchedulerStats
    connector: ConnectorStats | None
    num_steps: int


class LLMEngine:
    """Scheduler, TP workers and connector of one serving instance.

    Args:
        config: What to run.
        clock: Monotonic seconds for arrival times and TTFT.

    Raises:
        ConfigError: an invalid configuration (e.g. a cache too small for one
            ``max_model_len`` request).
        WorkerError: a worker failed to start (every process is stopped again).
    """

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.model_config = model = config.model_config()
        self.clock = clock
        self.tokenizer = ByteTokenizer.for_model(model)
        kv_config = config.kv_cache_config()
        self.num_blocks = kv_config.num_blocks
        self.hasher = BlockHasher(config.hash_fn_name, config.hash_seed, config.block_size)
        self.manager = KVCacheManager(kv_config, model.max_model_len, self.hasher,
                                      enable_caching=config.enable_prefix_caching, log_stats=True)
        connector_scheduler: ConnectorScheduler | None = None
        extension: str | None = None
        extension_config: object = None
        if config.connector is not None:
            connector_scheduler, extension, extension_config = connector_host.build(config)
        # Set by workers when a transfer ends between steps (see AsyncEngine).
        self.wakeup = Wakeup()
        self._wakeup_sender = self.wakeup.sender()  # the workers' copy of the write end
        try:
            self.workers = WorkerGroup(WorkerGroupConfig(
                model=model,
                tp_size=config.tp_size,
                num_blocks=kv_config.num_blocks,
                block_size=config.block_size,
                layout=config.layout,
                device=config.device,
                weights_dir=config.weights_dir,
                max_num_reqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                worker_extension=extension,
                extension_config=extension_config,
                in_process=config.in_process,
                step_timeout_s=config.step_timeout_s,
            ), notify=self._wakeup_sender)
        except BaseException:
            self._wakeup_sender.close()
            self.wakeup.close()
            raise
        self.connector = connector_scheduler
        self._aggregator = (KVOutputAggregator.from_world_size(config.tp_size)
                            if connector_scheduler is not None else None)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=model.max_model_len,
                            eos_token_id=model.eos_token_id,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            load_failure_policy=(config.connector.load_failure_policy
                                                 if config.connector is not None
                                                 else "recompute")),
            self.manager, connector_scheduler, clock)
        self._num_steps = 0
        self._gen_ids = itertools.count()
        self.last_step_num_tokens = 0

    # ------------------------------------------------------------- requests

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        kv_transfer_params: object | None = None,
    ) -> EngineRequest:
        """Validate and build a request without queueing it (safe from any thread).

        Args:
            request_id: Unique id.
            prompt: Text (encoded with BOS) or token ids.
            params: Sampling and stop conditions (default ``SamplingParams()``).
            kv_transfer_params: Parsed params, their JSON-like ``dict`` form, or
                ``None``. Malformed ones mean local prefill (logged, no error).

        Raises:
            InvalidRequestError: empty id or prompt, a token outside the
                vocabulary, a prompt leaving no room for one output token, or
                a request that needs more blocks than the whole cache.
        """
        model = self.model_config
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not request_id or not token_ids:
            raise InvalidRequestError(f"request id ({request_id!r}) and prompt must be non-empty")
        bad = [t for t in token_ids if not 0 <= t < model.vocab_size]
        if bad:
            raise InvalidRequestError(f"request {request_id!r}: token ids {bad[:5]} outside "
                                      f"the vocabulary [0, {model.vocab_size})")
        if len(token_ids) >= model.max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt of {len(token_ids)} tokens leaves no room "
                f"for output within max_model_len {model.max_model_len}")
        params = params or SamplingParams()
        num_max_tokens = min(len(token_ids) + params.max_tokens, model.max_model_len)
        num_blocks_needed = -(-num_max_tokens // self.config.block_size)
        if num_blocks_needed > self.manager.num_usable_blocks:
            raise InvalidRequestError(
                f"request {request_id!r}: {num_max_tokens} tokens need {num_blocks_needed} "
                f"blocks, the cache has {self.manager.num_usable_blocks}")
        hasher = self.hasher if self.config.enable_prefix_caching else None
        return EngineRequest(request_id, token_ids, params, hasher, self.clock(),
                             self._parse_kv_transfer_params(request_id, kv_transfer_params))

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        kv_transfer_params: object | None = None,
    ) -> EngineRequest:
        """Validate a request and queue it (see :meth:`make_request` for the arguments).

        Returns:
            The queued request (read-only for the caller).

        Raises:
            InvalidRequestError: see :meth:`make_request`, or a duplicate id.
        """
        request = self.make_request(request_id, prompt, params, kv_transfer_params)
        self.submit(request)
        return request

    def submit(self, request: EngineRequest) -> None:
        """Queue a request built by :meth:`make_request`.

        Raises:
            InvalidRequestError: its id is in use.
        """
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and release it; no further output is reported for it.

        Returns:
            Whether the request was live.
        """
        found = self.scheduler.abort_request(request_id)
        if found and self._aggregator is not None and not self.scheduler.holds(request_id):
            self._aggregator.discard(request_id)
        return found

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, loading or running."""
        return self.scheduler.has_unfinished()

    def has_pending_transfers(self) -> bool:
        """Whether finished requests still hold blocks for remote readers (keep stepping)."""
        return self.scheduler.has_pending_transfers()

    def _parse_kv_transfer_params(self, request_id: str,
                                  raw: object | None) -> KVTransferParams | None:
        if raw is None:
            return None
        if self.connector is None:
            logger.warning("request %s carries kv_transfer_params but the engine has no "
                           "connector; prefilling locally", request_id)
            return None
        return parse_kv_transfer_params(raw)

    # ----------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step on the workers.

        Returns:
            Outputs of requests that got a token or failed this step.

        Raises:
            WorkerError: a worker failed; the engine cannot continue.
        """
        output = self.scheduler.schedule()
        self.last_step_num_tokens = output.num_scheduled_tokens
        connector_output = None
        if self.connector is not None:
            self.workers.call("start_load_kv", output.connector_metadata)
        sampled = self.workers.execute(output.step_batch()) if output.scheduled else []
        if self._aggregator is not None:
            connector_output = self._aggregator.aggregate(self.workers.call("finish_step"))
        self._num_steps += 1
        return self.scheduler.update_from_output(output, sampled, connector_output)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        kv_transfer_params: Sequence[object | None] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion (batched together with any other requests).

        Args:
            prompts: Texts or token id lists.
            params: One for all prompts, or one per prompt.
            kv_transfer_params: One per prompt (or ``None`` for none).

        Returns:
            One output per prompt, in order: ``new_token_ids`` holds the whole
            completion, ``kv_transfer_params`` the last reported.

        Raises:
            InvalidRequestError: a bad prompt (nothing was queued).
            ValueError: ``params`` or ``kv_transfer_params`` of the wrong length.
        """
        per_prompt = _per_prompt(params, len(prompts))
        transfers = list(kv_transfer_params) if kv_transfer_params is not None \
            else [None] * len(prompts)
        if len(transfers) != len(prompts):
            raise ValueError(f"{len(transfers)} kv_transfer_params for {len(prompts)} prompts")
        gen = next(self._gen_ids)
        requests = [self.make_request(f"generate-{gen}-{i}", p, sp, kv)
                    for i, (p, sp, kv) in enumerate(zip(prompts, per_prompt, transfers,
                                                         strict=True))]
        for request in requests:
            self.submit(request)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        last: dict[str, RequestOutput] = {}
        while len(last) < len(requests) or any(not o.finished for o in last.values()):
            for out in self.step():
                if out.request_id in tokens:
                    tokens[out.request_id] += out.new_token_ids
                    last[out.request_id] = out
            if self.last_step_num_tokens == 0:
                time.sleep(_IDLE_SLEEP_S)
        if self.connector is not None:
            # Work the last step queued (e.g. holding finished prefills' blocks
            # for readers) reaches the workers with the next one.
            self.step()
        return [_merged(last[r.request_id], tokens[r.request_id]) for r in requests]

    # ---------------------------------------------------------------- stats

    def handshakes(self) -> list[WorkerHandshake | None]:
        """Per TP rank, where its transfer agent listens (empty without a connector)."""
        if self.connector is None:
            return []
        handshakes: list[WorkerHandshake | None] = self.workers.call("handshake")
        return handshakes

    def get_stats(self) -> EngineStats:
        """Current scheduler and connector figures."""
        connector_stats = self.connector.get_stats() if self.connector is not None else None
        return EngineStats(self.scheduler.get_stats(), connector_stats, self._num_steps)

    def shutdown(self) -> None:
        """Stop the workers (and their connector workers). Idempotent."""
        self.workers.shutdown()
        self._wakeup_sender.close()
        self.wakeup.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                num_prompts: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
    return list(params)


def _merged(final: RequestOutput, token_ids: list[int]) -> RequestOutput:
    return dataclasses.replace(final, new_token_ids=token_ids)
