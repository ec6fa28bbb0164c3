"""The reference engine's paged KV cache manager (vLLM brings its own).

Map of the package (lower modules never import higher ones)::

    spec.py             per-layer KV cache specs and their worst cases
    kv_cache_config.py  which layers share a block table; groups, KVCacheConfig
    sizing.py           blocks from available memory, longest context
    hashing.py          chained, seeded block hashes (P and D agree)
    events.py           prefix-cache events (stored / removed / cleared)
    free_queue.py       KVCacheBlock and the intrusive LRU free-block queue
    block_pool.py       ref counts, hash -> block map, eviction
    request.py          the request as the manager sees it
    single_type.py      per-group managers: the base, full, cross attention, Mamba
    windowed.py         per-group managers: sliding window, chunked local
    coordinator.py      the groups of one config as a unit (builds their managers)
    manager.py          KVCacheManager: the scheduler's interface
    stats.py            prefix-cache stats and hit-rate window
    block_table.py      per-request block id rows and slot mapping (worker side)
"""

from __future__ import annotations

from kvbridge.reference.paged.block_pool import BlockPool, DoubleFreeError
from kvbridge.reference.paged.block_table import (
    BlockTable,
    ContextParallelConfig,
    GroupTableSpec,
    MultiGroupBlockTable,
)
from kvbridge.reference.paged.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    decode_events,
    encode_events,
)
from kvbridge.reference.paged.free_queue import FreeBlockQueue, KVCacheBlock, NoFreeBlocksError
from kvbridge.reference.paged.hashing import (
    HASH_FN_NAMES,
    BlockHash,
    BlockHasher,
    MultiModalSpan,
    RequestHashExtras,
    make_hash_fn,
)
from kvbridge.reference.paged.kv_cache_config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    UniformTypeSpecs,
)
from kvbridge.reference.paged.manager import (
    AllocationError,
    CacheTooSmallError,
    KVCacheBlocks,
    KVCacheManager,
    RequestTooLongError,
)
from kvbridge.reference.paged.request import Request
from kvbridge.reference.paged.sizing import (
    RequestLimits,
    check_enough_memory,
    estimate_max_model_len,
    get_kv_cache_config,
    get_max_concurrency,
    group_layers,
    max_request_nbytes,
    unify_kv_cache_configs,
)
from kvbridge.reference.paged.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SpecMismatchError,
    UnsupportedSpecError,
)
from kvbridge.reference.paged.stats import PrefixCacheHitWindow, PrefixCacheStats

__all__ = [
    "HASH_FN_NAMES",
    "AllBlocksCleared",
    "AllocationError",
    "AttentionSpec",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "BlockTable",
    "CacheTooSmallError",
    "ChunkedLocalAttentionSpec",
    "ContextParallelConfig",
    "CrossAttentionSpec",
    "DoubleFreeError",
    "EncoderOnlyAttentionSpec",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "GroupTableSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "MultiGroupBlockTable",
    "MultiModalSpan",
    "NoFreeBlocksError",
    "PrefixCacheHitWindow",
    "PrefixCacheStats",
    "Request",
    "RequestHashExtras",
    "RequestLimits",
    "RequestTooLongError",
    "SlidingWindowSpec",
    "SpecMismatchError",
    "UniformTypeSpecs",
    "UnsupportedSpecError",
    "check_enough_memory",
    "decode_events",
    "encode_events",
    "estimate_max_model_len",
    "get_kv_cache_config",
    "get_max_concurrency",
    "group_layers",
    "make_hash_fn",
    "max_request_nbytes",
    "unify_kv_cache_configs",
]
