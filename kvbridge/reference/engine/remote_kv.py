"""The engine scheduler's tracker of remote KV: loads into D's cache, blocks held on P.

``Scheduler`` (``engine/scheduler.py``) owns one :class:`RemoteKVTracker` when the
engine has a connector. The tracker keeps the request states that exist only
because of transfers, driven by the connector's scheduler side it holds
(``connector/scheduler.py``, :class:`ConnectorScheduler`)::

    waiting --get_num_new_matched_tokens: load async--> loading (blocks held,
        |                                               not schedulable)
        |                        finished_recving (maybe rolled back)
        |                                  v
        +<--------------------------- loaded (back at the head of waiting)

    finished --request_finished: delay free--> held --finished_sending--> freed

Failed loads: the connector names, for every load that ended, the first token
without valid KV (``StepOutcome.loads_ended``); the tracker applies the
engine's policy (``load_failure_policy``): ``recompute`` resumes the request
from there, ``fail`` hands it back to the scheduler with a :class:`KVLoadError`
message, and the scheduler fails it. (vLLM applies its own
``kv_load_failure_policy`` to the blocks the connector's workers report.)
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Literal

from kvbridge.connector.outputs import WorkerOutput
from kvbridge.connector.params import KVTransferParams
from kvbridge.connector.scheduler import ConnectorScheduler
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.reference.engine.request import EngineRequest, RequestStatus
from kvbridge.reference.paged.manager import KVCacheBlocks, KVCacheManager

__all__ = ["KVLoadError", "LoadFailurePolicy", "RemoteKVTracker"]

logger = logging.getLogger(__name__)

LoadFailurePolicy = Literal["recompute", "fail"]


class KVLoadError(KVBridgeError):
    """A request's KV could not be loaded and the policy is ``"fail"``.

    Attributes:
        request_id: the request.
        first_bad_token: first token whose KV is missing.
    """

    def __init__(self, request_id: str, first_bad_token: int) -> None:
        super().__init__(
            f"request {request_id!r}: loading its KV from the prefill engine failed "
            f"(KV missing from token {first_bad_token}; load_failure_policy 'recompute' "
            f"would compute it here instead)"
        )
        self.request_id = request_id
        self.first_bad_token = first_bad_token


class RemoteKVTracker:
    """Requests loading, loaded or held because of KV transfers.

    Args:
        manager: The engine's KV cache manager.
        connector: The connector's scheduler side.
        load_failure_policy: ``"recompute"`` resumes a request whose load
            failed from its first bad block; ``"fail"`` fails it
            (:class:`KVLoadError`).

    Raises:
        ConfigError: an unknown policy.
    """

    def __init__(self, manager: KVCacheManager, connector: ConnectorScheduler,
                 load_failure_policy: LoadFailurePolicy = "recompute") -> None:
        if load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(f"load_failure_policy must be recompute or fail, "
                              f"got {load_failure_policy!r}")
        self.manager = manager
        self.connector = connector
        self.load_failure_policy = load_failure_policy
        self._loading: dict[str, EngineRequest] = {}
        self._load_end: dict[str, int] = {}  # tokens in cache once the load is done
        self._rollback: dict[str, int] = {}
        self._loaded: set[str] = set()
        self._held: dict[str, EngineRequest] = {}

    # ---------------------------------------------------------------- reads

    @property
    def num_loading(self) -> int:
        """Requests waiting for their remote KV."""
        return len(self._loading)

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping for the connector (loads, holds, notices)."""
        return self.connector.has_pending_work()

    def num_held_blocks(self) -> int:
        """Blocks kept for remote readers."""
        return sum(len(self.manager.get_block_ids(r)[0]) for r in self._held)

    def is_held(self, request_id: str) -> bool:
        """Whether a finished request of that id still holds blocks for readers."""
        return request_id in self._held

    def is_loaded(self, request: EngineRequest) -> bool:
        """Whether ``request`` waits with its remote KV in place (it holds blocks)."""
        return request.request_id in self._loaded

    # ------------------------------------------------------------ admission

    def num_matched_tokens(self, request: EngineRequest, num_hit: int) -> tuple[int, bool]:
        """Prompt tokens a remote prefill provides beyond the ``num_hit`` local hits.

        Only requests that ask for a remote prefill (once) reach the connector.

        Returns:
            ``(num_external_tokens, load_async)``; ``(0, False)`` for local prefill.
        """
        if not request.wants_remote_prefill():
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        num_missing = request.num_tokens - num_hit
        if not 0 <= num_external <= num_missing:
            logger.warning("request %s: connector offers %d external tokens, %d are missing; "
                           "prefilling locally", request.request_id, num_external, num_missing)
            return 0, False
        if num_external == 0:
            return 0, False
        if not load_async:
            # Loaded inside the step: at least the last token must run for logits.
            num_external = min(num_external, num_missing - 1)
        return num_external, load_async

    def start_loading(self, request: EngineRequest, hit_blocks: KVCacheBlocks, num_hit: int,
                      num_external: int) -> bool:
        """Allocate blocks for the remote tokens and park ``request`` until they arrive.

        Returns:
            False (nothing changed) when the cache has no room now.
        """
        blocks = self.manager.allocate_slots(request, 0, num_hit, hit_blocks,
                                             delay_cache_blocks=True,
                                             num_external_computed_tokens=num_external)
        if blocks is None:
            return False
        request_id = request.request_id
        request.num_computed_tokens = num_hit
        request.num_cached_tokens = num_hit
        request.num_remote_tokens = num_external
        request.remote_load_done = True
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loading[request_id] = request
        self._load_end[request_id] = num_hit + num_external
        self.connector.update_state_after_alloc(request, self.manager.get_blocks(request_id),
                                                num_external)
        return True

    def after_alloc(self, request: EngineRequest, num_external: int) -> None:
        """Tell the connector about a remote-prefill request that runs locally now.

        E.g. a full local prefix hit: nothing is read, but P may release its blocks.
        """
        if request.wants_remote_prefill():
            request.remote_load_done = True
            request.num_remote_tokens = num_external
            self.connector.update_state_after_alloc(
                request, self.manager.get_blocks(request.request_id), num_external)

    def forget_loaded(self, request: EngineRequest) -> None:
        """``request`` (loaded) is running now."""
        self._loaded.discard(request.request_id)

    def forget_loading(self, request: EngineRequest) -> None:
        """Drop a loading request (aborted or failed) from the tracker's states."""
        request_id = request.request_id
        self._loading.pop(request_id, None)
        self._load_end.pop(request_id, None)
        self._rollback.pop(request_id, None)
        self._loaded.discard(request_id)

    # --------------------------------------------------------------- finish

    def release(self, request: EngineRequest) -> KVTransferParams | None:
        """Finish ``request`` with the connector; free its blocks or hold them.

        Returns:
            The ``kv_transfer_params`` the connector returns (prefill side).
        """
        request_id = request.request_id
        self._loaded.discard(request_id)
        aborted = request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        block_ids = self.manager.get_block_ids(request_id)[0]
        delay_free, params = self.connector.request_finished(request, block_ids, aborted=aborted)
        if delay_free and block_ids:
            self._held[request_id] = request
        else:
            self.manager.free(request)
        return params

    # -------------------------------------------------------------- updates

    def update(self, output: WorkerOutput | None,
               waiting: deque[EngineRequest]) -> list[tuple[EngineRequest, str]]:
        """Apply one step's connector news.

        Args:
            output: The workers' merged connector output (``None``: none this step).
            waiting: The scheduler's queue; loaded requests go to its head.

        Returns:
            Loading requests whose load failed for good (policy ``fail``), with
            the reason; the caller fails them (they are no longer tracked).
        """
        if output is None:
            return []
        outcome = self.connector.update_connector_output(output)
        failures: list[tuple[EngineRequest, str]] = []
        for request_id in sorted(outcome.loads_ended):
            request = self._loading.get(request_id)
            if request is None:
                continue
            first_bad_token = outcome.loads_ended[request_id]
            if first_bad_token is not None and self.load_failure_policy == "fail":
                self.forget_loading(request)
                failures.append((request, str(KVLoadError(request_id, first_bad_token))))
                continue
            self._on_loaded(request, first_bad_token, waiting)
        for request_id in outcome.to_free:
            held = self._held.pop(request_id, None)
            if held is not None:
                self.manager.free(held)
        return failures

    def _on_loaded(self, request: EngineRequest, first_bad_token: int | None,
                   waiting: deque[EngineRequest]) -> None:
        """Make a loaded request schedulable again from where its valid KV ends.

        ::

            prompt | local hits | loaded from P          | >= 1 token |
                   0            num_hit                  load_end
                                         ^ first bad token, if a block failed
            num_computed_tokens = min(end, num_tokens - 1): the last prompt
            token always runs again to produce logits.
        """
        request_id = request.request_id
        self._loading.pop(request_id)
        end = self._load_end.pop(request_id)
        if first_bad_token is not None:
            end = max(0, min(end, first_bad_token))
            logger.info("request %s: load failed from token %d on; recomputing", request_id,
                        end)
        self.manager.cache_blocks(request, end)
        request.num_remote_tokens = max(0, end - request.num_cached_tokens)
        request.num_computed_tokens = min(end, request.num_tokens - 1)
        request.status = RequestStatus.WAITING
        self._loaded.add(request_id)
        waiting.appendleft(request)
