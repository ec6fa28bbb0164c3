"""The connector's worker half in vLLM: vLLM's worker calls onto kvbridge's ``ConnectorWorker``.

One per vLLM worker process (TP/PP rank). vLLM's model runner calls, per step
(steps with nothing to compute included)::

    bind_connector_metadata(StepMetadata)   (the facade keeps it)
    start_load_kv()      -> ConnectorWorker.start_load_kv: grants for finished prefills,
                            reads, notices, releases
    ... forward ...
    wait_for_save()      -> ConnectorWorker.wait_for_save (nothing left to do)
    get_finished()       -> ConnectorWorker.get_output(); (sending, recving) returned,
    get_block_ids_with_load_errors(), get_kv_connector_stats(),
    build_connector_worker_meta()  -> the rest of that output

On a step that computes nothing while transfers are under way, ``get_finished``
first waits (at most ``StepMetadata.idle_wait_s``) for the transfer agent to
say something ended, so an engine waiting for KV neither spins nor adds a
polling delay to the transfer.

Synchronous loads (``StepMetadata.sync_loads``, small reads the step's forward
computes on): ``start_load_kv`` returns when they have ended, well or not, or
soon after their deadline (``VllmSettings.sync_load_deadline_s``), whichever
comes first: a slow or stopped P never holds the whole batch for longer. What
the agent reported meanwhile is kept and reported by this step's
``get_finished``, failed blocks included, so vLLM drops a token computed on
blocks that did not arrive. Their requests are running, so vLLM must not hear
of them as received: when a synchronous read ends, this worker reports it to
the scheduler side only (``take_sync_loads_ended``, vLLM's worker metadata).
What the scheduler side asks to report received (``StepMetadata.report_received``)
is reported with the step's own.

A load still running at its deadline is *late*: its read is cancelled
(``ConnectorWorker.cancel_reads``), which ends it once nothing of it can write
into its blocks any more (``_QUIESCE_S`` at most, usually well under a
millisecond: receives withdrawn, copy threads stopped), and its blocks are
reported invalid at once: vLLM recomputes them or fails the request, as its
``kv_load_failure_policy`` says. A read given up without that would go on
writing whole blocks over what vLLM recomputes into them (the slots of D's new
tokens too: a wrong token, seen in CI before the cancel existed). What the
cancelled read reports when it ends is not reported again.

A read the cancel could not quiet in time (a chunk that went on landing) still
may write its blocks: under ``recompute`` the forward then waits for it to end,
on the agent's own deadlines (``_late_backstop_s``, so a broken agent cannot
stop vLLM for good); under ``fail`` its request, failed, keeps its blocks until
the read ends (``VllmSchedulerSide`` delays their free). A late read writes the
same prompt's KV that D recomputes (the grant is bound to the prompt).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping

import torch

from kvbridge.connector.metadata import RecvRequest
from kvbridge.connector.outputs import TransferStats, WorkerOutput
from kvbridge.connector.worker import ConnectorWorker
from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.facts import (
    EngineFacts,
    cache_topology,
    latent_views,
    unique_layer_caches,
)
from kvbridge.integrations.vllm.groups import registered_caches
from kvbridge.integrations.vllm.messages import StepMetadata, WorkerAddress
from kvbridge.integrations.vllm.settings import VllmSettings

__all__ = ["VllmWorkerSide"]

logger = logging.getLogger(__name__)

#: How long the forward waits for late synchronous loads to be cancelled (see the
#: module docstring): a chunk landing when the cancel came lands first.
_QUIESCE_S = 2.0


def written_block_ids(recv: RecvRequest, block_size: int) -> set[int]:
    """The local blocks a read writes (a partly loaded first block included)."""
    end_block = -(-recv.end_token // block_size)
    return set(recv.local_block_ids[recv.first_token // block_size : end_block]) | set(
        recv.missing_block_ids)


class VllmWorkerSide:
    """kvbridge's worker half for one vLLM worker.

    Args:
        facts: the engine's facts.
        settings: the connector's settings.
        tp_rank: this worker's TP rank.
        pp_rank: this worker's PP rank.
    """

    def __init__(self, facts: EngineFacts, settings: VllmSettings, tp_rank: int,
                 pp_rank: int, *, recompute: bool = False) -> None:
        self.facts, self.settings = facts, settings
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        # vLLM recomputes a failed load into the same blocks: a late load whose read
        # the cancel could not quiet is waited for (it ends by the agent's
        # read_timeout_s; the backstop only keeps a broken agent from stopping vLLM)
        self._recompute = recompute
        self._late_backstop_s = settings.agent_config().read_timeout_s + 5.0
        self._worker: ConnectorWorker | None = None
        self._news = threading.Event()  # set from the agent's thread: something ended
        self._sending: set[str] = set()  # reported by the agent, not yet to vLLM
        self._recving: set[str] = set()
        self._invalid: set[int] = set()
        self._failed_recving: set[str] = set()
        self._stats: TransferStats | None = None
        self._num_sync_loads = 0
        self._num_late_sync_loads = 0
        self._late: dict[str, set[int]] = {}  # late sync load -> its blocks (reported invalid)
        self._sync_reading: set[str] = set()  # synchronous loads whose read goes on
        self._sync_ended: set[str] = set()  # of those, ended: for the scheduler side only

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Start this worker's transfer agent on vLLM's caches.

        Raises:
            ConfigError: caches kvbridge cannot move, or called twice.
            TransferError: the agent could not start (e.g. ``base_port`` taken).
        """
        if self._worker is not None:
            raise ConfigError("register_kv_caches called twice")
        # MLA: no KV cache groups of other kinds; hybrid buffers: one view each
        caches = (unique_layer_caches(kv_caches) if self.facts.is_mla
                  else registered_caches(kv_caches))
        layers = latent_views(self.facts, caches)
        topology, compat = cache_topology(self.facts, layers)
        if self.facts.pp_size == 1 and topology.num_layers != len(layers):
            # KV cache groups share buffers (vLLM's hybrid manager): one per group slot
            topology = dataclasses.replace(topology, num_layers=len(layers))
        settings = self.settings
        worker = ConnectorWorker(
            self.facts.engine_id, topology, self.tp_rank, self.pp_rank, compat,
            host=settings.host, base_port=settings.base_port, secret=settings.secret(),
            host_buffer=settings.host_buffer, agent_config=settings.agent_config(),
            on_event=self._news.set,
        )
        try:
            worker.register_kv_caches(layers)
        except BaseException:
            worker.shutdown()
            raise
        self._worker = worker
        meta = worker.handshake_metadata
        assert meta is not None
        logger.info("kvbridge worker %s rank %d: %d layers, agent on %s:%d", meta.engine_id,
                    meta.global_rank, len(layers), settings.host, meta.port)

    def address(self) -> WorkerAddress | None:
        """Where this worker's agent listens (None before ``register_kv_caches``)."""
        meta = self._worker.handshake_metadata if self._worker is not None else None
        if meta is None:
            return None
        return WorkerAddress(global_rank=meta.global_rank, port=meta.port)

    def start_load_kv(self, metadata: StepMetadata) -> None:
        """Start the step's reads, notices and releases; finish its synchronous loads."""
        worker = self._require()
        worker.start_load_kv(metadata.work)
        if metadata.sync_loads:
            self._sync_reading |= metadata.sync_loads
            blocks = {recv.request_id: written_block_ids(recv, self.facts.block_size)
                      for recv in metadata.work.reqs_to_recv
                      if recv.request_id in metadata.sync_loads}
            self._finish_sync_loads(worker, blocks)

    def _finish_sync_loads(self, worker: ConnectorWorker, blocks: dict[str, set[int]]) -> None:
        """Wait until every read in ``blocks`` has ended, or cancel those late at their
        deadline (see the module docstring).

        Args:
            blocks: the local blocks each synchronous load writes, by request.
        """
        self._num_sync_loads += len(blocks)
        waiting = set(blocks)
        self._wait_for(worker, waiting, self.settings.sync_load_deadline_s)
        if not waiting:
            return
        quiet = self._cancel(worker, waiting)
        self._give_up(waiting & quiet, blocks)  # before their reports are collected
        stuck = waiting - quiet
        if not stuck:
            return
        logger.warning("synchronous loads of %s: their reads, cancelled, may still land in "
                       "their blocks after %.1fs%s", sorted(stuck), _QUIESCE_S,
                       "; waiting for them to end (the agent's read_timeout_s)"
                       if self._recompute else "")
        if self._recompute:  # else their requests, failed, keep the blocks meanwhile
            self._wait_for(worker, stuck, self._late_backstop_s)  # ended: reported as such
        self._give_up(stuck, blocks)

    def _give_up(self, late: set[str], blocks: dict[str, set[int]]) -> None:
        """Report late loads' blocks invalid now; what their reads report later is not
        reported again."""
        if not late:
            return
        logger.warning("synchronous loads of %s still running after sync_load_deadline_s "
                       "(%.3fs): cancelled, vLLM recomputes or fails their requests",
                       sorted(late), self.settings.sync_load_deadline_s)
        self._num_late_sync_loads += len(late)
        for request_id in late:
            self._late[request_id] = blocks[request_id]
            self._invalid |= blocks[request_id]

    def _wait_for(self, worker: ConnectorWorker, waiting: set[str], timeout_s: float) -> None:
        """Collect the agent's news until the reads in ``waiting`` ended (each taken out
        of it) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._news.clear()
            self._collect(worker, worker.get_output())
            waiting -= self._recving
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            self._news.wait(min(left, 1.0))

    @staticmethod
    def _cancel(worker: ConnectorWorker, request_ids: set[str]) -> set[str]:
        """Cancel the reads of ``request_ids``; those sure to write their blocks no more."""
        cancelled = worker.cancel_reads(request_ids, _QUIESCE_S)
        try:
            return cancelled.result(_QUIESCE_S + 1.0)
        except concurrent.futures.TimeoutError:  # the agent's loop did not answer
            return set()

    def _collect(self, worker: ConnectorWorker, output: WorkerOutput) -> None:
        self._sending |= output.finished_sending or set()
        recving = output.finished_recving or set()
        self._recving |= recving
        late_blocks = set().union(*self._late.values()) if self._late else set()
        self._invalid |= output.invalid_block_ids - late_blocks  # reported at the deadline
        self._failed_recving |= worker.take_failed_recving() - self._late.keys()
        for request_id in recving & self._late.keys():
            del self._late[request_id]
        stats = output.stats
        if isinstance(stats, TransferStats):
            self._stats = stats if self._stats is None else self._stats.aggregate(stats)

    def wait_for_save(self) -> None:
        """Nothing left to do (``start_load_kv`` held the finished prefills)."""
        self._require().wait_for_save()

    def get_finished(self, metadata: StepMetadata | None) -> tuple[set[str] | None,
                                                                   set[str] | None]:
        """``(finished sending, finished recving)`` since the last step.

        The step's failed blocks and stats are kept for the two calls that
        follow in the same step.
        """
        worker = self._worker
        if worker is None:
            return None, None
        if metadata is not None and metadata.idle_wait_s > 0:
            self._news.wait(metadata.idle_wait_s)
        self._news.clear()
        self._collect(worker, worker.get_output())
        sync_ended = self._recving & self._sync_reading
        self._sync_reading -= sync_ended
        self._sync_ended |= sync_ended
        sending, recving = self._sending, self._recving - sync_ended
        if metadata is not None:
            recving |= metadata.report_received
        self._sending, self._recving = set(), set()
        return sending or None, recving or None

    def take_sync_loads_ended(self) -> frozenset[str]:
        """Synchronous loads whose read ended here since the last call (not told to vLLM)."""
        ended, self._sync_ended = frozenset(self._sync_ended), set()
        return ended

    @property
    def global_rank(self) -> int:
        """``pp_rank * tp_size + tp_rank``."""
        return self.pp_rank * self.facts.tp_size + self.tp_rank

    def take_invalid_block_ids(self) -> set[int]:
        """Blocks whose load failed, reported no later than their request's recving."""
        invalid, self._invalid = self._invalid, set()
        return invalid

    def take_failed_recving(self) -> set[str]:
        """Requests reported received whose load failed (with or before that report)."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_stats(self) -> TransferStats | None:
        """Stats of the reads that ended since the last call, or None."""
        stats, self._stats = self._stats, None
        return stats

    def take_num_sync_loads(self) -> tuple[int, int]:
        """Synchronous loads made since the last call, and those of them that were late."""
        num, self._num_sync_loads = self._num_sync_loads, 0
        late, self._num_late_sync_loads = self._num_late_sync_loads, 0
        return num, late

    def shutdown(self) -> None:
        """Stop the transfer agent. Idempotent."""
        if self._worker is not None:
            self._worker.shutdown()

    def _require(self) -> ConnectorWorker:
        if self._worker is None:
            raise ConfigError("register_kv_caches must be called first")
        return self._worker
