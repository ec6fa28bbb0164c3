"""The KV-shaped workload every transfer peer moves, so their numbers compare.

Used by each peer in this package and by ``kvbridge/bench/transfer_bench.py`` for
kvbridge's own agent. A *block* here is the unit a KV-cache transfer moves as
one contiguous region: one layer's K and V for one block of tokens. With the
default shape (8 KV heads, head dim 128, bf16, 16 tokens a block) that is
2 * 16 * 8 * 128 * 2 B = 64 KiB. A request of ``n`` token blocks over a
32-layer model is therefore ``32 * n`` such blocks; the benchmark sizes
(1, 16, 64, 256, 1024 blocks -> 64 KiB .. 64 MiB) count these regions.

Each side owns a *pool* of blocks (one flat byte buffer). A request reads
``num_blocks`` scattered source blocks into scattered destination blocks:

    source pool   [ 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 ]      remote_ids = (5, 1, 6)
                        |           |   |
                        +-------+   |   +---+
                    +-----------+---+       |
    dest pool     [ 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 ]      local_ids  = (3, 1, 7)
                        ^       ^               ^
                      id 1    id 5            id 6       (request order pairs them)

Every 8-byte word of source block ``b`` at word offset ``j`` holds
``((b << 32) | j) * MIX + seed`` (mod 2**64). Multiplying by an odd constant is a
bijection, so a block landing in the wrong place, a torn block, or a stray write
into a block the request did not name all show up in :meth:`KVWorkload.verify`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

DEFAULT_BLOCK_COUNTS: tuple[int, ...] = (1, 16, 64, 256, 1024)
"""Request sizes of the benchmark, in blocks (64 KiB .. 64 MiB by default)."""

_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it permutes 2**64
_WORD_NBYTES = 8

U8Array = npt.NDArray[np.uint8]
U64Array = npt.NDArray[np.uint64]
IdArray = npt.NDArray[np.int64]


class WorkloadError(ValueError):
    """A size, count or buffer does not fit the workload. Nothing was changed."""


@dataclass(frozen=True, slots=True)
class KVShape:
    """Shape of one attention layer's paged KV cache.

    Attributes:
        num_kv_heads: KV heads per layer (after TP split).
        head_dim: Elements per head.
        dtype_nbytes: Bytes per element (2 for bf16).
        block_size: Tokens per block.
        num_layers: Layers of the model; informational (a request of ``n``
            token blocks moves ``num_layers * n`` benchmark blocks).
    """

    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_nbytes: int = 2
    block_size: int = 16
    num_layers: int = 32

    def __post_init__(self) -> None:
        fields = (self.num_kv_heads, self.head_dim, self.dtype_nbytes, self.block_size)
        if min(fields) < 1 or self.num_layers < 1:
            raise WorkloadError(f"every KV shape field must be >= 1, got {self}")
        if self.block_nbytes % _WORD_NBYTES:
            raise WorkloadError(
                f"block of {self.block_nbytes} B is not a multiple of {_WORD_NBYTES} B"
            )

    @property
    def block_nbytes(self) -> int:
        """Bytes of K and V of one block in one layer (the contiguous unit)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_nbytes


