"""Bounded pools of reusable staging buffers for packed KV chunks.

The agent's server packs each chunk into a buffer from one pool; its reader
receives chunks into buffers from another and unpacks them. Bounding the
buffers bounds the agent's memory whatever the number of requests in flight.
A buffer UCX may still write to (its request was abandoned after a timeout) is
``discard``-ed, never reused: the pool allocates a fresh one in its place.

Buffers live where the agent's caches do: host memory (numpy), or the caches'
GPU for CUDA caches (uint8 tensors), so pack and unpack run there and UCX sends
one contiguous device buffer per chunk. UCX moves such buffers between two
processes on one GPU orders of magnitude faster than scatter-gather lists of
small pieces of GPU memory (docs/benchmarks.md, "GPU"), which is why readers
with CUDA caches always stage (``reading/strategy.py``).

Called only from the agent's event loop.
"""

from __future__ import annotations

import asyncio

import numpy as np
import numpy.typing as npt
import torch

from kvbridge.errors import ConfigError
from kvbridge.transfer.errors import PeerTimeoutError

Buffer = npt.NDArray[np.uint8] | torch.Tensor


class BufferPool:
    """At most ``num_buffers`` byte buffers lent out at once.

    Args:
        num_buffers: buffers in the pool (> 0).
        device: where the buffers are: ``cpu`` (numpy arrays) or a CUDA device
            (uint8 tensors).
        keep_nbytes: a buffer larger than this is freed when it comes back
            instead of kept for reuse (None: keep all). The agent passes its
            ``chunk_nbytes``: chunks are larger only when one block is, and one
            read of a peer with huge blocks must not pin that much memory for good.

    Raises:
        ConfigError: ``num_buffers < 1``.
    """

    def __init__(self, num_buffers: int, device: torch.device | str = "cpu",
                 keep_nbytes: int | None = None) -> None:
        if num_buffers < 1:
            raise ConfigError(f"num_buffers must be >= 1, got {num_buffers}")
        self.num_buffers = num_buffers
        self.device = torch.device(device)
        self.keep_nbytes = keep_nbytes
        self._free: list[Buffer] = []
        self._num_lent = 0
        self._available = asyncio.Semaphore(num_buffers)
        # Taking several buffers is serialised so two takers never each hold
        # half of what they need while waiting for the rest.
        self._multi = asyncio.Lock()

    async def acquire(self, nbytes: int, count: int = 1, *, timeout_s: float) -> list[Buffer]:
        """Borrow ``count`` buffers of at least ``nbytes`` bytes each, all or none.

        Raises:
            ConfigError: ``count`` is not in ``[1, num_buffers]``.
            PeerTimeoutError: not enough buffers came back within ``timeout_s``.
        """
        if not 1 <= count <= self.num_buffers:
            raise ConfigError(f"count {count} outside [1, {self.num_buffers}]")
        taken = 0
        try:
            async with asyncio.timeout(timeout_s), self._multi:
                while taken < count:
                    await self._available.acquire()
                    taken += 1
        except TimeoutError:
            for _ in range(taken):
                self._available.release()
            raise PeerTimeoutError(
                f"no {count} staging buffers of {nbytes} bytes free within {timeout_s}s"
            ) from None
        self._num_lent += count
        return [self._take(nbytes) for _ in range(count)]

    @property
    def num_kept_nbytes(self) -> int:
        """Bytes of the buffers kept for reuse (not lent out)."""
        return sum(int(buf.nbytes) for buf in self._free)

    @property
    def num_lent(self) -> int:
        """Buffers lent out and not yet released or discarded."""
        return self._num_lent

    def _take(self, nbytes: int) -> Buffer:
        while self._free:
            buf = self._free.pop()
            if buf.nbytes >= nbytes:
                return buf
            # too small for this chunk size: drop it, its slot is reused below
        if self.device.type == "cpu":
            return np.empty(nbytes, dtype=np.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def release(self, buf: Buffer) -> None:
        """Give a buffer back for reuse (freed instead if larger than ``keep_nbytes``)."""
        if self.keep_nbytes is None or buf.nbytes <= self.keep_nbytes:
            self._free.append(buf)
        self._num_lent -= 1
        self._available.release()

    def discard(self) -> None:
        """Give back the slot of a buffer that must never be reused."""
        self._num_lent -= 1
        self._available.release()


def as_tensor(buf: Buffer) -> torch.Tensor:
    """A pool buffer as a uint8 tensor (the same memory), for pack and unpack."""
    return buf if isinstance(buf, torch.Tensor) else torch.from_numpy(buf)
