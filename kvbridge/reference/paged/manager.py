"""The KV cache manager: the scheduler's one door to the paged KV cache.

One engine's scheduler owns one ``KVCacheManager``. Per step it asks for a
waiting request's cached prefix (:meth:`KVCacheManager.get_computed_blocks`),
reserves slots for the tokens it schedules (:meth:`KVCacheManager.allocate_slots`)
and releases finished or preempted requests (:meth:`KVCacheManager.free`).
Results are ``KVCacheBlocks``, which expose block ids and hide the pool.

The manager reads ``Request.num_computed_tokens`` but never writes it: the
scheduler advances it after a step has run.

Its checks (``_check_*``, the numbers in every allocation error) read the same
state as the methods they guard.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import ConfigError, IntegrityError, KVBridgeError
from kvbridge.reference.paged.block_pool import BlockPool
from kvbridge.reference.paged.coordinator import GroupBlocks, KVCacheCoordinator
from kvbridge.reference.paged.events import KVCacheEvent
from kvbridge.reference.paged.hashing import BlockHasher
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig
from kvbridge.reference.paged.request import Request
from kvbridge.reference.paged.stats import PrefixCacheStats

__all__ = [
    "AllocationError",
    "CacheTooSmallError",
    "KVCacheBlocks",
    "KVCacheManager",
    "RequestTooLongError",
]


class AllocationError(KVBridgeError, ValueError):
    """An ``allocate_slots`` call with invalid arguments. Nothing was changed."""


class RequestTooLongError(AllocationError):
    """The request would grow beyond ``max_model_len``. Nothing was changed."""


class CacheTooSmallError(AllocationError):
    """The request needs more blocks than the whole cache has. Nothing was changed."""


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks per KV cache group, as handed to the scheduler.

    The scheduler reads block ids and passes instances back to the manager;
    it never touches the blocks themselves.

    Attributes:
        blocks: ``blocks[g][i]`` is block ``i`` of group ``g`` (do not mutate).
    """

    blocks: GroupBlocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group (fresh lists the caller may keep)."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    @property
    def num_blocks(self) -> tuple[int, ...]:
        """Number of blocks per group."""
        return tuple(len(group) for group in self.blocks)

    def is_empty(self) -> bool:
        """Whether no group has a block."""
        return not any(self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Concatenate group-wise (e.g. cache hits followed by new blocks)."""
        if len(self.blocks) != len(other.blocks):
            raise ValueError(f"cannot add KVCacheBlocks of {len(self.blocks)} and "
                             f"{len(other.blocks)} groups")
        return KVCacheBlocks(tuple((*a, *b) for a, b in zip(self.blocks, other.blocks,
                                                             strict=True)))


class KVCacheManager:
    """Prefix-cache lookups, slot allocation and freeing over one block pool.

    Args:
        kv_cache_config: Block count and KV cache groups.
        max_model_len: Longest request in tokens (prompt + output).
        hasher: The block hasher every request of this engine uses; its block
            size must be the manager's block size when caching is enabled.
        enable_caching: Look up and fill the prefix cache.
        enable_kv_cache_events: Record cache events for :meth:`take_events`.
        dcp_world_size: Decode context-parallel ranks. A manager block then
            spans ``block_size`` tokens on each rank, so the manager's block
            size is the per-rank block size times ``dcp_world_size``.
        log_stats: Collect prefix-cache stats for :meth:`make_prefix_cache_stats`.

    Raises:
        ConfigError: no groups, non-positive sizes, several groups with
            ``dcp_world_size > 1``, differing block sizes with caching, a
            hasher of another block size, or caching with a group kind that
            cannot be cached (cross attention, Mamba).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        hasher: BlockHasher,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        log_stats: bool = False,
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ConfigError("KV cache config has no groups: nothing to manage")
        if max_model_len <= 0 or dcp_world_size <= 0:
            raise ConfigError(f"max_model_len ({max_model_len}) and dcp_world_size "
                              f"({dcp_world_size}) must be > 0")
        if dcp_world_size > 1 and len(groups) != 1:
            raise ConfigError(f"decode context parallelism (dcp_world_size={dcp_world_size}) "
                              f"supports one KV cache group, got {len(groups)}")
        block_sizes = sorted({g.kv_cache_spec.block_size * dcp_world_size for g in groups})
        self.block_size: int | None = block_sizes[0] if len(block_sizes) == 1 else None
        if enable_caching:
            if self.block_size is None:
                raise ConfigError(f"prefix caching needs one block size, groups have "
                                  f"{block_sizes}")
            if hasher.block_size != self.block_size:
                raise ConfigError(f"hasher block_size {hasher.block_size} != manager block "
                                  f"size {self.block_size} (spec block size x dcp_world_size)")
        self.max_model_len = max_model_len
        self.hasher = hasher
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.kv_cache_config = kv_cache_config
        self._pool = BlockPool(kv_cache_config.num_blocks, enable_caching, enable_kv_cache_events)
        self._coordinator = KVCacheCoordinator(kv_cache_config, self._pool, enable_caching,
                                               dcp_world_size)
        uncacheable = [m.group_id for m in self._coordinator.managers
                       if not m.supports_prefix_cache]
        if enable_caching and uncacheable:
            raise ConfigError(f"KV cache groups {uncacheable} (cross attention / Mamba) cannot "
                              f"be prefix-cached; pass enable_caching=False")
        self.num_kv_cache_groups = len(groups)
        self._empty = KVCacheBlocks(self._coordinator.empty)
        self._stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None

    # ------------------------------------------------------------------ reads

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self._pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks free for allocation (cached free blocks included)."""
        return self._pool.get_num_free_blocks()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self._pool.num_usable_blocks

    def empty_blocks(self) -> KVCacheBlocks:
        """A ``KVCacheBlocks`` with no block in any group."""
        return self._empty

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (a snapshot); empty if unknown."""
        return KVCacheBlocks(tuple(tuple(g) for g in self._coordinator.get_blocks(request_id)))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group; empty lists if unknown."""
        return tuple([b.block_id for b in g] for g in self._coordinator.get_blocks(request_id))

    def get_num_common_prefix_blocks(
        self, request_id: str, num_running_requests: int
    ) -> list[int]:
        """Per group, leading blocks of ``request_id`` held by every running request.

        A block counts when its ``ref_cnt`` equals ``num_running_requests``:
        running requests that were not scheduled this step still hold their
        blocks, so the answer can be 0 even when all *scheduled* requests
        share a prefix. Only full-attention groups report shared blocks.

        Args:
            request_id: Any running request.
            num_running_requests: Requests currently holding blocks.

        Returns:
            One count per group (zeros for an unknown request).

        Raises:
            ValueError: ``num_running_requests`` < 1.
        """
        if num_running_requests < 1:
            raise ValueError(f"num_running_requests must be >= 1, got {num_running_requests}")
        return self._coordinator.num_common_prefix_blocks(request_id, num_running_requests)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a waiting request. Does not hold the blocks.

        At most ``num_tokens - 1`` tokens can hit: the last token must be
        computed to get logits. Hits are whole blocks, so a prompt that is
        cached in full still recomputes its last block.

        Args:
            request: A request that holds no blocks yet.

        Returns:
            The hit blocks per group (pass them to :meth:`allocate_slots`) and
            the number of hit tokens, a block multiple. Empty and 0 when
            caching is off or the request skips the prefix cache.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return self._empty, 0
        self._check_hasher(request)
        blocks, num_hit_tokens = self._coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if self._stats is not None:
            self._stats.record(request.num_tokens, num_hit_tokens)
        return KVCacheBlocks(blocks), num_hit_tokens

    # -------------------------------------------------------------- mutations

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_external_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Reserve KV slots for the tokens a request runs (or receives) this step.

        Token ranges of the request after the call::

            | computed | new computed | external | new    | lookahead |
            0          a              b          c        d           e

            a = request.num_computed_tokens   (already in the cache)
            b = a + num_new_computed_tokens   (prefix-cache hits: new_computed_blocks)
            c = b + num_external_computed_tokens  (loaded from a remote prefill)
            d = c + num_new_tokens            (computed this step)
            e = min(d + num_lookahead_tokens, max_model_len)  (speculative slots)

        The request then holds blocks covering ``[0, e)``. Full blocks up to
        ``min(d, request.num_tokens)`` enter the prefix cache now, unless
        ``delay_cache_blocks`` (blocks still arriving from a remote instance:
        call :meth:`cache_blocks` once they have). Sliding-window and chunked
        groups first release blocks that fell out of reach at ``a``.

        Args:
            request: The request; ``num_computed_tokens`` is read, not written.
            num_new_tokens: Tokens computed this step (>= 0).
            num_new_computed_tokens: Tokens hit in the prefix cache, as
                returned by :meth:`get_computed_blocks` (new requests only).
            new_computed_blocks: The hit blocks from :meth:`get_computed_blocks`.
            num_lookahead_tokens: Extra slots for speculative tokens.
            delay_cache_blocks: Do not cache the blocks yet.
            num_external_computed_tokens: Tokens whose KV a remote prefill sends.

        Returns:
            The newly allocated blocks per group (hits excluded), or ``None``
            when the pool has too few free blocks right now; then nothing
            changed and the scheduler may preempt and retry.

        Raises:
            AllocationError: negative counts, no tokens at all, hits that do
                not match their blocks, or hits for a request holding blocks.
            RequestTooLongError: ``d`` exceeds ``max_model_len``.
            CacheTooSmallError: the request alone needs more blocks than the
                cache has, so it could never be scheduled.
            ConfigError: the request's hasher differs from the manager's.
        """
        request_id = request.request_id
        hits = self._check_allocation(request, num_new_tokens, num_new_computed_tokens,
                                      new_computed_blocks, num_lookahead_tokens,
                                      num_external_computed_tokens)
        num_computed_tokens = request.num_computed_tokens
        num_tokens_computed_after = (num_computed_tokens + num_new_computed_tokens
                                     + num_external_computed_tokens + num_new_tokens)
        num_slots = min(num_tokens_computed_after + num_lookahead_tokens, self.max_model_len)
        coordinator = self._coordinator
        num_to_allocate = coordinator.num_blocks_to_allocate(
            request_id, num_slots, hits, request.num_encoder_tokens)
        num_free = self._pool.get_num_free_blocks()
        if num_to_allocate > num_free:
            self._check_fits_at_all(request, num_slots, hits)
            if num_to_allocate > num_free + coordinator.num_freed_by_skip(
                    request_id, num_computed_tokens):
                return None
        if coordinator.skips_blocks:
            coordinator.remove_skipped_blocks(request_id, num_computed_tokens)
        if hits is not coordinator.empty:
            self._pool.touch(hits)
            coordinator.save_new_computed_blocks(request_id, hits)
        if num_to_allocate:
            new_blocks = coordinator.allocate_new_blocks(request_id, num_slots,
                                                         request.num_encoder_tokens)
        else:
            # Nothing fresh needed, so the request already has its lists (a new
            # request always needs a block for its first token).
            new_blocks = coordinator.empty
        if self.enable_caching and not delay_cache_blocks:
            # Only tokens the request really has (not speculative drafts) are cached.
            coordinator.cache_blocks(request, min(num_tokens_computed_after, request.num_tokens))
        if not any(new_blocks):
            return self._empty
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_computed_tokens`` tokens.

        For blocks allocated with ``delay_cache_blocks=True`` once their KV has
        arrived. A no-op when caching is disabled or the request holds nothing.

        Raises:
            AllocationError: ``num_computed_tokens`` is negative or beyond the
                request's tokens.
        """
        if not 0 <= num_computed_tokens <= request.num_tokens:
            raise AllocationError(f"request {request.request_id!r}: cannot cache "
                                  f"{num_computed_tokens} tokens of {request.num_tokens}")
        if not self.enable_caching or not self._coordinator.has_request(request.request_id):
            return
        self._check_hasher(request)
        self._coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request | str) -> None:
        """Release every block of a request, tail blocks first.

        Freed blocks stay in the prefix cache until reused; the tail of the
        request (longest prefix, least shared) is evicted first. Unknown
        requests are ignored, so freeing twice is harmless.
        """
        request_id = request if isinstance(request, str) else request.request_id
        self._coordinator.free(request_id)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop blocks from the prefix cache (their content is bad, e.g. a failed load).

        Raises:
            ValueError: a block id is out of range (nothing changed).
        """
        self._pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after a weight update).

        Returns:
            False, with nothing changed, while any request holds blocks.
        """
        if not self._pool.reset_prefix_cache():
            return False
        if self._stats is not None:
            self._stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered since the last call and start new ones.

        Returns:
            The stats, or ``None`` when ``log_stats`` is off.
        """
        if self._stats is None:
            return None
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """Return and forget the recorded KV cache events, oldest first."""
        return self._pool.take_events()

    def check_integrity(self) -> None:
        """Check the pool and every request's block lists against each other.

        Raises:
            IntegrityError: with the counts that disagree.
        """
        self._pool.check_integrity()
        problems = self._coordinator.check_integrity()
        if problems:
            raise IntegrityError("kv cache manager: " + "; ".join(problems))

    # ---------------------------------------------------------------- checks

    def _check_hasher(self, request: Request) -> None:
        hasher = request.hasher
        if hasher is not self.hasher and hasher != self.hasher:
            raise ConfigError(f"request {request.request_id!r} is hashed by {hasher!r}, "
                              f"the manager by {self.hasher!r}")

    def _check_allocation(
        self, request: Request, num_new_tokens: int, num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None, num_lookahead_tokens: int,
        num_external_computed_tokens: int,
    ) -> GroupBlocks:
        """Validate an allocate_slots call; return the hit blocks per group."""
        request_id = request.request_id
        counts = (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                  num_external_computed_tokens)
        if min(counts) < 0:
            raise AllocationError(
                f"request {request_id!r}: counts must be >= 0, got num_new_tokens="
                f"{num_new_tokens}, num_new_computed_tokens={num_new_computed_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}, "
                f"num_external_computed_tokens={num_external_computed_tokens}")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise AllocationError(f"request {request_id!r}: nothing to allocate "
                                  f"(num_new_tokens and num_external_computed_tokens are 0)")
        num_end = (request.num_computed_tokens + num_new_computed_tokens
                   + num_external_computed_tokens + num_new_tokens)
        if num_end > self.max_model_len:
            raise RequestTooLongError(
                f"request {request_id!r}: {request.num_computed_tokens} computed + "
                f"{num_new_computed_tokens} cached + {num_external_computed_tokens} external + "
                f"{num_new_tokens} new = {num_end} tokens > max_model_len {self.max_model_len}")
        if self.enable_caching:
            self._check_hasher(request)
        if new_computed_blocks is None:
            if num_new_computed_tokens:
                raise AllocationError(f"request {request_id!r}: {num_new_computed_tokens} "
                                      f"cached tokens but no new_computed_blocks")
            return self._coordinator.empty
        return self._check_hits(request, num_new_computed_tokens, new_computed_blocks)

    def _check_hits(
        self, request: Request, num_new_computed_tokens: int, new_computed_blocks: KVCacheBlocks
    ) -> GroupBlocks:
        hits = new_computed_blocks.blocks
        request_id = request.request_id
        if len(hits) != self.num_kv_cache_groups:
            raise AllocationError(f"request {request_id!r}: new_computed_blocks has "
                                  f"{len(hits)} groups, the manager {self.num_kv_cache_groups}")
        if not any(hits):
            if num_new_computed_tokens:
                raise AllocationError(f"request {request_id!r}: {num_new_computed_tokens} "
                                      f"cached tokens but no cached blocks")
            return self._coordinator.empty
        if not self.enable_caching:
            raise AllocationError(f"request {request_id!r}: cached blocks given but prefix "
                                  f"caching is disabled")
        if self._coordinator.has_request(request_id):
            raise AllocationError(f"request {request_id!r} already holds blocks; cache hits "
                                  f"are only for a request's first allocation")
        assert self.block_size is not None  # caching enabled => one block size
        num_hit_blocks = {len(group) for group in hits}
        if num_hit_blocks != {num_new_computed_tokens // self.block_size} or (
                num_new_computed_tokens % self.block_size):
            raise AllocationError(
                f"request {request_id!r}: {num_new_computed_tokens} cached tokens do not match "
                f"cached blocks per group {sorted(num_hit_blocks)} of {self.block_size} tokens")
        return hits

    def _check_fits_at_all(self, request: Request, num_slots: int, hits: GroupBlocks) -> None:
        num_needed = self._coordinator.num_blocks_after(
            request.request_id, num_slots, hits, request.num_encoder_tokens,
            request.num_computed_tokens)
        if num_needed > self._pool.num_usable_blocks:
            raise CacheTooSmallError(
                f"request {request.request_id!r} needs {num_needed} blocks for {num_slots} "
                f"tokens but the cache has {self._pool.num_usable_blocks} in total")

