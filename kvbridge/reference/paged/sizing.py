"""KV cache sizing: from per-layer specs and free bytes to a :class:`KVCacheConfig`.

Called once at engine start-up: each worker measures its free memory and calls
:func:`get_kv_cache_config`; the engine then makes the workers agree with
:func:`unify_kv_cache_configs` (the smallest cache wins) and hands the result to
the block manager. :func:`check_enough_memory` and :func:`estimate_max_model_len`
tell a user, with numbers, why a max-length request does not fit and what would.

Memory layout for several groups of equal page size (layers ``aN`` full
attention, ``sN`` sliding window, group size 2)::

    groups:   G0 = (a0, a1)   G1 = (s0, s1)   G2 = (s2, s3)
    tensors:  T0 shared by (a0, s0, s2)       T1 shared by (a1, s1, s3)

Each tensor holds ``num_blocks`` pages. A block id belongs to one group at a time,
so the layers sharing a tensor never use the same page at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.reference.paged.kv_cache_config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    UniformTypeSpecs,
    is_uniform_type,
    merge_specs,
)
from kvbridge.reference.paged.spec import (
    ChunkedLocalAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    SpecMismatchError,
    UnsupportedSpecError,
    cdiv,
)

_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Scheduler limits that bound what one request can hold in the cache.

    ``max_num_encoder_tokens=None`` means ``max_num_batched_tokens``.
    """

    max_model_len: int
    max_num_batched_tokens: int
    max_num_encoder_tokens: int | None = None
    dcp_world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_encoder_tokens",
                     "dcp_world_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"RequestLimits: {name} must be > 0, got {value}")


def _spec_nbytes(spec: KVCacheSpec, limits: RequestLimits) -> int:
    return spec.max_memory_usage_bytes(
        limits.max_model_len, limits.max_num_batched_tokens,
        max_num_encoder_tokens=limits.max_num_encoder_tokens,
        dcp_world_size=limits.dcp_world_size)


def max_request_nbytes(specs: Mapping[str, KVCacheSpec], limits: RequestLimits) -> int:
    """Worst-case bytes one request pins across all layers.

    Args:
        specs: ``{layer_name: spec}``.
        limits: max_model_len, max_num_batched_tokens and friends.

    Returns:
        The sum of every layer's worst case (0 when no layer keeps a cache).

    Raises:
        UnsupportedSpecError: a spec defines no worst case.
    """
    return sum(_spec_nbytes(spec, limits) for spec in specs.values())


