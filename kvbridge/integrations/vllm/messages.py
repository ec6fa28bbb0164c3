"""What crosses vLLM's process boundaries for the connector (pickled by vLLM).

- :class:`StepMetadata`: scheduler side -> every worker, once per step.
- :class:`WorkerAddress`: each worker -> the scheduler side, once at start-up
  (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``): where the
  worker's transfer agent listens, which P announces to readers.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvbridge.connector.metadata import ConnectorMetadata

__all__ = ["StepMetadata", "WorkerAddress"]


@dataclass(frozen=True)
class StepMetadata(KVConnectorMetadata):
    """One step's connector work for the workers.

    Attributes:
        work: kvbridge's per-step metadata (reads, grants, notices, releases).
        idle_wait_s: the step computes nothing but transfers are under way:
            each worker may wait this long for one of them to end before it
            reports (0: report at once).
        sync_loads: requests among ``work``'s reads that this step's forward
            computes on: each worker finishes their reads before the forward.
    """

    work: ConnectorMetadata
    idle_wait_s: float = 0.0
    sync_loads: frozenset[str] = frozenset()


@dataclass(frozen=True)
class WorkerAddress(KVConnectorHandshakeMetadata):
    """Where one worker's transfer agent listens.

    Attributes:
        global_rank: ``pp_rank * tp_size + tp_rank``.
        port: the agent's UCX listening port.
    """

    global_rank: int
    port: int
