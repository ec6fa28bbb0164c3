"""Result records every peer returns, and the statistics they are built from.

``run_peer`` in each peer module returns either one :class:`PeerResult` per
requested size or a single :class:`Unavailable`; ``kvbridge/bench/transfer_bench.py``
turns both into table rows, JSON and plot lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PeerResult:
    """Measured numbers of one peer at one request size.

    Attributes:
        peer: Peer name (``ucx_perftest``, ``nixl``, ``mooncake``).
        nbytes: Bytes moved per request.
        num_blocks: Scattered blocks per request (1 for a single message).
        num_iters: Timed requests (warm-up excluded).
        gbps_median: Median over requests of ``nbytes / duration`` in GB/s (1e9 B/s).
        latency_p50_us: Median request duration, or ``None`` when the tool
            reports bandwidth only.
        latency_p99_us: 99th percentile request duration, or ``None``.
        verified: True only when every destination byte was checked against the
            source after the transfer.
        note: What the number measures when it is not the plain workload.
    """

    peer: str
    nbytes: int
    num_blocks: int
    num_iters: int
    gbps_median: float
    latency_p50_us: float | None
    latency_p99_us: float | None
    verified: bool
    note: str = ""

    def to_json(self) -> dict[str, object]:
        """Plain dict for ``json.dumps``."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A peer that could not run here, with the precise reason."""

    peer: str
    reason: str

    def __str__(self) -> str:
        return f"unavailable: {self.reason}"

    def to_json(self) -> dict[str, object]:
        """Plain dict for ``json.dumps``."""
        return {"peer": self.peer, "unavailable": self.reason}


PeerOutcome = list[PeerResult] | Unavailable


def summarize(peer: str, nbytes: int, num_blocks: int, durations_s: Sequence[float],
              verified: bool, note: str = "") -> PeerResult:
    """Build a :class:`PeerResult` from per-request durations.

    Raises:
        ValueError: no durations, or a duration that is not positive.
    """
    if not durations_s:
        raise ValueError(f"{peer}: no timed requests at {nbytes} B")
    durations = np.asarray(durations_s, dtype=np.float64)
    if (durations <= 0).any():
        raise ValueError(f"{peer}: non-positive duration at {nbytes} B: {durations.min()}")
    p50_s, p99_s = np.percentile(durations, [50.0, 99.0])
    return PeerResult(
        peer=peer,
        nbytes=nbytes,
        num_blocks=num_blocks,
        num_iters=len(durations),
        gbps_median=float(np.median(nbytes / durations) / 1e9),
        latency_p50_us=float(p50_s * 1e6),
        latency_p99_us=float(p99_s * 1e6),
        verified=verified,
        note=note,
    )