def as_full_attention(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Treat sliding-window and chunked-local layers as full attention.

    For running a hybrid model with a single KV cache group: every layer gets
    blocks for all tokens and the window / chunk size is only recorded. Models
    without a full-attention layer are returned unchanged.

    Args:
        specs: ``{layer_name: spec}``.

    Returns:
        A new dict; converted layers keep block size, heads and dtype.
    """
    if not any(type(spec) is FullAttentionSpec for spec in specs.values()):
        return dict(specs)
    result: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        match spec:
            case SlidingWindowSpec():
                spec = FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size,
                                         spec.dtype, sliding_window=spec.sliding_window)
            case ChunkedLocalAttentionSpec():
                spec = FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size,
                                         spec.dtype,
                                         attention_chunk_size=spec.attention_chunk_size)
        result[name] = spec
    return result


def _try_merge(specs: Sequence[KVCacheSpec]) -> KVCacheSpec | None:
    try:
        return merge_specs(specs)
    except SpecMismatchError:
        return None


def group_layers(specs: Mapping[str, KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Split a model's layers into KV cache groups (one block table each).

    Encoder-only layers keep no cache and join no group. Then, in order:
    1. all layers merge into one spec: one group;
    2. all layers are of one uniform type (e.g. full attention with different
       head counts): one group with a :class:`UniformTypeSpecs`;
    3. all page sizes are equal (hybrid, e.g. full + sliding window): the layers
       of each distinct spec are cut into groups of ``group_size`` layers, so
       every group has at most ``group_size`` layers and tensors can be shared.

    Args:
        specs: ``{layer_name: spec}`` in model order.

    Returns:
        The groups; empty when no layer keeps a cache.

    Raises:
        UnsupportedSpecError: a spec is of an unknown type.
        SpecMismatchError: a hybrid model whose page sizes differ.
    """
    for spec in specs.values():
        if not isinstance(spec, KVCacheSpec):
            raise UnsupportedSpecError(f"not a KVCacheSpec: {type(spec).__name__}")
    cached = {n: s for n, s in specs.items() if not isinstance(s, EncoderOnlyAttentionSpec)}
    if not cached:
        return ()
    if is_uniform_type(cached):  # also rejects unknown spec types
        merged = _try_merge(list(cached.values()))
        if merged is None:
            merged = UniformTypeSpecs(next(iter(cached.values())).block_size,
                                      tuple(cached.items()))
        return (KVCacheGroupSpec(tuple(cached), merged),)
    page_sizes = {name: spec.page_size_bytes for name, spec in cached.items()}
    if len(set(page_sizes.values())) > 1:
        raise SpecMismatchError(
            f"hybrid model with different page sizes per layer {page_sizes}; pad Mamba "
            f"state (page_size_padded) or pick block sizes that equalize pages")
    layers_by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in cached.items():
        layers_by_spec.setdefault(spec, []).append(name)
    group_size = _group_size([len(names) for names in layers_by_spec.values()])
    groups = []
    for spec, names in layers_by_spec.items():
        for start in range(0, len(names), group_size):
            groups.append(KVCacheGroupSpec(tuple(names[start:start + group_size]), spec))
    return tuple(groups)


def _group_size(num_layers_per_spec: list[int]) -> int:
    # Every group is padded to group_size layers' worth of tensors. Using the largest
    # count wastes (max - n) / max of the smaller kinds' memory, fine when the counts
    # are close (under 25% apart); otherwise use the smallest count and split the
    # larger kinds into several groups (more block tables, no padding).
    smallest, largest = min(num_layers_per_spec), max(num_layers_per_spec)
    return largest if largest < smallest * 1.25 else smallest


def _tensor_slots(groups: Sequence[KVCacheGroupSpec]) -> list[tuple[str, ...]]:
    # Slot i holds the i-th layer of every group that has one.
    num_slots = max(len(group.layer_names) for group in groups)
    return [tuple(g.layer_names[i] for g in groups if i < len(g.layer_names))
            for i in range(num_slots)]


def _layer_page_nbytes(group: KVCacheGroupSpec) -> dict[str, int]:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeSpecs):
        return {name: s.page_size_bytes for name, s in spec.layer_specs}
    return dict.fromkeys(group.layer_names, spec.page_size_bytes)


def max_num_blocks_per_request(groups: Sequence[KVCacheGroupSpec],
                               limits: RequestLimits) -> int:
    """Blocks one worst-case request takes from the shared pool, summed over groups.

    Args:
        groups: the KV cache groups (e.g. ``config.kv_cache_groups``).
        limits: max_model_len, max_num_batched_tokens and friends.

    Returns:
        The block count (0 without groups).
    """
    return sum(cdiv(_spec_nbytes(g.kv_cache_spec, limits), g.kv_cache_spec.page_size_bytes)
               for g in groups)


def estimate_max_model_len(specs: Mapping[str, KVCacheSpec], available_nbytes: int,
                           limits: RequestLimits) -> int:
    """Longest ``max_model_len`` (up to ``limits.max_model_len``) whose request fits.

    Binary search: a request's worst case never shrinks as max_model_len grows.

    Args:
        specs: ``{layer_name: spec}``.
        available_nbytes: bytes free for the KV cache.
        limits: the other limits stay fixed; max_model_len is the search bound.

    Returns:
        The longest fitting length, 0 when not even one token fits.
    """
    low, high, best = 1, limits.max_model_len, 0
    while low <= high:
        mid = (low + high) // 2
        trial = dataclasses.replace(limits, max_model_len=mid)
        if max_request_nbytes(specs, trial) <= available_nbytes:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


NUM_RESERVED_BLOCKS = 1
"""Blocks the pool keeps for itself: block 0 is the null placeholder."""


def check_enough_memory(specs: Mapping[str, KVCacheSpec], available_nbytes: int,
                        limits: RequestLimits) -> None:
    """Check that one request of ``limits.max_model_len`` tokens fits.

    Args:
        specs: ``{layer_name: spec}``.
        available_nbytes: bytes free for the KV cache.
        limits: max_model_len, max_num_batched_tokens and friends.

    Raises:
        ConfigError: (a ``ValueError``) with the bytes needed and available and the
            longest max_model_len that would fit.
    """
    needed_nbytes = max_request_nbytes(specs, limits)
    if needed_nbytes == 0:
        return
    if available_nbytes <= 0:
        raise ConfigError(f"no memory left for the KV cache (available_nbytes="
                          f"{available_nbytes}); free memory or lower the model's footprint")
    if needed_nbytes > available_nbytes:
        fitting_len = estimate_max_model_len(specs, available_nbytes, limits)
        raise ConfigError(
            f"one request of max_model_len={limits.max_model_len} tokens needs "
            f"{needed_nbytes} bytes ({needed_nbytes / _GIB:.2f} GiB) of KV cache, more than "
            f"the {available_nbytes} bytes ({available_nbytes / _GIB:.2f} GiB) available; "
            f"the largest max_model_len that fits is {fitting_len}. Lower max_model_len or "
            f"give the KV cache more memory")


