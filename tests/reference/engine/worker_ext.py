"""A worker extension used by test_workers: reports what each worker process sees."""

from __future__ import annotations

import os

from kvbridge.reference.engine.rank_worker import WorkerContext


class Probe:
    """Per-worker object built from the worker's context, like a connector worker."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def describe(self) -> dict[str, object]:
        return {
            "rank": self.ctx.tp_rank,
            "pid": os.getpid(),
            "num_layers": len(self.ctx.kv_caches),
            "config": self.ctx.extension_config,
        }

    def block_checksum(self, block_id: int) -> float:
        """Sum of |K| + |V| of one block over all layers (0 until something is written)."""
        return float(sum(c[:, block_id].abs().sum() for c in self.ctx.kv_caches))

    def fill_block(self, block_id: int, value: float) -> None:
        for cache in self.ctx.kv_caches:
            cache[:, block_id] = value

    def fail(self, message: str) -> None:
        raise RuntimeError(message)


def make_probe(ctx: WorkerContext) -> Probe:
    return Probe(ctx)


def broken_factory(ctx: WorkerContext) -> Probe:
    raise RuntimeError(f"extension refused to start on rank {ctx.tp_rank}")
