"""Per-group block bookkeeping, one manager class per attention kind.

Every KV cache group gets one ``SingleTypeManager``: it owns that group's list
of blocks per request and knows how the group's attention kind decides which
blocks a request still needs. The coordinator (``paged/coordinator.py``)
builds one manager per group (``make_single_type_manager``) and drives them;
nothing else calls these classes. This module holds the base class and the
kinds that keep every block to the end; the sliding-window and chunked-local
kinds, which drop leading blocks, are in ``windowed.py``.

What differs by kind:

    kind              prefix-cache hit                 blocks no longer needed
    full attention    longest run from the left        none
    sliding window    last window's blocks, found      blocks before the window
                      right to left; null before
    chunked local     blocks of the current chunk;     blocks before the current
                      null before                      chunk
    cross attention   never cached                     none (one allocation of the
                                                       encoder tokens)
    Mamba             never cached                     none (one state block)

A position a request no longer needs holds the pool's null block, so block
index ``i`` still covers tokens ``[i * block_size, (i + 1) * block_size)``.
Managers never change reference counts themselves: they ask the pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from kvbridge.reference.paged.block_pool import BlockPool
from kvbridge.reference.paged.free_queue import KVCacheBlock
from kvbridge.reference.paged.hashing import BlockHash, get_group_id
from kvbridge.reference.paged.request import Request
from kvbridge.reference.paged.spec import KVCacheSpec

__all__ = [
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeManager",
]

_NO_BLOCKS: tuple[KVCacheBlock, ...] = ()


class SingleTypeManager(ABC):
    """Blocks of every request in one KV cache group.

    Args:
        spec: The group's spec.
        pool: The block pool shared by all groups.
        group_id: Index of the group in the KV cache config.
        dcp_world_size: Decode context-parallel ranks; one manager block spans
            ``spec.block_size`` tokens on each rank.
    """

    #: Whether the group's blocks can be found in the prefix cache.
    supports_prefix_cache = True
    #: Whether the group is sized by the encoder input instead of the tokens.
    uses_encoder_tokens = False
    #: Whether ``remove_skipped_blocks`` can ever free anything.
    skips_blocks = False

    def __init__(
        self, spec: KVCacheSpec, pool: BlockPool, group_id: int, dcp_world_size: int = 1
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size * dcp_world_size
        self.group_id = group_id
        self._pool = pool
        self._null_block = pool.null_block
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    # ------------------------------------------------------------------ reads

    def get_blocks(self, request_id: str) -> Sequence[KVCacheBlock]:
        """The request's blocks (a live view; do not mutate), empty if unknown."""
        return self._req_blocks.get(request_id, _NO_BLOCKS)

    def has_request(self, request_id: str) -> bool:
        """Whether the request has a block list here (possibly empty)."""
        return request_id in self._req_blocks

    def num_new_blocks(self, request_id: str, num_tokens: int, num_new_computed: int) -> int:
        """Fresh blocks needed so the request covers ``num_tokens`` tokens.

        ``num_new_computed`` prefix-cache hits are about to join the request.
        """
        blocks = self._req_blocks.get(request_id)
        # Hot path (every running request, every step): no helper calls.
        num_new = -(-num_tokens // self.block_size) - num_new_computed
        if blocks is not None:
            num_new -= len(blocks)
        return num_new if num_new > 0 else 0

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks the allocation would take out of the free queue.

        That is the fresh blocks plus the hits that currently sit in the free
        queue (``ref_cnt == 0``): holding them takes them out of it too.
        """
        num_new = self.num_new_blocks(request_id, num_tokens, len(new_computed_blocks))
        if new_computed_blocks:
            num_new += sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new

    def num_held_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Real (non-null) blocks the request keeps after ``remove_skipped_blocks``."""
        return len(self._req_blocks.get(request_id, _NO_BLOCKS))

    def num_freed_by_skip(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks`` would return to the free queue."""
        return 0

    def num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of the request shared by all running requests (0 if unknown)."""
        return 0

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> tuple[list[KVCacheBlock], ...]:
        """Cached blocks for the longest usable prefix of at most ``max_length`` tokens.

        Does not change the pool. ``group_ids`` are groups with this manager's
        kind; the answer has one list per group, all of equal length, where
        positions the kind does not need hold the null block.
        """

    # -------------------------------------------------------------- mutations

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Start the request's block list with its (already touched) cache hits.

        A request seen before must bring no hits; the manager checks that
        before calling.
        """
        if request_id in self._req_blocks:
            assert not new_computed_blocks, f"running request {request_id} got new cache hits"
            return
        self._req_blocks[request_id] = list(new_computed_blocks)
        self._num_cached_blocks[request_id] = len(new_computed_blocks)

    def _blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block list, created empty on first use."""
        blocks = self._req_blocks.get(request_id)
        if blocks is None:
            blocks = self._req_blocks[request_id] = []
            self._num_cached_blocks[request_id] = 0
        return blocks

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> Sequence[KVCacheBlock]:
        """Append fresh blocks until the request covers ``num_tokens`` tokens.

        Returns:
            The new blocks (empty when the request already covers them).

        Raises:
            NoFreeBlocksError: the pool is short (the caller checked it is not).
        """
        blocks = self._blocks_of(request_id)
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return _NO_BLOCKS
        new_blocks = self._pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the request's full blocks among its first ``num_tokens`` tokens in the cache."""
        request_id = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self._num_cached_blocks[request_id]
        if num_full <= num_cached:
            return
        token_ids = None
        if self._pool.enable_kv_cache_events:
            token_ids = request.all_token_ids[num_cached * self.block_size :
                                              num_full * self.block_size]
        self._pool.cache_full_blocks(
            request.block_hashes,
            self._req_blocks[request_id],
            num_cached,
            num_full,
            self.group_id,
            token_ids=token_ids,
        )
        self._num_cached_blocks[request_id] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks the request will never read again (kind-specific)."""
        return None

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first; no-op if unknown.

        Tail first: among blocks freed together, the one with the longest
        prefix is least likely to be shared, so it should be evicted first.
        """
        blocks = self._req_blocks.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if blocks:
            self._pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------- integrity

    def iter_held_blocks(self) -> Iterator[KVCacheBlock]:
        """Every real block held by a request, once per holding request."""
        for blocks in self._req_blocks.values():
            for block in blocks:
                if not block.is_null:
                    yield block

    def check_integrity(self) -> list[str]:
        """Structural problems of this group's block lists, as messages."""
        problems: list[str] = []
        name = f"group {self.group_id} ({type(self).__name__})"
        if self._req_blocks.keys() != self._num_cached_blocks.keys():
            problems.append(f"{name}: {len(self._req_blocks)} block lists but "
                            f"{len(self._num_cached_blocks)} cached counts")
        for request_id, blocks in self._req_blocks.items():
            num_cached = self._num_cached_blocks.get(request_id, 0)
            if not 0 <= num_cached <= len(blocks):
                problems.append(f"{name}: request {request_id} has {num_cached} cached of "
                                f"{len(blocks)} blocks")
            num_hashed_late = sum(1 for b in blocks[num_cached:] if b.block_hash is not None)
            if num_hashed_late:
                problems.append(f"{name}: request {request_id} has {num_hashed_late} cached "
                                f"blocks past its {num_cached} cached positions")
            wrong_group = [b.block_id for b in blocks[:num_cached] if b.block_hash is not None
                           and get_group_id(b.block_hash) != self.group_id]
            if wrong_group:
                problems.append(f"{name}: blocks {wrong_group} cached for another group")
            problems += self._check_nulls(request_id, blocks)
        return problems

    def _check_nulls(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> list[str]:
        num_null = sum(1 for b in blocks if b.is_null)
        if num_null:
            return [f"group {self.group_id}: request {request_id} holds {num_null} null blocks"]
        return []


class FullAttentionManager(SingleTypeManager):
    """Full attention (and MLA): every token's block is needed until the end."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> tuple[list[KVCacheBlock], ...]:
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in group_ids)
        get_cached = self._pool.get_cached_block
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        for i in range(num_blocks):
            cached = get_cached(block_hashes[i], group_ids)
            if cached is None:
                break
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits.append(block)
        return hits

    def num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        num_common = 0
        for block in self._req_blocks.get(request_id, _NO_BLOCKS):
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return num_common


class CrossAttentionManager(SingleTypeManager):
    """Cross attention: one allocation sized by the encoder input, never cached."""

    supports_prefix_cache = False
    uses_encoder_tokens = True

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple([] for _ in group_ids)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Encoder K/V depends on the encoder input, not the token prefix: never cached."""


class MambaManager(SingleTypeManager):
    """Mamba: a fixed state per request (plus speculative copies), never cached."""

    supports_prefix_cache = False

    def __init__(
        self, spec: KVCacheSpec, pool: BlockPool, group_id: int, num_state_blocks: int,
        dcp_world_size: int = 1,
    ) -> None:
        super().__init__(spec, pool, group_id, dcp_world_size)
        self.num_state_blocks = num_state_blocks

    def num_new_blocks(self, request_id: str, num_tokens: int, num_new_computed: int) -> int:
        num_held = len(self._req_blocks.get(request_id, _NO_BLOCKS))
        return max(self.num_state_blocks - num_held, 0) if num_tokens > 0 else 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> Sequence[KVCacheBlock]:
        num_new = self.num_new_blocks(request_id, num_tokens, 0)
        blocks = self._blocks_of(request_id)
        if num_new == 0:
            return _NO_BLOCKS
        new_blocks = self._pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple([] for _ in group_ids)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """The state summarises the whole prefix and is overwritten in place: never cached."""