def get_kv_cache_config(specs: Mapping[str, KVCacheSpec], available_nbytes: int,
                        limits: RequestLimits, *,
                        num_blocks_override: int | None = None) -> KVCacheConfig:
    """Size the cache: groups, number of blocks, and the tensors to allocate.

    Args:
        specs: ``{layer_name: spec}`` in model order.
        available_nbytes: bytes free for the KV cache on this worker.
        limits: max_model_len, max_num_batched_tokens and friends.
        num_blocks_override: use exactly this many blocks (tests, debugging);
            tensor sizes follow it even if they exceed ``available_nbytes``.

    Returns:
        The config. A model without cached layers gets no groups, no tensors and
        the placeholder ``num_blocks=1``.

    Raises:
        ConfigError: not enough memory for one max-length request, or a
            non-positive override, or an override too small for one request.
        UnsupportedSpecError, SpecMismatchError: from :func:`group_layers`.
    """
    if num_blocks_override is not None and num_blocks_override <= 0:
        raise ConfigError(f"num_blocks_override must be > 0, got {num_blocks_override}")
    groups = group_layers(specs)
    if not groups:
        return KVCacheConfig(num_blocks_override or 1, (), ())
    check_enough_memory(specs, available_nbytes, limits)
    page_nbytes: dict[str, int] = {}
    for group in groups:
        page_nbytes.update(_layer_page_nbytes(group))
    slots = _tensor_slots(groups)
    # Layers sharing a slot have equal pages (uniform page size); max() is exact.
    slot_page_nbytes = [max(page_nbytes[name] for name in slot) for slot in slots]
    block_nbytes = sum(slot_page_nbytes)
    num_blocks = available_nbytes // block_nbytes
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    # The block pool reserves one block as the null placeholder (block 0).
    num_needed = max_num_blocks_per_request(groups, limits) + NUM_RESERVED_BLOCKS
    if num_blocks < num_needed:
        raise ConfigError(
            f"{num_blocks} blocks of {block_nbytes} bytes cannot hold one request of "
            f"max_model_len={limits.max_model_len}, which needs {num_needed} blocks "
            f"({NUM_RESERVED_BLOCKS} reserved as the null block)")
    tensors = tuple(KVCacheTensor(page * num_blocks, slot)
                    for page, slot in zip(slot_page_nbytes, slots, strict=True))
    return KVCacheConfig(num_blocks, tensors, groups)


def unify_kv_cache_configs(configs: Sequence[KVCacheConfig]) -> tuple[KVCacheConfig, ...]:
    """Make every worker use the same number of blocks: the smallest one.

    Args:
        configs: one config per worker, all with identical groups.

    Returns:
        New configs (inputs are not changed) with ``num_blocks`` equal to the
        minimum and each tensor shrunk to that many pages.

    Raises:
        ConfigError: no configs, or the workers' groups differ.
    """
    if not configs:
        raise ConfigError("unify_kv_cache_configs: no configs given")
    for rank, config in enumerate(configs):
        if config.kv_cache_groups != configs[0].kv_cache_groups:
            raise ConfigError(f"worker {rank} has KV cache groups different from worker 0: "
                              f"{config.kv_cache_groups} vs {configs[0].kv_cache_groups}")
    num_blocks = min(config.num_blocks for config in configs)
    return tuple(
        KVCacheConfig(
            num_blocks,
            tuple(KVCacheTensor(t.size // c.num_blocks * num_blocks, t.shared_by)
                  for t in c.kv_cache_tensors),
            c.kv_cache_groups)
        for c in configs)


def get_max_concurrency(config: KVCacheConfig, limits: RequestLimits) -> float:
    """How many worst-case requests the cache holds at once (a log figure).

    Args:
        config: a sized config.
        limits: max_model_len, max_num_batched_tokens and friends.

    Returns:
        ``num_blocks / blocks per worst-case request``; ``inf`` without groups.
    """
    num_per_request = max_num_blocks_per_request(config.kv_cache_groups, limits)
    return config.num_blocks / num_per_request if num_per_request else float("inf")
