"""vLLM's KV cache groups (its hybrid KV cache manager, HMA) as kvbridge sees them.

vLLM gives each kind of layer a group with its own block table (full
attention, sliding window, Mamba / linear attention), all drawing block ids
from one pool; the layers of different groups share the cache buffers, a
block id naming the same bytes in each (``KVCacheTensor``: "cache groups
overlay each other"). What kvbridge needs of that:

- :func:`cache_groups`: each transfer group as a ``kvbridge.topology.CacheGroup``
  (what moves of it), or a ``ConfigError`` at start-up naming a group kvbridge
  cannot move;
- :func:`registered_caches`: one tensor per buffer for the transfer agent: the
  attention layer's view where a buffer has one, else a view of the same shape
  over a state-only buffer (a block is a page of bytes either way);
- :data:`NULL_BLOCK_ID`: the block vLLM puts where a group keeps nothing.

Only attributes and class names of vLLM's objects are read (no vLLM import):
``facts.py`` and this module load without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvbridge.errors import ConfigError
from kvbridge.topology import CacheGroup

__all__ = ["NULL_BLOCK_ID", "cache_groups", "has_state", "registered_caches"]

#: vLLM's ``BlockPool.null_block`` is the first block it makes: id 0, never a request's own.
NULL_BLOCK_ID = 0

_HINT = ("start vLLM with --disable-hybrid-kv-cache-manager (one group: every "
         "layer keeps every block)")


def cache_groups(kv_cache_config: Any, block_size: int) -> tuple[CacheGroup, ...]:
    """The transfer groups of a ``vllm.v1.kv_cache_interface.KVCacheConfig``, in order.

    With the hybrid manager off, vLLM turns sliding-window layers into full
    attention (every block kept): one ``tokens`` group.

    Args:
        kv_cache_config: vLLM's KV cache config.
        block_size: the engine's block size (every group's must equal it).

    Raises:
        ConfigError: a group kvbridge cannot move (e.g. chunked local
            attention, speculative Mamba blocks) or of another block size.
    """
    return tuple(_cache_group(index, group, block_size)
                 for index, group in enumerate(kv_cache_config.transfer_groups))


def _cache_group(index: int, group: Any, block_size: int) -> CacheGroup:
    spec = group.kv_cache_spec
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":  # layers of one kind, several shapes
        spec = spec.first_spec
    names = [cls.__name__ for cls in type(spec).__mro__]
    where = f"KV cache group {index} ({type(spec).__name__}, layers {group.layer_names[:3]})"
    if getattr(spec, "block_size", block_size) != block_size:
        raise ConfigError(f"{where} has block size {spec.block_size}, the engine "
                          f"{block_size}: kvbridge moves groups of one block size")
    if "MambaSpec" in names:
        if getattr(spec, "num_speculative_blocks", 0):
            raise ConfigError(f"{where} keeps {spec.num_speculative_blocks} speculative state "
                              f"blocks: kvbridge moves a Mamba / linear-attention state "
                              f"without speculative decoding (drop --speculative-config)")
        return CacheGroup("state", label=f"{type(spec).__name__} state")
    if "SlidingWindowSpec" in names and "SlidingWindowMLASpec" not in names:
        return CacheGroup("window", window=int(spec.sliding_window),
                          label=f"sliding window {spec.sliding_window}")
    if "FullAttentionSpec" in names:  # its manager keeps every block, window or not
        return CacheGroup("tokens", label="full attention")
    raise ConfigError(f"{where}: kvbridge moves full-attention, sliding-window and Mamba / "
                      f"linear-attention groups; for this one, {_HINT}")


def has_state(groups: Sequence[CacheGroup] | None) -> bool:
    """Whether a group holds a recurrent state (Mamba, linear attention)."""
    return any(group.kind == "state" for group in groups or ())


def registered_caches(kv_caches: Mapping[str, Any]) -> list[torch.Tensor]:
    """One tensor per cache buffer, in layer order, for the transfer agent.

    ``kv_caches`` maps each layer to its view: attention layers a contiguous
    tensor (``[blocks, heads, block_size, K+V]`` on CPU); Mamba / linear
    attention layers a strided byte view or a list of state views. Layers of
    different groups share buffers: a buffer whose attention view is known
    is registered once through it; a buffer only states live in gets a view
    of the attention layers' shape over its bytes, so that a block moves as
    one page whichever group it belongs to.

    Raises:
        ConfigError: no attention layer to take a block's shape from, or a
            state buffer that does not hold whole pages of that shape.
    """
    attention: list[torch.Tensor] = []
    states: list[torch.Tensor] = []
    seen: set[int] = set()
    for value in kv_caches.values():
        if isinstance(value, torch.Tensor) and value.is_contiguous():
            if value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                attention.append(value)
        else:
            views = [value] if isinstance(value, torch.Tensor) else list(value)
            states.extend(v for v in views if isinstance(v, torch.Tensor))
    if not states:
        return attention
    if not attention:
        raise ConfigError("vLLM registered no attention KV cache: kvbridge moves models "
                          "with attention layers (a pure Mamba model is not supported)")
    template = attention[0]
    nbytes = template.numel() * template.element_size()
    extra: dict[int, torch.Tensor] = {}
    for state in states:
        start = state.data_ptr()
        covered = any(t.data_ptr() <= start < t.data_ptr() + nbytes for t in attention)
        if covered or start in extra:
            continue
        storage = state.untyped_storage()
        offset = start - storage.data_ptr()
        if offset % template.element_size() or storage.nbytes() - offset < nbytes:
            raise ConfigError(
                f"a Mamba / linear-attention cache buffer ({storage.nbytes()} bytes from "
                f"offset {offset}) does not hold {template.shape[0]} pages of the attention "
                f"layers' {nbytes // template.shape[0]} bytes: kvbridge cannot move this "
                f"model's states")
        view = torch.empty(0, dtype=template.dtype, device=template.device)
        view.set_(storage, offset // template.element_size(), template.shape, template.stride())
        extra[start] = view
    return attention + list(extra.values())
