"""The pool of KV cache blocks: reference counts, prefix cache, eviction, events.

Owned by one engine's KV cache manager (``paged/manager.py``), which is its
only caller. The pool is the only code that changes a block's ``ref_cnt`` and
``block_hash``; the free queue owns the links.

A block is in exactly one state::

    held     ref_cnt > 0, not in the free queue, maybe cached (has a hash)
    free     ref_cnt == 0, in the free queue, maybe cached
    null     block 0: placeholder for skipped positions (e.g. outside a
             sliding window); never free, never cached, never handed out

Cached free blocks are evicted lazily: they stay findable by hash until
``get_new_blocks`` pops them off the front of the queue for reuse.

:class:`BlockPool` alone owns reference counts, block hashes and the hash ->
block map: its methods change them together, ``check_integrity`` checks them
together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvbridge.errors import ConfigError, IntegrityError, KVBridgeError
from kvbridge.reference.paged.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvbridge.reference.paged.free_queue import FreeBlockQueue, KVCacheBlock, NoFreeBlocksError
from kvbridge.reference.paged.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

__all__ = ["BlockPool", "DoubleFreeError", "NoFreeBlocksError"]


class DoubleFreeError(KVBridgeError, ValueError):
    """A block was freed more often than it is held. Nothing was changed."""

    def __init__(self, block_id: int, ref_cnt: int, num_frees: int) -> None:
        super().__init__(
            f"block {block_id} freed {num_frees} time(s) in one call but its ref_cnt is {ref_cnt}"
        )
        self.block_id = block_id
        self.ref_cnt = ref_cnt


class BlockPool:
    """Blocks ``0 .. num_blocks-1``; block 0 is the null block.

    Args:
        num_blocks: Total blocks including the null block (>= 2).
        enable_caching: Keep a hash -> block map of full blocks for prefix hits.
        enable_kv_cache_events: Record :mod:`kvbridge.reference.paged.events` for
            :meth:`take_events`.

    Raises:
        ConfigError: ``num_blocks`` < 2.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False
    ) -> None:
        if num_blocks < 2:
            raise ConfigError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self._num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self._blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self._blocks[0]
        self.null_block.is_null = True
        self._free_queue = FreeBlockQueue(self._blocks[1:])
        # Several blocks can hold the same content: two requests that missed
        # the cache at the same time each computed it. Keep all of them, keyed
        # by block id, so evicting one leaves the others findable.
        self._cached: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        self._events: list[KVCacheEvent] = []

    # ----------------------------------------------------------------- reads

    @property
    def num_blocks(self) -> int:
        """Total blocks, including the null block."""
        return self._num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self._num_blocks - 1

    def get_block(self, block_id: int) -> KVCacheBlock:
        """Return block ``block_id`` (read it; do not modify it).

        Raises:
            ValueError: ``block_id`` is outside ``[0, num_blocks)``.
        """
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self._num_blocks})")
        return self._blocks[block_id]

    def get_num_free_blocks(self) -> int:
        """Number of free blocks, cached or not."""
        return self._free_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks that are held, in [0, 1]."""
        return 1.0 - self._free_queue.num_free_blocks / self.num_usable_blocks

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """Look up a cached block for each KV cache group.

        Does not change the pool; call :meth:`touch` to hold the result.

        Args:
            block_hash: Hash of the block content.
            kv_cache_group_ids: Groups to look in.

        Returns:
            One block per group, in order, or ``None`` if any group misses.
        """
        out: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            holders = self._cached.get(make_block_hash_with_group_id(block_hash, group_id))
            if not holders:
                return None
            out.append(next(iter(holders.values())))
        return out

    # ------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` free blocks, least recently used first.

        Cached blocks among them leave the prefix cache (a ``BlockRemoved``
        event each). Each returned block has ``ref_cnt == 1`` and no hash.

        Raises:
            ValueError: ``num_blocks`` is negative.
            NoFreeBlocksError: fewer than ``num_blocks`` are free (pool unchanged).
        """
        blocks = self._free_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        """Hold prefix-cache hits: one more reference on each block.

        A hit with ``ref_cnt == 0`` leaves the free queue, so it can no longer
        be evicted. The null block is skipped.

        Args:
            blocks: Per KV cache group, the blocks to hold.

        Raises:
            ValueError: a block is not one of this pool's (pool unchanged).
        """
        for group_blocks in blocks:
            self._check_owned(group_blocks)
        for group_blocks in blocks:
            for block in group_blocks:
                if block.is_null:
                    continue
                if block.ref_cnt == 0:
                    self._free_queue.remove(block)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listed block.

        Blocks that reach ``ref_cnt == 0`` join the back of the free queue in
        the given order, so the first listed is evicted first (the manager
        lists a request's blocks tail first). They stay cached until evicted.
        The null block is skipped.

        Raises:
            DoubleFreeError: a block would go below zero references (pool unchanged).
            ValueError: a block is not one of this pool's (pool unchanged).
        """
        blocks = [b for b in ordered_blocks if not b.is_null]
        self._check_owned(blocks)
        # Decrement first and roll back on failure: validates repeats of one
        # block in the list without building a counter.
        for i, block in enumerate(blocks):
            if block.ref_cnt <= 0:
                num_frees = sum(1 for b in blocks[: i + 1] if b is block)
                for done in blocks[:i]:
                    done.ref_cnt += 1
                raise DoubleFreeError(block.block_id, block.ref_cnt + num_frees - 1, num_frees)
            block.ref_cnt -= 1
        newly_free = [b for b in blocks if b.ref_cnt == 0]
        if len(newly_free) > 1:
            # A block listed twice must be queued once, at its first position.
            newly_free = list(dict.fromkeys(newly_free))
        self._free_queue.append_n(newly_free)

    # ---------------------------------------------------------------- cache

    def cache_full_blocks(
        self,
        request_block_hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Add a request's newly full blocks to the prefix cache.

        ::

            blocks     | cached earlier | newly full ......... | partial |
                       0       num_cached_blocks    num_full_blocks

        Null blocks are skipped, and so are blocks already cached under the
        same hash. A no-op when caching is disabled.

        Args:
            request_block_hashes: The request's block hashes (at least
                ``num_full_blocks``).
            blocks: The request's blocks in this group, all held.
            num_cached_blocks: Blocks of the request already cached.
            num_full_blocks: Full blocks of the request after this step.
            kv_cache_group_id: Group of ``blocks``.
            token_ids: Optional tokens of the newly full blocks, flattened,
                copied into the ``BlockStored`` event.

        Raises:
            ValueError: the counts are out of range, a block is free, or a
                block is cached under a different hash (pool unchanged).
        """
        if not self.enable_caching or num_cached_blocks == num_full_blocks:
            return
        if not 0 <= num_cached_blocks <= num_full_blocks <= len(blocks):
            raise ValueError(
                f"need 0 <= num_cached_blocks ({num_cached_blocks}) <= num_full_blocks "
                f"({num_full_blocks}) <= len(blocks) ({len(blocks)})"
            )
        if num_full_blocks > len(request_block_hashes):
            raise ValueError(
                f"num_full_blocks {num_full_blocks} > {len(request_block_hashes)} block hashes"
            )
        keys = [
            make_block_hash_with_group_id(request_block_hashes[i], kv_cache_group_id)
            for i in range(num_cached_blocks, num_full_blocks)
        ]
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        to_store: list[tuple[KVCacheBlock, BlockHashWithGroupId]] = []
        for pos, (block, key) in enumerate(zip(new_blocks, keys, strict=True)):
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is free; only held blocks can be cached")
            if block.block_hash is None:
                to_store.append((block, key))
            elif block.block_hash != key:
                raise ValueError(
                    f"block {block.block_id} is already cached under another hash "
                    f"(position {num_cached_blocks + pos} of the request)"
                )
        for block, key in to_store:
            block.block_hash = key
            self._cached.setdefault(key, {})[block.block_id] = block
        if self.enable_kv_cache_events and to_store:
            parent = request_block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self._events.append(
                BlockStored(
                    block_hashes=[get_block_hash(key) for _, key in to_store],
                    parent_block_hash=parent,
                    block_ids=[block.block_id for block, _ in to_store],
                    group_id=kv_cache_group_id,
                    token_ids=list(token_ids) if token_ids is not None else None,
                )
            )

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the given blocks from the prefix cache (e.g. their load failed).

        Held blocks stay held and free blocks stay free; only their hash goes.
        Blocks that are not cached are ignored.

        Raises:
            ValueError: an id is outside ``[0, num_blocks)`` (pool unchanged).
        """
        bad = sorted(i for i in block_ids if not 0 <= i < self._num_blocks)
        if bad:
            raise ValueError(f"block ids {bad} out of range [0, {self._num_blocks})")
        for block_id in sorted(block_ids):
            block = self._blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, if no block is held.

        Returns:
            True if reset (an ``AllBlocksCleared`` event is recorded), False if
            some block is still held (nothing changed).
        """
        if self._free_queue.num_free_blocks != self.num_usable_blocks:
            return False
        for holders in self._cached.values():
            for block in holders.values():
                block.block_hash = None
        self._cached.clear()
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and forget the recorded events, oldest first."""
        events, self._events = self._events, []
        return events

    def _check_owned(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks_by_id = self._blocks
        num_blocks = self._num_blocks
        for block in blocks:
            block_id = block.block_id
            if not (0 <= block_id < num_blocks and blocks_by_id[block_id] is block):
                raise ValueError(f"block {block_id} does not belong to this pool")

    def _uncache(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        assert key is not None
        holders = self._cached[key]
        del holders[block.block_id]
        if not holders:
            del self._cached[key]
        block.block_hash = None
        if self.enable_kv_cache_events:
            self._events.append(
                BlockRemoved(
                    block_hash=get_block_hash(key),
                    block_id=block.block_id,
                    group_id=get_group_id(key),
                )
            )

    # ------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Check counts, states and the cache map against each other.

        Raises:
            IntegrityError: with the counts that disagree.
        """
        self._free_queue.check_integrity()
        problems: list[str] = []
        free_ids = {b.block_id for b in self._free_queue.get_all_free_blocks()}
        num_free = len(free_ids)
        num_held = sum(1 for b in self._blocks[1:] if b.ref_cnt > 0)
        num_negative = sum(1 for b in self._blocks if b.ref_cnt < 0)
        both = [b.block_id for b in self._blocks if b.block_id in free_ids and b.ref_cnt != 0]
        neither = [
            b.block_id for b in self._blocks[1:] if b.ref_cnt == 0 and b.block_id not in free_ids
        ]
        if num_free + num_held != self.num_usable_blocks:
            problems.append(
                f"free ({num_free}) + held ({num_held}) != usable ({self.num_usable_blocks})"
            )
        if num_negative:
            problems.append(f"{num_negative} blocks have ref_cnt < 0")
        if both:
            problems.append(f"{len(both)} blocks both free and referenced: {both[:8]}")
        if neither:
            problems.append(f"{len(neither)} unreferenced blocks missing from the free queue: "
                            f"{neither[:8]}")
        null = self.null_block
        if 0 in free_ids or null.ref_cnt != 0 or null.block_hash is not None:
            problems.append("null block is free, referenced or cached")
        if sum(1 for b in self._blocks if b.is_null) != 1:
            problems.append("more than one block is marked null")
        problems += self._check_cache_map()
        if problems:
            raise IntegrityError("block pool: " + "; ".join(problems))

    def _check_cache_map(self) -> list[str]:
        problems: list[str] = []
        num_entries = 0
        num_mismatched = 0
        for key, holders in self._cached.items():
            if not holders:
                problems.append("empty holder dict in the cache map")
            for block_id, block in holders.items():
                num_entries += 1
                if block.block_hash != key or self._blocks[block_id] is not block:
                    num_mismatched += 1
        hashed = [b for b in self._blocks if b.block_hash is not None]
        num_hashed = len(hashed)
        missing = [
            b.block_id
            for b in hashed
            if b.block_hash is not None
            and self._cached.get(b.block_hash, {}).get(b.block_id) is not b
        ]
        if num_mismatched:
            problems.append(f"{num_mismatched} cache map entries point at a block with other hash")
        if num_entries != num_hashed:
            problems.append(f"cache map has {num_entries} entries, {num_hashed} blocks have a hash")
        if missing:
            problems.append(f"{len(missing)} cached blocks missing from the map: {missing[:8]}")
        if not self.enable_caching and num_entries:
            problems.append(f"caching disabled but {num_entries} blocks are cached")
        return problems
