"""Continuous-batching scheduler of the reference engine, with the connector wired in.

``LLMEngine`` owns one :class:`Scheduler`; each step it calls :meth:`Scheduler.schedule`,
runs the resulting batch on its workers and hands the sampled tokens and the
merged connector output to :meth:`Scheduler.update_from_output`.

Per step the token budget (``max_num_batched_tokens``) goes first to running
requests (one token each when decoding, the next chunk of a chunked prefill),
then to waiting requests in arrival order (prefix-cache hits are skipped, long
prompts are split over steps). When the KV cache runs out, the most recently
admitted running request is preempted (its blocks freed; it recomputes later).

A request whose ``kv_transfer_params`` ask for a remote prefill gets blocks for
the remote tokens and waits in ``WAITING_FOR_REMOTE_KVS`` until the connector
reports it loaded (``remote_kv.py`` tracks those loads). Finished requests go
through the connector's ``request_finished``, which may keep their blocks for
remote readers (prefill side) until it reports them sent.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbridge.connector.outputs import WorkerOutput
from kvbridge.connector.params import KVTransferParams
from kvbridge.connector.scheduler import ConnectorScheduler
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.reference.engine.remote_kv import LoadFailurePolicy, RemoteKVTracker
from kvbridge.reference.engine.request import (
    EngineRequest,
    FinishReason,
    RequestOutput,
    RequestStatus,
)
from kvbridge.reference.engine.scheduler_output import (
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from kvbridge.reference.paged.manager import AllocationError, KVCacheManager

__all__ = [
    "DuplicateRequestError",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]

logger = logging.getLogger(__name__)


class DuplicateRequestError(KVBridgeError, ValueError):
    """A request id is already in use in this engine."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batch limits and stop rules.

    Attributes:
        max_num_seqs: Most requests running at once (and in one step).
        max_num_batched_tokens: Most tokens computed in one step.
        max_model_len: Longest request (prompt + output).
        eos_token_id: Token that stops a request (unless it ignores EOS).
        enable_chunked_prefill: Split prompts longer than the step's budget.
        load_failure_policy: What becomes of a request whose remote KV could
            not be loaded: ``recompute`` it from the first missing token, or
            ``fail`` it (``remote_kv.py``).

    Raises:
        ConfigError: a non-positive limit, or chunked prefill disabled with a
            budget smaller than ``max_model_len``.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_id: int
    enable_chunked_prefill: bool = True
    load_failure_policy: LoadFailurePolicy = "recompute"

    def __post_init__(self) -> None:
        limits = (self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)
        if min(limits) < 1:
            raise ConfigError(f"max_num_seqs {self.max_num_seqs}, max_num_batched_tokens "
                              f"{self.max_num_batched_tokens} and max_model_len "
                              f"{self.max_model_len} must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"without chunked prefill max_num_batched_tokens "
                              f"({self.max_num_batched_tokens}) must be >= max_model_len "
                              f"({self.max_model_len})")


@dataclass(slots=True)
class _StepState:
    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


