"""Reads of device caches between two agent processes, for the GPU scripts.

``benchmarks/gpu_check.py`` (step ``cuda-read``) and ``benchmarks/gpu_probe.py``
(issue #41) time kvbridge reads between the agent processes of
``kvbridge/bench/transfer_agents.py`` (``AgentPair``: ``NUM_LAYERS`` layers of bf16
caches, blocks of 16 tokens x 8 heads x 128, so a block is 512 KiB over all layers)
and compare them with the read staged through pinned host memory, which
:class:`HostStagedRead` measures::

    device caches --copy_blocks--> pinned mirror   (d2h)
    host read between two agent processes          (host caches, same-host copy)
    pinned mirror --copy_blocks--> device caches   (h2d)
"""

from __future__ import annotations

import time
from typing import Any

from kvbridge.bench.peers.results import PeerResult
from kvbridge.bench.transfer_agents import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, AgentPair

NUM_LAYERS = 8
_BF16_NBYTES = 2
_NUM_COPIES = 5  # d2h / h2d: the best of these


def block_nbytes(num_layers: int = NUM_LAYERS) -> int:
    """Bytes of one block over all layers, K and V (bf16)."""
    return 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * _BF16_NBYTES * num_layers


def p50_s(result: PeerResult) -> float:
    """A read's median duration in seconds."""
    assert result.latency_p50_us is not None  # kvbridge's reads are timed one by one
    return result.latency_p50_us / 1e6


class HostStagedRead:
    """Device caches read through the host: their copy to a pinned mirror, a host read
    between two agent processes, the copy back. A context manager that stops the pair.

    Args:
        num_pool_blocks: blocks of every cache (device, mirror, both agents').
        device: where the caches live (``cuda``; ``cpu`` in the dry runs, no pinning).
        timeout_s: the agent pair's deadline for every reply.

    Raises:
        AgentPairError: an agent process did not start within ``timeout_s``.
    """

    def __init__(self, num_pool_blocks: int, device: str, timeout_s: float) -> None:
        import torch

        shape = (2, num_pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self._device = device
        self._caches = [torch.zeros(shape, dtype=torch.bfloat16, device=device)
                        for _ in range(NUM_LAYERS)]
        self._mirror = [torch.zeros(shape, dtype=torch.bfloat16, pin_memory=device == "cuda")
                        for _ in range(NUM_LAYERS)]
        self._pair = AgentPair(NUM_LAYERS, num_pool_blocks, timeout_s, local_copy=True,
                               name="kvbridge-host")

    def measure(self, num_blocks: int, num_iters: int) -> dict[str, Any]:
        """Time the three parts for ``num_blocks`` blocks (every layer).

        Returns:
            ``host_read_p50_ms``, ``host_verified`` (the host read's bytes checked),
            ``d2h_ms`` and ``h2d_ms`` (best of five), ``staged_ms`` (their sum) and
            ``staged_gbps``.

        Raises:
            AgentPairError: a read failed or an agent stopped answering.
        """
        nbytes = num_blocks * block_nbytes()
        host = self._pair.measure(num_blocks, num_iters, nbytes)
        ids = list(range(0, 2 * num_blocks, 2))
        d2h = self._best_copy_s(self._caches, self._mirror, ids)
        h2d = self._best_copy_s(self._mirror, self._caches, ids)
        staged_s = d2h + p50_s(host) + h2d
        return {"host_read_p50_ms": p50_s(host) * 1e3, "host_verified": host.verified,
                "d2h_ms": d2h * 1e3, "h2d_ms": h2d * 1e3, "staged_ms": staged_s * 1e3,
                "staged_gbps": nbytes / staged_s / 1e9}

    def _best_copy_s(self, src: list[Any], dst: list[Any], ids: list[int]) -> float:
        """Best ``copy_blocks`` of ``ids`` (all layers) in seconds, synchronised."""
        import torch

        from kvbridge.kernels import copy_blocks

        best = float("inf")
        for _ in range(_NUM_COPIES):
            started = time.perf_counter()
            copy_blocks(src, dst, ids)
            if self._device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        return best

    def close(self) -> None:
        """Stop the agent pair (idempotent)."""
        self._pair.close()

    def kill(self) -> None:
        """Kill the agent pair now (it stopped answering)."""
        self._pair.kill()

    def __enter__(self) -> HostStagedRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
