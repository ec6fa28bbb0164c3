"""KV cache groups and the cache config: which layers share a block table, what to allocate.

Layers whose specs need the same token slots (same kind, block size and window;
:func:`is_uniform_type`) form one KV cache group, managed through one block
table. A group's spec is :func:`merge_specs` of its layers' specs when they are
identical, or a :class:`UniformTypeSpecs` when they are of one kind with
different page sizes. :func:`kvbridge.reference.paged.sizing.group_layers` forms the
groups; with the buffers each worker allocates they make a
:class:`KVCacheConfig`, which the block manager (one group manager per
:class:`KVCacheGroupSpec`) and the workers consume. The per-layer specs are in
``spec.py``.

All records are frozen, hashable dataclasses validated on construction; bad
values raise :class:`~kvbridge.errors.ConfigError` with the offending numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvbridge.errors import ConfigError
from kvbridge.reference.paged.spec import (
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
    cdiv,
)

__all__ = [
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheTensor",
    "UniformTypeSpecs",
    "is_uniform_type",
    "merge_specs",
]

_SpecT = TypeVar("_SpecT", bound=KVCacheSpec)

# Exact spec types kvbridge can size and group; a subclass defined elsewhere is refused
# rather than silently treated like its parent.
_KNOWN_SPEC_TYPES: frozenset[type[KVCacheSpec]] = frozenset({
    FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec,
    CrossAttentionSpec, EncoderOnlyAttentionSpec, MambaSpec,
})


def _check_known(specs: Sequence[object]) -> None:
    for spec in specs:
        if type(spec) not in _KNOWN_SPEC_TYPES:
            raise UnsupportedSpecError(
                f"unsupported KV cache spec type {type(spec).__name__}; known: "
                f"{sorted(t.__name__ for t in _KNOWN_SPEC_TYPES)}")


def is_uniform_type(specs: Mapping[str, KVCacheSpec]) -> bool:
    """Whether all layers need the same token slots, so one block table serves them.

    Same kind *and* same block size; sliding windows, chunk sizes and Mamba
    speculative blocks must also match. Head counts and dtypes may differ.

    Args:
        specs: ``{layer_name: spec}``, at least one layer.

    Returns:
        True when the layers are of one uniform type.

    Raises:
        ConfigError: ``specs`` is empty.
        UnsupportedSpecError: a spec is of an unknown type.
    """
    values = list(specs.values())
    if not values:
        raise ConfigError("is_uniform_type: no layers given")
    _check_known(values)
    return len({(type(spec), spec.block_size, _kind_key(spec)) for spec in values}) == 1


def _kind_key(spec: KVCacheSpec) -> int | None:
    """The parameter that changes how many token slots a layer of this kind needs."""
    match spec:
        case SlidingWindowSpec():
            return spec.sliding_window
        case ChunkedLocalAttentionSpec():
            return spec.attention_chunk_size
        case MambaSpec():
            return spec.num_speculative_blocks
        case _:
            return None


def _merge_recorded(name: str, values: set[int | None]) -> int | None:
    values.discard(None)
    if len(values) > 1:
        raise SpecMismatchError(f"layers of one group record different {name}s: "
                                f"{sorted(v for v in values if v is not None)}")
    return values.pop() if values else None


def merge_specs(specs: Sequence[_SpecT]) -> _SpecT:
    """Merge the specs of the layers of one KV cache group into one spec.

    Layers must be identical, except that full-attention layers may differ in
    whether they record a sliding window / chunk size (at most one value each).

    Args:
        specs: the layers' specs, at least one, all of one exact type.

    Returns:
        The spec the group's block table is managed with.

    Raises:
        ConfigError: ``specs`` is empty.
        UnsupportedSpecError: a spec is of an unknown type.
        SpecMismatchError: the specs cannot share one block table.
    """
    if not specs:
        raise ConfigError("merge_specs: no specs given")
    _check_known(specs)
    first = specs[0]
    types = {type(spec).__name__ for spec in specs}
    if len(types) > 1:
        raise SpecMismatchError(f"cannot merge specs of different types: {sorted(types)}")
    if not isinstance(first, FullAttentionSpec):
        distinct = list(dict.fromkeys(specs))
        if len(distinct) > 1:
            raise SpecMismatchError(f"cannot merge differing specs: {distinct}")
        return first
    full = [spec for spec in specs if isinstance(spec, FullAttentionSpec)]
    window = _merge_recorded("sliding_window", {s.sliding_window for s in full})
    chunk = _merge_recorded("attention_chunk_size", {s.attention_chunk_size for s in full})
    if window is not None and chunk is not None:
        raise SpecMismatchError(f"a group cannot mix sliding window ({window}) and chunked "
                                f"local attention ({chunk}) layers")
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in full}
    if len(shapes) > 1:
        raise SpecMismatchError("cannot merge attention layers with different (block_size, "
                                f"num_kv_heads, head_size, dtype): {sorted(map(str, shapes))}")
    return dataclasses.replace(first, sliding_window=window, attention_chunk_size=chunk)


@dataclass(frozen=True, slots=True)
class UniformTypeSpecs(KVCacheSpec):
    """Layers of one kind (same token slots needed) but different page sizes.

    Example: full-attention layers with different head counts. They share one
    block table; a block id addresses one page in *each* layer, so the group's
    page size is the sum of the layers' page sizes.
    """

    layer_specs: tuple[tuple[str, KVCacheSpec], ...]

    def _validate(self) -> None:
        KVCacheSpec._validate(self)
        specs = dict(self.layer_specs)
        if not specs or len(specs) != len(self.layer_specs):
            raise ConfigError(f"UniformTypeSpecs: need distinct layer names, got "
                              f"{[name for name, _ in self.layer_specs]}")
        if not is_uniform_type(specs) or any(s.page_size_bytes == 0 for s in specs.values()):
            raise SpecMismatchError("UniformTypeSpecs: layers are not of one cached kind")
        block_sizes = {spec.block_size for spec in specs.values()}
        if block_sizes != {self.block_size}:
            raise SpecMismatchError(f"UniformTypeSpecs: block_size={self.block_size} but "
                                    f"layers have {sorted(block_sizes)}")

    @property
    def specs_by_layer(self) -> dict[str, KVCacheSpec]:
        """A fresh ``{layer_name: spec}`` dict."""
        return dict(self.layer_specs)

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for _, spec in self.layer_specs)

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int, *,
        max_num_encoder_tokens: int | None = None, dcp_world_size: int = 1,
    ) -> int:
        num_pages = max(
            cdiv(spec.max_memory_usage_bytes(
                max_model_len, max_num_batched_tokens,
                max_num_encoder_tokens=max_num_encoder_tokens,
                dcp_world_size=dcp_world_size), spec.page_size_bytes)
            for _, spec in self.layer_specs)
        return num_pages * self.page_size_bytes


def _unique_names(owner: str, names: Sequence[str]) -> tuple[str, ...]:
    result = tuple(names)
    if not result:
        raise ConfigError(f"{owner}: needs at least one layer name")
    if len(set(result)) != len(result):
        dupes = sorted({n for n in result if result.count(n) > 1})
        raise ConfigError(f"{owner}: duplicate layer names {dupes}")
    return result


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table; the manager treats them as one layer."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names",
                           _unique_names("KVCacheGroupSpec", self.layer_names))
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise UnsupportedSpecError(
                f"KVCacheGroupSpec: kv_cache_spec must be a KVCacheSpec, got "
                f"{type(self.kv_cache_spec).__name__}")


@dataclass(frozen=True, slots=True)
class KVCacheTensor:
    """One buffer a worker allocates; the layers in ``shared_by`` all view it.

    Layers from *different* groups may share a tensor: a block id is only ever
    handed to one group at a time, so their pages never overlap in use.
    """

    size: int
    shared_by: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ConfigError(f"KVCacheTensor: size must be > 0, got {self.size}")
        object.__setattr__(self, "shared_by", _unique_names("KVCacheTensor", self.shared_by))


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """How many blocks the cache has, what to allocate, and how layers are grouped.

    A model without cached layers (attention-free, encoder-only) has no groups and
    no tensors; ``num_blocks`` is then a placeholder of 1.
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ConfigError(f"KVCacheConfig: num_blocks must be > 0, got {self.num_blocks}")
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        grouped = [name for group in self.kv_cache_groups for name in group.layer_names]
        if len(set(grouped)) != len(grouped):
            raise ConfigError(f"KVCacheConfig: a layer is in two groups: {grouped}")
        backed = [name for tensor in self.kv_cache_tensors for name in tensor.shared_by]
        if len(set(backed)) != len(backed):
            raise ConfigError(f"KVCacheConfig: a layer is backed by two tensors: {backed}")
        stray = sorted(set(backed) - set(grouped))
        if stray:
            raise ConfigError(f"KVCacheConfig: tensors name layers in no group: {stray}")
        for tensor in self.kv_cache_tensors:
            if tensor.size % self.num_blocks:
                raise ConfigError(f"KVCacheConfig: tensor of {tensor.size} bytes for "
                                  f"{tensor.shared_by} is not a multiple of "
                                  f"num_blocks={self.num_blocks}")