class Scheduler:
    """Decides each step's batch over one ``KVCacheManager``; owns every live request.

    Args:
        config: Limits and stop rules.
        manager: The engine's KV cache manager (created with ``log_stats=True``
            for prefix-cache stats).
        connector: The connector's scheduler side, or ``None`` (colocated only).
        clock: Monotonic seconds, for arrival and first-token times.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        manager: KVCacheManager,
        connector: ConnectorScheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.manager = manager
        self.clock = clock
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._remote = (RemoteKVTracker(manager, connector, config.load_failure_policy)
                        if connector is not None else None)
        self._finished_ids: set[str] = set()
        self._pending_outputs: list[RequestOutput] = []
        self._step_id = 0
        self._num_preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    # ------------------------------------------------------------- requests

    def add_request(self, request: EngineRequest) -> None:
        """Queue a new request.

        Raises:
            DuplicateRequestError: the id is in use (nothing changed).
        """
        if request.request_id in self.requests or (
                self._remote is not None and self._remote.is_held(request.request_id)):
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Finish a live request as aborted and release it (no output is reported).

        Returns:
            Whether the request was live.
        """
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert self._remote is not None
            self._remote.forget_loading(request)
        else:
            self.waiting.remove(request)
        request.finish(FinishReason.ABORT)
        self._release(request)
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, loading or running."""
        return bool(self.requests)

    def holds(self, request_id: str) -> bool:
        """Whether a finished request's blocks are still kept for the connector."""
        return self._remote is not None and self._remote.is_held(request_id)

    def has_pending_transfers(self) -> bool:
        """Whether the connector needs more steps (loads, blocks held for readers, notices)."""
        return self._remote is not None and self._remote.has_pending_work()

    # ----------------------------------------------------------- scheduling

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and allocate their slots.

        Returns:
            The step; ``num_computed_tokens`` of every scheduled request is
            already advanced past its scheduled tokens.
        """
        self._step_id += 1
        state = _StepState(self.config.max_num_batched_tokens)
        self._schedule_running(state)
        if not state.preempted:
            self._schedule_waiting(state)
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        output = SchedulerOutput(self._step_id, state.scheduled, frozenset(state.preempted),
                                 finished)
        if self._remote is not None:
            output.connector_metadata = self._remote.connector.build_connector_meta(output)
        return output

    def _schedule_running(self, state: _StepState) -> None:
        index = 0
        while index < len(self.running) and state.budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, state.budget)
            assert num_new > 0, f"running request {request!r} has nothing to compute"
            while self.manager.allocate_slots(request, num_new) is None:
                # Out of blocks: the latest admitted request (never one already
                # scheduled this step: those sit before ``index``) gives its up.
                victim = self.running.pop()
                self._preempt(victim)
                state.preempted.add(victim.request_id)
                if victim is request:
                    return
            self._commit(request, num_new, state, is_new=False)
            index += 1

    def _preempt(self, request: EngineRequest) -> None:
        self.manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def _schedule_waiting(self, state: _StepState) -> None:
        while (self.waiting and state.budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            try:
                if not self._admit(request, state):
                    return
            except AllocationError as exc:  # can never fit; fail it, keep scheduling
                self.waiting.popleft()
                self._fail(request, f"cannot schedule request: {exc}")

    def _admit(self, request: EngineRequest, state: _StepState) -> bool:
        """Try to start ``request`` (the head of ``waiting``); False when out of room."""
        remote = self._remote
        if remote is not None and remote.is_loaded(request):
            # KV arrived from a remote prefill: blocks are held, progress is set.
            num_new = min(request.num_tokens - request.num_computed_tokens, state.budget)
            if self.manager.allocate_slots(request, num_new) is None:
                return False
            remote.forget_loaded(request)
            self._start(request, num_new, state)
            return True
        hit_blocks, num_hit = self.manager.get_computed_blocks(request)
        num_external = 0
        if remote is not None:
            num_external, load_async = remote.num_matched_tokens(request, num_hit)
            if load_async:  # parked until its KV arrives; takes no budget this step
                if not remote.start_loading(request, hit_blocks, num_hit, num_external):
                    return False
                self.waiting.popleft()
                return True
        num_new = request.num_tokens - num_hit - num_external
        if not self.config.enable_chunked_prefill and num_new > state.budget:
            return False
        num_new = min(num_new, state.budget)
        blocks = self.manager.allocate_slots(request, num_new, num_hit, hit_blocks,
                                             num_external_computed_tokens=num_external)
        if blocks is None:
            return False
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit + num_external
        if remote is not None:
            remote.after_alloc(request, num_external)
        self._start(request, num_new, state)
        return True

    def _start(self, request: EngineRequest, num_new: int, state: _StepState) -> None:
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._commit(request, num_new, state, is_new=True)

    def _commit(self, request: EngineRequest, num_new: int, state: _StepState,
                is_new: bool) -> None:
        """Record ``num_new`` tokens of ``request`` in the step and advance its progress.

        ::

            all_token_ids  | in cache        | this step       | not yet |
                           0                 start             end
            sample = (end == num_tokens): the step reaches the last token.
        """
        start = request.num_computed_tokens
        end = start + num_new
        state.scheduled.append(ScheduledRequest(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids[start:end]),
            start_pos=start,
            block_ids=self.manager.get_block_ids(request.request_id)[0],
            sample=end == request.num_tokens,
            sampling=request.sampler_params,
            is_new=is_new,
        ))
        request.num_computed_tokens = end
        state.budget -= num_new

    # -------------------------------------------------------------- results

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Sequence[int],
        connector_output: WorkerOutput | None = None,
    ) -> list[RequestOutput]:
        """Append the step's sampled tokens, finish requests, apply connector news.

        Args:
            output: The step, as returned by :meth:`schedule`.
            sampled_token_ids: One token per scheduled request with ``sample``.
            connector_output: The workers' merged connector output, if any.

        Returns:
            One output per request that got a token, plus requests that failed.

        Raises:
            ValueError: the number of sampled tokens does not match the step.
        """
        sampling = [s for s in output.scheduled if s.sample]
        if len(sampling) != len(sampled_token_ids):
            raise ValueError(f"step {output.step_id}: {len(sampled_token_ids)} sampled tokens "
                             f"for {len(sampling)} sampling requests")
        outputs, self._pending_outputs = self._pending_outputs, []
        now = self.clock()
        for scheduled, token in zip(sampling, sampled_token_ids, strict=True):
            request = self.requests.get(scheduled.req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.append_output_token_ids(token)
            if request.first_token_time_s is None:
                request.first_token_time_s = now
            reason = request.stop_reason(self.config.eos_token_id, self.config.max_model_len)
            params = None
            if reason is not None:
                request.finish(reason)
                self.running.remove(request)
                params = self._release(request)
            outputs.append(RequestOutput.of(request, [token], params))
        if self._remote is not None:
            failed = self._remote.update(connector_output, self.waiting)
            for request, message in failed:
                self._fail(request, message)
        outputs.extend(self._pending_outputs)
        self._pending_outputs = []
        return outputs

    def _fail(self, request: EngineRequest, message: str) -> None:
        """Finish ``request`` with an error; its output goes out with the next results."""
        logger.warning("request %s failed: %s", request.request_id, message)
        request.finish(FinishReason.ERROR, message)
        self._release(request)
        self._pending_outputs.append(RequestOutput.of(request, []))

    def _release(self, request: EngineRequest) -> KVTransferParams | None:
        """Forget a finished request and free its blocks (or let the connector keep them).

        Returns:
            The connector's ``kv_transfer_params`` for the request, if any.
        """
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        if self._remote is None:
            self.manager.free(request)
            return None
        return self._remote.release(request)

    # ---------------------------------------------------------------- stats

    def get_stats(self) -> SchedulerStats:
        """Current counts; prefix-cache totals include lookups since the last call."""
        prefix = self.manager.make_prefix_cache_stats()
        if prefix is not None:
            self._prefix_queries += prefix.queries
            self._prefix_hits += prefix.hits
        remote = self._remote
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_remote_kvs=remote.num_loading if remote is not None else 0,
            num_free_blocks=self.manager.num_free_blocks,
            num_usable_blocks=self.manager.num_usable_blocks,
            num_blocks_held_for_transfer=remote.num_held_blocks() if remote is not None else 0,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
        )
