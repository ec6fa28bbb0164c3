"""Drives one ``SingleTypeManager`` per KV cache group as a unit.

``KVCacheManager`` (``paged/manager.py``) calls the coordinator for anything
that spans groups: the prefix-cache hit all groups agree on, the blocks one
allocation needs in total, and per-group allocation, caching and freeing.
Block lists travel as tuples with one entry per group, in group order.
:func:`make_single_type_manager` picks each group's manager by its spec's kind
(``single_type.py``, ``windowed.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvbridge.errors import ConfigError
from kvbridge.reference.paged.block_pool import BlockPool
from kvbridge.reference.paged.free_queue import KVCacheBlock
from kvbridge.reference.paged.hashing import BlockHash
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig, UniformTypeSpecs
from kvbridge.reference.paged.request import Request
from kvbridge.reference.paged.single_type import (
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeManager,
)
from kvbridge.reference.paged.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvbridge.reference.paged.windowed import ChunkedLocalAttentionManager, SlidingWindowManager

__all__ = ["GroupBlocks", "KVCacheCoordinator", "make_single_type_manager"]

GroupBlocks = tuple[Sequence[KVCacheBlock], ...]
"""Blocks per KV cache group, in group order."""


class KVCacheCoordinator:
    """The per-group managers of one KV cache config over one block pool.

    Args:
        config: Groups and their specs.
        pool: The block pool all groups allocate from.
        enable_caching: Whether prefix-cache hits are looked up at all.
        dcp_world_size: Decode context-parallel ranks (scales block sizes).
    """

    def __init__(
        self, config: KVCacheConfig, pool: BlockPool, enable_caching: bool, dcp_world_size: int
    ) -> None:
        self._pool = pool
        self.managers: tuple[SingleTypeManager, ...] = tuple(
            make_single_type_manager(group.kv_cache_spec, pool, group_id, dcp_world_size)
            for group_id, group in enumerate(config.kv_cache_groups)
        )
        self.num_groups = len(self.managers)
        self.empty: GroupBlocks = tuple(() for _ in self.managers)
        self._skipping = tuple(m for m in self.managers if m.skips_blocks)
        self.skips_blocks = bool(self._skipping)
        # Groups of one kind (same class, block size and window) share every
        # lookup: one get_cached_block call per hash answers all of them.
        # Full attention goes first: its hit bounds everyone else's cheaply.
        kinds: dict[tuple[object, ...], list[int]] = {}
        if enable_caching:
            for manager in self.managers:
                if manager.supports_prefix_cache:
                    kinds.setdefault(_kind_key(manager), []).append(manager.group_id)
        self._hit_kinds: list[tuple[SingleTypeManager, tuple[int, ...]]] = sorted(
            ((self.managers[ids[0]], tuple(ids)) for ids in kinds.values()),
            key=lambda item: not isinstance(item[0], FullAttentionManager),
        )

    # ------------------------------------------------------------------ reads

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupBlocks, int]:
        """The longest prefix of at most ``max_length`` tokens that every group can reuse.

        Each kind proposes its longest hit no longer than the current bound;
        the bound drops to the shortest proposal and the round repeats until
        every kind proposes the same length (a sliding-window group may find a
        different window at a shorter bound, so one round is not enough).

        Returns:
            The blocks per group (empty for groups that are never cached) and
            the hit length in tokens. Does not change the pool.
        """
        if not self._hit_kinds or max_length <= 0:
            return self.empty, 0
        bound = max_length
        while True:
            proposals = []
            for manager, group_ids in self._hit_kinds:
                hits = manager.find_longest_cache_hit(block_hashes, bound, group_ids)
                length = len(hits[0]) * manager.block_size
                assert length <= bound, f"{type(manager).__name__} hit {length} > bound {bound}"
                proposals.append((group_ids, hits, length))
            new_bound = min(length for _, _, length in proposals)
            if all(length == new_bound for _, _, length in proposals):
                break
            bound = new_bound
        if new_bound == 0:
            return self.empty, 0
        per_group: list[Sequence[KVCacheBlock]] = list(self.empty)
        for group_ids, hits, _ in proposals:
            for group_id, group_hits in zip(group_ids, hits, strict=True):
                per_group[group_id] = group_hits
        return tuple(per_group), new_bound

    def get_blocks(self, request_id: str) -> GroupBlocks:
        """The request's blocks per group (live views; do not mutate)."""
        return tuple(m.get_blocks(request_id) for m in self.managers)

    def has_request(self, request_id: str) -> bool:
        """Whether any group holds a block list for the request."""
        return any(m.has_request(request_id) for m in self.managers)

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: GroupBlocks, num_encoder_tokens: int
    ) -> int:
        """Free blocks an allocation up to ``num_tokens`` tokens takes from the pool."""
        total = 0
        if new_computed is self.empty:  # hot path: a running request
            for manager in self.managers:
                tokens = num_encoder_tokens if manager.uses_encoder_tokens else num_tokens
                total += manager.num_new_blocks(request_id, tokens, 0)
            return total
        for manager, hits in zip(self.managers, new_computed, strict=True):
            tokens = num_encoder_tokens if manager.uses_encoder_tokens else num_tokens
            total += manager.num_blocks_to_allocate(request_id, tokens, hits)
        return total

    def num_blocks_after(
        self, request_id: str, num_tokens: int, new_computed: GroupBlocks,
        num_encoder_tokens: int, num_computed_tokens: int,
    ) -> int:
        """Real blocks the request would hold after the allocation (all groups)."""
        total = 0
        for manager, hits in zip(self.managers, new_computed, strict=True):
            tokens = num_encoder_tokens if manager.uses_encoder_tokens else num_tokens
            total += manager.num_held_blocks(request_id, num_computed_tokens)
            total += sum(1 for b in hits if not b.is_null)
            total += manager.num_new_blocks(request_id, tokens, len(hits))
        return total

    def num_freed_by_skip(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks`` would put back in the free queue."""
        return sum(m.num_freed_by_skip(request_id, num_computed_tokens) for m in self._skipping)

    def num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        """Per group, leading blocks of the request held by every running request."""
        return [m.num_common_prefix_blocks(request_id, num_running_requests)
                for m in self.managers]

    # -------------------------------------------------------------- mutations

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks that fell out of a window, in every group that has one."""
        for manager in self._skipping:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def save_new_computed_blocks(self, request_id: str, new_computed: GroupBlocks) -> None:
        """Start each group's block list with its (touched) cache hits."""
        for manager, hits in zip(self.managers, new_computed, strict=True):
            manager.save_new_computed_blocks(request_id, hits)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int
    ) -> GroupBlocks:
        """Give each group fresh blocks up to ``num_tokens`` (or the encoder length)."""
        return tuple([
            m.allocate_new_blocks(
                request_id, num_encoder_tokens if m.uses_encoder_tokens else num_tokens)
            for m in self.managers
        ])

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` tokens."""
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group; no-op if unknown."""
        for manager in self.managers:
            manager.free(request_id)

    # ------------------------------------------------------------- integrity

    def check_integrity(self) -> list[str]:
        """Per-group structure, plus: each block's ``ref_cnt`` equals its holders."""
        problems: list[str] = []
        holders: Counter[int] = Counter()
        for manager in self.managers:
            problems += manager.check_integrity()
            holders.update(b.block_id for b in manager.iter_held_blocks())
        mismatched = [
            (block_id, block.ref_cnt, holders.get(block_id, 0))
            for block_id in range(1, self._pool.num_blocks)
            if (block := self._pool.get_block(block_id)).ref_cnt != holders.get(block_id, 0)
        ]
        if mismatched:
            problems.append(f"{len(mismatched)} blocks whose ref_cnt differs from the number "
                            f"of request lists holding them (id, ref_cnt, holders): "
                            f"{mismatched[:8]}")
        return problems


def _kind_key(manager: SingleTypeManager) -> tuple[object, ...]:
    return (
        type(manager),
        manager.block_size,
        getattr(manager, "sliding_window", None),
        getattr(manager, "attention_chunk_size", None),
    )


def make_single_type_manager(
    spec: KVCacheSpec, pool: BlockPool, group_id: int, dcp_world_size: int = 1
) -> SingleTypeManager:
    """Build the manager for a group's spec.

    A ``UniformTypeSpecs`` group is managed by the kind of its layers. A full
    attention spec that only *records* a window or chunk size is full attention.

    Raises:
        ConfigError: the spec kind keeps no cache (encoder-only) or is unknown.
    """
    kind = spec.layer_specs[0][1] if isinstance(spec, UniformTypeSpecs) else spec
    match kind:
        case FullAttentionSpec():
            return FullAttentionManager(spec, pool, group_id, dcp_world_size)
        case SlidingWindowSpec():
            return SlidingWindowManager(spec, pool, group_id, kind.sliding_window,
                                        dcp_world_size)
        case ChunkedLocalAttentionSpec():
            return ChunkedLocalAttentionManager(spec, pool, group_id,
                                                kind.attention_chunk_size, dcp_world_size)
        case CrossAttentionSpec():
            return CrossAttentionManager(spec, pool, group_id, dcp_world_size)
        case MambaSpec():
            return MambaManager(spec, pool, group_id, 1 + kind.num_speculative_blocks,
                                dcp_world_size)
    raise ConfigError(
        f"KV cache group {group_id}: no block manager for spec type {type(kind).__name__}"
    )
