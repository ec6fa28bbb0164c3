"""SGLang's KV pool as kvbridge's transfer agent takes it: planes, topology, compat.

SGLang hands a transfer backend addresses, not tensors (``KVArgs.kv_data_ptrs``,
``kv_data_lens``, ``kv_item_lens``: one entry per buffer, one page's bytes per
item). For an MHA pool the buffers are every layer's K, then every layer's V,
each ``[pages * page_size, heads, head_dim]`` token-major; an MLA pool has one
latent buffer per layer, ``[pages * page_size, 1, latent_dim]``. The tensors are
looked up by their addresses among the scheduler's live tensors (their dtype
is needed, and SGLang's ``kv_cache_dtype_str`` may say just ``"auto"``), then
viewed page by page::

    MHA, L layers:  buffers  K0 K1 .. K(L-1) V0 V1 .. V(L-1)
                    planes   K0 V0 K1 V1 .. (kvbridge's split_kv order), each
                             [pages, page_size, heads, head_dim]  (NHD)
    MLA, L layers:  planes   [pages, page_size, latent_dim]

What kvbridge cannot move yet is refused here with the setting to change:
extra state (``state_types``: mamba, SWA, DSA ...), speculative draft pools,
layouts other than token-major.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.protocol.security import CompatInfo

__all__ = ["SglangCaches", "find_tensors", "sglang_caches"]

TensorFinder = Callable[[Sequence[int], Sequence[int]], list[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class SglangCaches:
    """What a rank's transfer agent registers and advertises."""

    planes: list[torch.Tensor]
    topology: EngineTopology
    compat: CompatInfo
    num_pages: int


def find_tensors(pointers: Sequence[int], nbytes: Sequence[int]) -> list[torch.Tensor]:
    """The live tensors that start at ``pointers`` and hold at least ``nbytes`` each.

    Raises:
        ConfigError: some address is not the start of a contiguous live tensor.
    """
    wanted = {ptr: n for ptr, n in zip(pointers, nbytes, strict=True)}
    found: dict[int, torch.Tensor] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            ptr = obj.data_ptr()
        except RuntimeError:  # tensors without storage (meta, sparse)
            continue
        need = wanted.get(ptr)
        if need is None or not obj.is_contiguous() or obj.numel() * obj.element_size() < need:
            continue
        best = found.get(ptr)  # the buffer itself: not a flat arena holding it (3-D first)
        if best is None or (obj.dim() == 3, -obj.numel()) > (best.dim() == 3, -best.numel()):
            found[ptr] = obj
    missing = [hex(p) for p in pointers if p not in found]
    if missing:
        raise ConfigError(
            f"kvbridge found no contiguous tensor at {len(missing)} of SGLang's KV buffer "
            f"addresses ({', '.join(missing[:4])}...): this KV pool is not one kvbridge "
            f"can register; use another --disaggregation-transfer-backend")
    return [found[p] for p in pointers]


def _refuse_extras(kv_args: Any, model_id: str) -> None:
    state_types = list(getattr(kv_args, "state_types", None) or [])
    if state_types:
        names = ", ".join(str(getattr(s, "value", s)) for s in state_types)
        raise ConfigError(
            f"model {model_id!r} keeps per-request state besides its KV pages ({names}); "
            f"the kvbridge backend moves KV pages only and would decode from stale state: "
            f"serve this model with --disaggregation-transfer-backend mooncake or nixl")
    if int(getattr(kv_args, "num_draft_entries", 0) or 0):
        raise ConfigError(
            f"model {model_id!r} runs a speculative draft model whose KV the kvbridge backend "
            f"does not move yet: drop --speculative-algorithm on P and D, or use another "
            f"--disaggregation-transfer-backend")
    layout = getattr(kv_args, "kv_layout", None)
    if layout not in (None, "NHD", "nhd"):
        raise ConfigError(f"SGLang KV layout {layout!r}: the kvbridge backend moves token-major "
                          f"(NHD) pools only")


