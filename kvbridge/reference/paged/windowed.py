"""Group managers of the windowed attention kinds: sliding window and chunked local.

In these kinds a request's leading blocks stop being needed as it advances:
a token reads only the last ``sliding_window`` tokens, or only its own chunk.
Those positions give their blocks back to the pool and hold the null block,
always as one leading run, so block index ``i`` still covers tokens
``[i * block_size, (i + 1) * block_size)``. A prefix-cache hit then needs only
the blocks a token after the hit still reads; the ones before it count as hits
(null). The base class and the other kinds are in ``single_type.py``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

from kvbridge.reference.paged.block_pool import BlockPool
from kvbridge.reference.paged.free_queue import KVCacheBlock
from kvbridge.reference.paged.hashing import BlockHash
from kvbridge.reference.paged.single_type import SingleTypeManager
from kvbridge.reference.paged.spec import KVCacheSpec, cdiv

__all__ = ["ChunkedLocalAttentionManager", "SlidingWindowManager"]

_NO_BLOCKS: tuple[KVCacheBlock, ...] = ()


class _WindowedManager(SingleTypeManager):
    """A kind whose leading blocks stop being needed as the request advances.

    Subclasses say how many leading blocks a request no longer needs once
    ``num_computed_tokens`` tokens are computed; those positions hold the null
    block, always as one leading run.
    """

    skips_blocks = True

    @abstractmethod
    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks not needed to compute token ``num_computed_tokens`` onwards."""

    def num_held_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self._req_blocks.get(request_id, _NO_BLOCKS)
        num_skipped = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        return sum(1 for b in blocks[num_skipped:] if not b.is_null)

    def num_freed_by_skip(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self._req_blocks.get(request_id, _NO_BLOCKS)
        num_skipped = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        return sum(1 for b in blocks[:num_skipped] if not b.is_null and b.ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self._req_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        removed: list[KVCacheBlock] = []
        # Walk back from the last skipped block; the nulls form a leading run,
        # so the first null met means everything before it is already released.
        for i in range(num_skipped - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            removed.append(block)
            blocks[i] = self._null_block
        if removed:
            self._pool.free_blocks(removed)

    def _check_nulls(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> list[str]:
        num_leading = 0
        while num_leading < len(blocks) and blocks[num_leading].is_null:
            num_leading += 1
        num_null = sum(1 for b in blocks if b.is_null)
        if num_null != num_leading:
            return [f"group {self.group_id}: request {request_id} has {num_null} null blocks, "
                    f"only {num_leading} of them leading"]
        return []


class SlidingWindowManager(_WindowedManager):
    """Sliding-window attention: a token reads the ``sliding_window`` tokens ending at it."""

    def __init__(
        self, spec: KVCacheSpec, pool: BlockPool, group_id: int, sliding_window: int,
        dcp_world_size: int = 1,
    ) -> None:
        super().__init__(spec, pool, group_id, dcp_world_size)
        self.sliding_window = sliding_window

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        # Token n (the next to compute) reads n - window + 1 .. n; blocks that
        # end before that first token are not needed any more.
        #   window 5, bs 4, n = 10:   [0..3][4..7][8..11]   first read = 6
        #                              skip   keep  keep
        first_needed = num_computed_tokens - self.sliding_window + 1
        return max(first_needed, 0) // self.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> tuple[list[KVCacheBlock], ...]:
        # A hit of L tokens (L a block multiple) needs the window - 1 tokens
        # before L cached, i.e. the last `num_needed` blocks before L. Search
        # right to left for the rightmost such run; everything before it is null.
        #   needed 2:   blocks  0 1 2 3 4 5      cached: . x x . x x -> hit 6 blocks
        #                                        (blocks 0..3 null: 0, 3 missing is fine)
        num_needed = cdiv(self.sliding_window - 1, self.block_size)
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        hits = tuple([self._null_block] * max_num_blocks for _ in group_ids)
        if num_needed == 0:
            return hits
        get_cached = self._pool.get_cached_block
        num_run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            cached = get_cached(block_hashes[i], group_ids)
            if cached is None:
                num_run = 0
                continue
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits[i] = block
            num_run += 1
            if num_run == num_needed:
                for group_hits in hits:
                    del group_hits[i + num_run :]
                return hits
        # No full window anywhere: only a run starting at block 0 is usable
        # (there is nothing before it to attend to).
        for group_hits in hits:
            del group_hits[num_run:]
        return hits


class ChunkedLocalAttentionManager(_WindowedManager):
    """Chunked local attention: a token reads only its own chunk's earlier tokens."""

    def __init__(
        self, spec: KVCacheSpec, pool: BlockPool, group_id: int, attention_chunk_size: int,
        dcp_world_size: int = 1,
    ) -> None:
        super().__init__(spec, pool, group_id, dcp_world_size)
        self.attention_chunk_size = attention_chunk_size

    def _chunk_start(self, num_tokens: int) -> int:
        return num_tokens // self.attention_chunk_size * self.attention_chunk_size

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        # Token n reads its chunk [chunk_start, n]; whole blocks before
        # chunk_start are not needed.
        #   chunk 8, bs 4, n = 13:  [0..3][4..7] | [8..11][12..15]
        #                            skip  skip     keep    keep
        return self._chunk_start(num_computed_tokens) // self.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> tuple[list[KVCacheBlock], ...]:
        # Blocks wholly before the chunk that contains token max_length are
        # never read again: they count as hits (null). From there on the
        # blocks must be cached left to right.
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        num_null = min(self._chunk_start(max_length) // self.block_size, max_num_blocks)
        hits = tuple([self._null_block] * num_null for _ in group_ids)
        get_cached = self._pool.get_cached_block
        for i in range(num_null, max_num_blocks):
            cached = get_cached(block_hashes[i], group_ids)
            if cached is None:
                break
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits.append(block)
        return hits
