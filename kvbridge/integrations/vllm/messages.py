"""What crosses vLLM's process boundaries for the connector (pickled by vLLM).

- :class:`StepMetadata`: scheduler side -> every worker, once per step.
- :class:`SyncLoadsEnded`: each worker -> the scheduler side, with a step's
  output (``build_connector_worker_meta``; vLLM merges the workers'): the
  synchronous loads whose read ended on that worker, which vLLM must not hear
  of as received (their requests are running).
- :class:`WorkerAddress`: each worker -> the scheduler side, once at start-up
  (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``): where the
  worker's transfer agent listens, which P announces to readers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvbridge.connector.metadata import ConnectorMetadata

__all__ = ["StepMetadata", "SyncLoadsEnded", "WorkerAddress"]


@dataclass(frozen=True)
class StepMetadata(KVConnectorMetadata):
    """One step's connector work for the workers.

    Attributes:
        work: kvbridge's per-step metadata (reads, grants, notices, releases).
        idle_wait_s: the step computes nothing but transfers are under way:
            each worker may wait this long for one of them to end before it
            reports (0: report at once).
        sync_loads: requests among ``work``'s reads that this step's forward
            computes on: each worker finishes their reads before the forward,
            and reports their end to the scheduler side only
            (:class:`SyncLoadsEnded`), never to vLLM as received.
        report_received: requests whose blocks vLLM keeps for kvbridge and
            that no read writes any more (aborted before any worker read
            them, or ended while a late synchronous read went on): every
            worker reports them received this step, and vLLM frees them.
    """

    work: ConnectorMetadata
    idle_wait_s: float = 0.0
    sync_loads: frozenset[str] = frozenset()
    report_received: frozenset[str] = frozenset()


@dataclass(frozen=True)
class SyncLoadsEnded(KVConnectorWorkerMetadata):
    """Synchronous loads whose read ended, by worker (global rank).

    Attributes:
        by_rank: global rank -> the requests whose synchronous read ended on
            that worker (well or not) since its last report.
    """

    by_rank: Mapping[int, frozenset[str]]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SyncLoadsEnded:
        """Both reports in one (neither is modified)."""
        if not isinstance(other, SyncLoadsEnded):
            raise TypeError(f"cannot aggregate SyncLoadsEnded with {type(other).__name__}")
        by_rank = dict(self.by_rank)
        for rank, request_ids in other.by_rank.items():
            by_rank[rank] = by_rank.get(rank, frozenset()) | request_ids
        return SyncLoadsEnded(by_rank)


@dataclass(frozen=True)
class WorkerAddress(KVConnectorHandshakeMetadata):
    """Where one worker's transfer agent listens.

    Attributes:
        global_rank: ``pp_rank * tp_size + tp_rank``.
        port: the agent's UCX listening port.
    """

    global_rank: int
    port: int
