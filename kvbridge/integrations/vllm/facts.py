"""What kvbridge needs to know about a vLLM engine, read from its ``VllmConfig``.

Both connector halves call :func:`engine_facts`; the worker half adds what only
its cache tensors tell (:func:`cache_topology`). vLLM hands a connector one
tensor per attention layer, all views of one buffer::

    vLLM's KV cache layout          tensor per layer                    kvbridge topology
    LBHNC (CPU; "HND" on GPU)       [num_blocks, heads, block_size, C]   HND, fused_kv
    MLA                             [num_blocks, block_size, latent]     is_mla

where ``C`` holds a head's K and V of one token slot side by side (on CPU,
K of the whole block is stored transposed: only whole heads of whole blocks
keep their meaning, so kvbridge moves them as they are and refuses to change
block size or layout between such caches). This module does not import vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvbridge.connector.scheduler import Role
from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.protocol.security import CompatInfo

__all__ = [
    "EngineFacts", "cache_topology", "engine_facts", "latent_views", "unique_layer_caches",
]

_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """One vLLM engine as kvbridge sees it (same on the scheduler and every worker).

    Attributes:
        engine_id: ``kv_transfer_config.engine_id`` (vLLM makes one up if unset).
        role: kvbridge's role for ``kv_role``.
        tp_size: tensor-parallel size.
        pp_size: pipeline-parallel size.
        block_size: tokens per block of vLLM's cache manager.
        num_kv_heads: KV heads of the whole model (1 for MLA).
        head_size: elements per head per token of K (the latent for MLA).
        num_layers: attention layers of the whole model.
        is_mla: the model keeps one MLA latent per token.
        model_id: what P and D must share (see ``VllmSettings.model_id``).
        kv_bytes_per_token: KV bytes one worker holds per token (its layers
            and heads), an estimate from the cache dtype.
        cache_dtype: vLLM's ``--kv-cache-dtype`` ("auto": the model's dtype).
    """

    engine_id: str
    role: Role
    tp_size: int
    pp_size: int
    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    is_mla: bool
    model_id: str
    kv_bytes_per_token: int = 0
    cache_dtype: str = "auto"

    def topology(self, *, fused_kv: bool) -> EngineTopology:
        """The engine's topology (``fused_kv``: caches in vLLM's LBHNC layout)."""
        return EngineTopology(
            tp_size=self.tp_size, pp_size=self.pp_size, block_size=self.block_size,
            num_kv_heads=1 if self.is_mla else self.num_kv_heads, is_mla=self.is_mla,
            layout=KVLayout.HND, num_layers=self.num_layers, fused_kv=fused_kv,
        )


def engine_facts(vllm_config: Any, model_id: str | None = None) -> EngineFacts:
    """Read the engine's facts from a ``vllm.config.VllmConfig``.

    Raises:
        ConfigError: no kv_transfer_config, or a role kvbridge does not know.
    """
    kv_config = vllm_config.kv_transfer_config
    if kv_config is None:
        raise ConfigError(
            "vLLM config has no kv_transfer_config: start vLLM with --kv-transfer-config "
            "'{\"kv_connector\":\"KVBridgeConnector\",\"kv_connector_module_path\":"
            "\"kvbridge.integrations.vllm\",\"kv_role\":\"kv_both\"}'")
    role = _ROLES.get(kv_config.kv_role)
    if role is None:
        raise ConfigError(f"kv_role must be one of {sorted(_ROLES)}, got {kv_config.kv_role!r}")
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    is_mla = bool(model.use_mla)
    num_kv_heads, head_size = model.get_total_num_kv_heads(), model.get_head_size()
    num_layers = model.get_total_num_hidden_layers()
    heads_per_worker = 1 if is_mla else max(1, num_kv_heads // tp_size)
    planes = 1 if is_mla else 2
    return EngineFacts(
        engine_id=str(kv_config.engine_id), role=role, tp_size=tp_size, pp_size=pp_size,
        block_size=vllm_config.cache_config.block_size, num_kv_heads=num_kv_heads,
        head_size=head_size, num_layers=num_layers, is_mla=is_mla,
        model_id=model_id or _model_identity(model),
        kv_bytes_per_token=(-(-num_layers // pp_size) * planes * heads_per_worker * head_size
                            * _cache_itemsize(vllm_config)),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
    )


def _cache_itemsize(vllm_config: Any) -> int:
    """Bytes per KV cache element: the model's dtype unless the cache is quantized."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto":
        dtype = vllm_config.model_config.dtype
        return dtype.itemsize if isinstance(dtype, torch.dtype) else 2
    return 1 if "8" in cache_dtype else 2  # fp8 variants, int8; else 16-bit