@dataclass(frozen=True, slots=True)
class KVWorkload:
    """Pool geometry and deterministic content shared by sender and receiver.

    Attributes:
        num_pool_blocks: Blocks in each side's pool; requests pick from them.
        shape: KV shape that fixes ``block_nbytes``.
        seed: Changes both the fill pattern and the scattered block ids.
    """

    num_pool_blocks: int
    shape: KVShape = KVShape()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_pool_blocks < 1:
            raise WorkloadError(f"num_pool_blocks must be >= 1, got {self.num_pool_blocks}")
        if not 0 <= self.seed < 2**32:
            raise WorkloadError(f"seed must be in [0, 2**32), got {self.seed}")

    @classmethod
    def for_sizes(cls, sizes_nbytes: Sequence[int], shape: KVShape | None = None,
                  seed: int = 0) -> KVWorkload:
        """Build a workload whose pool is twice the largest request.

        A pool twice the request leaves gaps between the chosen blocks, so the
        ids are really scattered rather than one contiguous run.

        Raises:
            WorkloadError: ``sizes_nbytes`` is empty or a size is not a positive
                multiple of the block size.
        """
        shape = shape or KVShape()
        if not sizes_nbytes:
            raise WorkloadError("sizes_nbytes is empty")
        max_blocks = max(_blocks_in(n, shape.block_nbytes) for n in sizes_nbytes)
        return cls(num_pool_blocks=2 * max_blocks, shape=shape, seed=seed)

    @property
    def block_nbytes(self) -> int:
        return self.shape.block_nbytes

    @property
    def pool_nbytes(self) -> int:
        return self.num_pool_blocks * self.block_nbytes

    def num_blocks_for(self, nbytes: int) -> int:
        """Number of blocks in a request of ``nbytes``.

        Raises:
            WorkloadError: not a positive multiple of ``block_nbytes``, or more
                blocks than the pool holds.
        """
        num_blocks = _blocks_in(nbytes, self.block_nbytes)
        if num_blocks > self.num_pool_blocks:
            raise WorkloadError(
                f"request of {num_blocks} blocks exceeds the pool of {self.num_pool_blocks}"
            )
        return num_blocks

    def block_ids(self, num_blocks: int) -> tuple[IdArray, IdArray]:
        """Scattered (remote_ids, local_ids) of a request; same on every call.

        Raises:
            WorkloadError: ``num_blocks`` outside ``[1, num_pool_blocks]``.
        """
        if not 1 <= num_blocks <= self.num_pool_blocks:
            raise WorkloadError(
                f"num_blocks must be in [1, {self.num_pool_blocks}], got {num_blocks}"
            )
        rng = np.random.default_rng([self.seed, num_blocks])
        remote_ids = rng.choice(self.num_pool_blocks, num_blocks, replace=False)
        local_ids = rng.choice(self.num_pool_blocks, num_blocks, replace=False)
        return remote_ids.astype(np.int64), local_ids.astype(np.int64)

    def expected_words(self, block_ids: IdArray) -> U64Array:
        """Source content of ``block_ids`` as ``[len(block_ids), words]`` uint64."""
        num_words = self.block_nbytes // _WORD_NBYTES
        ids = block_ids.astype(np.uint64)[:, None] << np.uint64(32)
        words = np.arange(num_words, dtype=np.uint64)[None, :]
        return (ids | words) * _MIX + np.uint64(self.seed)

    def new_pool(self) -> U8Array:
        """A zeroed pool buffer (the caller owns and registers it)."""
        return np.zeros(self.pool_nbytes, dtype=np.uint8)

    def fill_source(self, pool: U8Array) -> None:
        """Write every source block's pattern into ``pool`` (in place).

        Raises:
            WorkloadError: ``pool`` is not a contiguous uint8 buffer of
                ``pool_nbytes``.
        """
        self._blocks_view(pool)[:] = self.expected_words(
            np.arange(self.num_pool_blocks, dtype=np.int64)
        )

    def verify(self, pool: U8Array, remote_ids: IdArray, local_ids: IdArray) -> int:
        """Count wrong blocks in a destination pool that started zeroed.

        A block is wrong when a named destination block differs from its source
        pattern, or when a block the request did not name is no longer zero.

        Returns:
            The number of wrong blocks; 0 means the transfer verified.

        Raises:
            WorkloadError: mismatched id lengths or a badly sized ``pool``.
        """
        if remote_ids.shape != local_ids.shape:
            raise WorkloadError(
                f"{remote_ids.size} remote ids but {local_ids.size} local ids"
            )
        blocks = self._blocks_view(pool)
        got = blocks[local_ids]
        num_wrong = int(np.count_nonzero((got != self.expected_words(remote_ids)).any(axis=1)))
        untouched = np.ones(self.num_pool_blocks, dtype=bool)
        untouched[local_ids] = False
        num_wrong += int(np.count_nonzero(blocks[untouched].any(axis=1)))
        return num_wrong

    def _blocks_view(self, pool: U8Array) -> U64Array:
        if pool.dtype != np.uint8 or pool.ndim != 1 or not pool.flags.c_contiguous:
            raise WorkloadError(f"pool must be a contiguous 1-D uint8 array, got {pool.dtype}")
        if pool.nbytes != self.pool_nbytes:
            raise WorkloadError(f"pool has {pool.nbytes} B, workload needs {self.pool_nbytes} B")
        return pool.view(np.uint64).reshape(self.num_pool_blocks, -1)


def sizes_for_blocks(block_counts: Sequence[int], shape: KVShape | None = None) -> list[int]:
    """Byte sizes of requests of ``block_counts`` blocks.

    Raises:
        WorkloadError: a count is < 1.
    """
    block_nbytes = (shape or KVShape()).block_nbytes
    if any(n < 1 for n in block_counts):
        raise WorkloadError(f"block counts must be >= 1, got {list(block_counts)}")
    return [n * block_nbytes for n in block_counts]


def _blocks_in(nbytes: int, block_nbytes: int) -> int:
    if nbytes < block_nbytes or nbytes % block_nbytes:
        raise WorkloadError(
            f"size {nbytes} B is not a positive multiple of the {block_nbytes} B block"
        )
    return nbytes // block_nbytes
