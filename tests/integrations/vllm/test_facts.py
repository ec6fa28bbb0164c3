"""vLLM's cache tensors as kvbridge takes or refuses them (no vLLM process needed).

Shapes and strides as vLLM 0.32's CPU build hands them to ``register_kv_caches``:
a dense layer ``[blocks, heads, block_size, 2 * head_size]`` (LBHNC), an MLA
layer ``[blocks, 1, 16, 576]``. A refusal names the shape, the layout and
what to change, and gives no advice that would not help.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.facts import EngineFacts, cache_topology, latent_views

DENSE = EngineFacts(engine_id="e", role="both", tp_size=1, pp_size=1, block_size=32,
                    num_kv_heads=2, head_size=16, num_layers=2, is_mla=False, model_id="m")
MLA = dataclasses.replace(DENSE, block_size=16, num_kv_heads=1, head_size=576, is_mla=True,
                          num_layers=3)


def vllm_layers(shape: tuple[int, ...], num_layers: int,
                dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per-layer views of one buffer, as vLLM allocates them (layers outermost)."""
    return list(torch.zeros((num_layers, *shape), dtype=dtype).unbind(0))


def test_vllm_cpu_mla_cache_moves_as_one_latent_per_token() -> None:
    layers = latent_views(MLA, vllm_layers((10, 1, 16, 576), 3))
    assert [tuple(t.shape) for t in layers] == [(10, 16, 576)] * 3
    topology, compat = cache_topology(MLA, layers)
    assert topology.is_mla and topology.num_kv_heads == 1 and not topology.fused_kv
    assert (compat.is_mla, compat.head_dim, compat.dtype) == (True, 576, "float32")
    # a GPU backend's [blocks, block_size, latent] is taken as it is
    assert cache_topology(MLA, vllm_layers((10, 16, 576), 3))[0].is_mla


def test_a_dense_cache_in_another_layout_is_refused_naming_it() -> None:
    lbnhc = [t.transpose(1, 2) for t in vllm_layers((10, 32, 2, 32), 2)]  # tokens outer
    with pytest.raises(ConfigError) as caught:
        cache_topology(DENSE, lbnhc)
    message = str(caught.value)
    assert "(10, 2, 32, 32)" in message and "layout LBNHC" in message
    assert "[blocks, 2 heads, block_size 32, K+V]" in message and "LBHNC" in message


def test_an_mla_cache_of_another_shape_is_refused_without_layout_advice() -> None:
    with pytest.raises(ConfigError) as caught:
        cache_topology(MLA, latent_views(MLA, vllm_layers((10, 2, 16, 288), 3)))
    message = str(caught.value)
    assert "vLLM MLA cache (10, 2, 16, 288)" in message
    assert "VLLM_KV_CACHE_LAYOUT" not in message  # an MLA cache has no heads to lay out


def test_layers_of_different_dtypes_are_refused_naming_the_setting() -> None:
    fp8 = dataclasses.replace(DENSE, cache_dtype="fp8")
    layers = [torch.zeros((10, 2, 32, 32), dtype=torch.uint8),
              torch.zeros((10, 2, 32, 32), dtype=torch.bfloat16)]
    with pytest.raises(ConfigError, match="layer 1 is .*bfloat16.*kv_cache_dtype_skip_layers"):
        cache_topology(fp8, layers)


def test_a_quantized_cache_is_named_by_vllms_cache_dtype() -> None:
    layers = vllm_layers((10, 2, 32, 32), 2, torch.uint8)
    names = [cache_topology(dataclasses.replace(DENSE, cache_dtype=name), layers)[1].dtype
             for name in ("fp8", "fp8_e4m3", "fp8_e5m2")]
    # vLLM stores all three as uint8: the tensor's dtype alone would pair e4m3 with e5m2
    assert names == ["fp8_e4m3 (uint8)", "fp8_e4m3 (uint8)", "fp8_e5m2 (uint8)"]
    assert cache_topology(DENSE, vllm_layers((10, 2, 32, 32), 2))[1].dtype == "float32"