def _model_identity(model: Any) -> str:
    """The model's name (no directories: P and D may keep it in different places) and shape."""
    text = model.hf_text_config
    name = os.path.basename(str(model.model).rstrip("/"))
    shape = [getattr(text, key, None) for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size")]
    architectures = ",".join(getattr(model.hf_config, "architectures", None) or ())
    return f"{name}@{model.revision or ''}:{architectures}:{shape}"


def unique_layer_caches(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's per-layer cache views in order, each storage once.

    Layers that share their KV with another layer appear under both names,
    pointing at one tensor: it is registered once.
    """
    seen: set[int] = set()
    layers = []
    for tensor in kv_caches.values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            layers.append(tensor)
    return layers


def latent_views(facts: EngineFacts, layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's MLA caches as kvbridge moves them: ``[num_blocks, block_size, latent]``.

    vLLM keeps an MLA layer as ``[num_blocks, 1, block_size, latent]`` (one
    "head" holding the latent, in its ``[L, B, H, N, C]`` layout) on CPU and as
    ``[num_blocks, block_size, latent]`` elsewhere; both are the same memory.
    Other caches come back as they are.
    """
    if not facts.is_mla:
        return layers
    return [t.squeeze(1) if t.dim() == 4 and t.shape[1] == 1 else t for t in layers]


def cache_topology(
    facts: EngineFacts, layers: list[torch.Tensor]
) -> tuple[EngineTopology, CompatInfo]:
    """The topology and compatibility record of a worker holding ``layers``.

    Args:
        facts: the engine's facts.
        layers: the worker's caches, MLA ones as :func:`latent_views` gives them.

    Raises:
        ConfigError: no layers, or caches kvbridge cannot move; the message
            names the shape, the layout and what to change.
    """
    if not layers:
        raise ConfigError("vLLM registered no KV cache tensors (an attention-free model, or "
                          "a cache kvbridge cannot see): nothing to move; run it without "
                          "--kv-transfer-config")
    first = layers[0]
    _check_uniform(facts, layers)
    if facts.is_mla:
        _check_latent(facts, first)
    else:
        _check_fused(facts, first)
    fused = not facts.is_mla
    topology = facts.topology(fused_kv=fused)
    compat = CompatInfo(
        model=facts.model_id, dtype=_compat_dtype(facts, first),
        num_kv_heads=topology.num_kv_heads,
        head_dim=facts.head_size, num_layers=facts.num_layers, layout=topology.layout,
        block_size=facts.block_size, is_mla=facts.is_mla, fused_kv=fused,
    )
    return topology, compat


def _compat_dtype(facts: EngineFacts, first: torch.Tensor) -> str:
    """What P and D must agree on about the cache's bytes.

    vLLM keeps every fp8 cache as ``uint8`` tensors: the tensor's dtype alone
    would let an ``fp8_e4m3`` P pair with an ``fp8_e5m2`` D. A quantized
    cache is named by vLLM's ``--kv-cache-dtype`` ("fp8" is "fp8_e4m3") and the
    tensor dtype; its scales are the model's (per layer, from the checkpoint,
    the same on P and D), so the bytes move as they are.
    """
    dtype = str(first.dtype).removeprefix("torch.")
    if facts.cache_dtype == "auto":
        return dtype
    name = "fp8_e4m3" if facts.cache_dtype == "fp8" else facts.cache_dtype
    return f"{name} ({dtype})"


def _check_uniform(facts: EngineFacts, layers: list[torch.Tensor]) -> None:
    """Every layer alike: kvbridge moves all layers of a block with one plan."""
    first = layers[0]
    for index, layer in enumerate(layers):
        if layer.shape != first.shape or layer.dtype != first.dtype:
            raise ConfigError(
                f"vLLM KV cache of layer {index} is {tuple(layer.shape)} {layer.dtype}, layer 0 "
                f"{tuple(first.shape)} {first.dtype}: kvbridge moves caches whose layers all "
                f"have one shape and dtype (cache dtype {facts.cache_dtype!r}; "
                f"kv_cache_dtype_skip_layers mixes dtypes: leave it empty)"
            )


def _check_latent(facts: EngineFacts, first: torch.Tensor) -> None:
    if first.dim() != 3 or not first.is_contiguous() or first.shape[1] != facts.block_size:
        raise ConfigError(
            f"vLLM MLA cache {tuple(first.shape)} strides {first.stride()}: kvbridge moves MLA "
            f"caches as contiguous [blocks, block_size {facts.block_size}, latent] (or "
            f"[blocks, 1, block_size, latent]), one latent per token; this attention "
            f"backend's cache is neither. Use one that keeps such a cache (vLLM's CPU_MLA on "
            f"CPU; its dense MLA backends on GPU): sparse or compressed MLA caches "
            f"(DeepSeek-V3.2/V4 indexers) cannot be moved"
        )


def _check_fused(facts: EngineFacts, first: torch.Tensor) -> None:
    heads = max(1, facts.num_kv_heads // facts.tp_size)
    if (first.dim() == 4 and first.is_contiguous() and first.shape[1] == heads
            and first.shape[2] == facts.block_size):
        return
    tokens_outer = first.dim() == 4 and first.transpose(1, 2).is_contiguous()
    layout = "LBNHC" if tokens_outer else "not LBHNC"
    env = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    advice = (f"VLLM_KV_CACHE_LAYOUT={env} chose it: unset it or set it to LBHNC"
              if env not in (None, "", "LBHNC", "HND") else
              "kvbridge moves the caches of vLLM's CPU attention backend (CPU_ATTN) in the "
              "LBHNC layout it asks vLLM for; this cache comes from another backend or "
              "layout, which kvbridge cannot move")
    raise ConfigError(
        f"vLLM KV cache {tuple(first.shape)} strides {first.stride()} in layout {layout}: "
        f"kvbridge moves contiguous [blocks, {heads} heads, block_size {facts.block_size}, "
        f"K+V] caches (layout LBHNC); {advice}"
    )