def sglang_caches(
    kv_args: Any,
    *,
    is_mla: bool,
    attn_tp_size: int,
    model_id: str,
    find: TensorFinder = find_tensors,
) -> SglangCaches:
    """Planes, topology and compat of one rank's pool, from its ``KVArgs``.

    Args:
        kv_args: SGLang's ``KVArgs`` of this rank.
        is_mla: SGLang's ``is_mla_backend``.
        attn_tp_size: the attention TP size (heads split over it).
        model_id: what P and D must both serve (hashed into the handshake).
        find: tensors at the buffers' addresses (tests pass their own).

    Raises:
        ConfigError: a pool kvbridge cannot move, named with what to change.
    """
    _refuse_extras(kv_args, model_id)
    pointers = list(kv_args.kv_data_ptrs)
    nbytes = list(kv_args.kv_data_lens)
    item_lens = list(kv_args.kv_item_lens)
    page_size = int(kv_args.page_size)
    if not pointers or len(set(item_lens)) != 1 or len(nbytes) != len(pointers):
        raise ConfigError(f"SGLang KV buffers: {len(pointers)} addresses, item sizes "
                          f"{sorted(set(item_lens))[:4]}: expected one page size for all")
    item_nbytes = item_lens[0]
    num_pages = min(nbytes) // item_nbytes
    tensors = find(pointers, [num_pages * item_nbytes] * len(pointers))
    first = tensors[0]
    if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in tensors):
        shapes = sorted({(str(t.dtype), tuple(t.shape)) for t in tensors})
        raise ConfigError(f"SGLang KV buffers differ in dtype or row shape: {shapes[:4]}")
    rows = num_pages * page_size
    if first.dim() != 3 or first.shape[0] < rows:
        raise ConfigError(f"SGLang KV buffer of shape {tuple(first.shape)}: expected "
                          f"[>= {rows} tokens, heads, head_dim]")
    _, heads, head_dim = (int(d) for d in first.shape)
    if page_size * heads * head_dim * first.element_size() != item_nbytes:
        raise ConfigError(f"SGLang page of {item_nbytes} bytes != {page_size} tokens x "
                          f"{heads} heads x {head_dim} x {first.element_size()} bytes")
    if is_mla:
        if heads != 1:
            raise ConfigError(f"an MLA buffer holds one latent per token, got shape "
                              f"{tuple(first.shape)} ({heads} heads)")
        planes = [t[:rows].view(num_pages, page_size, head_dim) for t in tensors]
        num_kv_heads, num_layers = 1, len(planes)
    else:
        if len(tensors) % 2:
            raise ConfigError(f"{len(tensors)} MHA buffers: expected K and V of each layer")
        num_layers = len(tensors) // 2
        ks, vs = tensors[:num_layers], tensors[num_layers:]
        planes = [t[:rows].view(num_pages, page_size, heads, head_dim)
                  for pair in zip(ks, vs, strict=True) for t in pair]
        num_kv_heads = int(getattr(kv_args, "total_kv_head_num", 0) or heads * attn_tp_size)
        num_layers *= 2
    topology = EngineTopology(
        tp_size=attn_tp_size, pp_size=1, block_size=page_size, num_kv_heads=num_kv_heads,
        is_mla=is_mla, layout=KVLayout.NHD, num_layers=num_layers, split_kv=not is_mla,
    )
    if topology.num_heads_per_rank != (1 if is_mla else heads):
        raise ConfigError(f"this rank holds {heads} KV heads; {num_kv_heads} heads over "
                          f"attention TP {attn_tp_size} would be {topology.num_heads_per_rank}")
    compat = CompatInfo(
        model=model_id, dtype=str(first.dtype), num_kv_heads=num_kv_heads, head_dim=head_dim,
        num_layers=num_layers, layout=KVLayout.NHD, block_size=page_size, is_mla=is_mla,
        split_kv=not is_mla,
    )
    return SglangCaches(planes, topology, compat, num_pages)
