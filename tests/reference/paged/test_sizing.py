"""Tests for kvbridge.reference.paged.sizing: grouping, sizing, memory checks, unification."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ConfigError
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig, UniformTypeSpecs
from kvbridge.reference.paged.sizing import (
    RequestLimits,
    as_full_attention,
    check_enough_memory,
    estimate_max_model_len,
    get_kv_cache_config,
    get_max_concurrency,
    group_layers,
    max_num_blocks_per_request,
    max_request_nbytes,
    unify_kv_cache_configs,
)
from kvbridge.reference.paged.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    SpecMismatchError,
    UnsupportedSpecError,
)

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
SLIDE = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16,
                          sliding_window=128)
PAGE = FULL.page_size_bytes
LIMITS = RequestLimits(max_model_len=1024, max_num_batched_tokens=256)


def full_model(num_layers: int, spec: KVCacheSpec = FULL) -> dict[str, KVCacheSpec]:
    return {f"layers.{i}.attn": spec for i in range(num_layers)}


def hybrid(num_full: int, num_sliding: int) -> dict[str, KVCacheSpec]:
    # Interleaved like real hybrid models: one full layer every few sliding ones.
    names = [(f"layers.{i}", FULL if i < num_full else SLIDE)
             for i in range(num_full + num_sliding)]
    return dict(names)


def check_config(config: KVCacheConfig, specs: dict[str, KVCacheSpec],
                 available_nbytes: int | None) -> None:
    """Invariants every sized config must satisfy."""
    cached = {n for n, s in specs.items() if not isinstance(s, EncoderOnlyAttentionSpec)}
    grouped = [n for g in config.kv_cache_groups for n in g.layer_names]
    backed = [n for t in config.kv_cache_tensors for n in t.shared_by]
    assert sorted(grouped) == sorted(cached)
    assert sorted(backed) == sorted(cached)
    for tensor in config.kv_cache_tensors:
        pages = {specs[n].page_size_bytes for n in tensor.shared_by}
        assert tensor.size == max(pages) * config.num_blocks
    if available_nbytes is not None:
        assert sum(t.size for t in config.kv_cache_tensors) <= available_nbytes


def test_uniform_model_gets_one_tensor_per_layer() -> None:
    specs = full_model(4)
    available = 4 * PAGE * 500 + PAGE  # a bit more than 500 blocks' worth
    config = get_kv_cache_config(specs, available, LIMITS)
    assert config.num_blocks == 500
    assert len(config.kv_cache_groups) == 1
    assert config.kv_cache_groups[0].kv_cache_spec == FULL
    assert [t.shared_by for t in config.kv_cache_tensors] == [(n,) for n in specs]
    check_config(config, specs, available)


def test_full_attention_with_different_head_counts_is_one_uniform_group() -> None:
    wide = FullAttentionSpec(16, 8, 64, torch.float16)
    specs: dict[str, KVCacheSpec] = {"a": FULL, "b": wide, "c": FULL}
    available = 10 * PAGE * 100
    config = get_kv_cache_config(specs, available, LIMITS)
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeSpecs)
    assert config.num_blocks == available // (2 * PAGE + wide.page_size_bytes)
    check_config(config, specs, available)


def test_hybrid_equal_counts_share_tensors_across_groups() -> None:
    specs = hybrid(3, 3)
    available = 3 * PAGE * 400
    config = get_kv_cache_config(specs, available, LIMITS)
    assert [g.kv_cache_spec for g in config.kv_cache_groups] == [FULL, SLIDE]
    assert config.num_blocks == 400
    assert [t.shared_by for t in config.kv_cache_tensors] == [
        ("layers.0", "layers.3"), ("layers.1", "layers.4"), ("layers.2", "layers.5")]
    check_config(config, specs, available)


def test_hybrid_few_full_layers_splits_sliding_layers_into_groups() -> None:
    # 2 full + 7 sliding: group size 2, sliding layers in groups of 2, 2, 2, 1.
    specs = hybrid(2, 7)
    config = get_kv_cache_config(specs, 2 * PAGE * 300, LIMITS)
    sizes = [len(g.layer_names) for g in config.kv_cache_groups]
    assert sizes == [2, 2, 2, 2, 1]
    assert len(config.kv_cache_tensors) == 2
    assert config.num_blocks == 300
    check_config(config, specs, 2 * PAGE * 300)


def test_hybrid_close_counts_pad_to_the_larger_group() -> None:
    # 5 full + 6 sliding are within 25%: one group each, 6 tensors.
    specs = hybrid(5, 6)
    config = get_kv_cache_config(specs, 6 * PAGE * 200, LIMITS)
    assert [len(g.layer_names) for g in config.kv_cache_groups] == [5, 6]
    assert config.kv_cache_tensors[-1].shared_by == ("layers.10",)
    check_config(config, specs, 6 * PAGE * 200)


@settings(max_examples=40, deadline=None)
@given(num_full=st.integers(0, 12), num_sliding=st.integers(0, 12),
       num_encoder=st.integers(0, 3), num_pages=st.integers(200, 5000))
def test_grouping_invariants(num_full: int, num_sliding: int, num_encoder: int,
                             num_pages: int) -> None:
    specs = hybrid(num_full, num_sliding)
    encoder = EncoderOnlyAttentionSpec(16, 2, 64, torch.float16)
    specs.update({f"enc.{i}": encoder for i in range(num_encoder)})
    available = num_pages * PAGE * max(num_full, num_sliding, 1)
    config = get_kv_cache_config(specs, available, LIMITS)
    check_config(config, specs, available)
    if config.kv_cache_groups:
        group_size = max(len(g.layer_names) for g in config.kv_cache_groups)
        assert config.num_blocks == available // (group_size * PAGE)
    for group in config.kv_cache_groups:
        assert {specs[n] for n in group.layer_names} == {group.kv_cache_spec}


def test_mamba_hybrid_with_padded_page_groups_with_attention() -> None:
    mamba = MambaSpec(16, ((4, 16),), (torch.float32,), page_size_padded=PAGE)
    specs: dict[str, KVCacheSpec] = {"attn.0": FULL, "mamba.0": mamba, "mamba.1": mamba,
                                     "attn.1": FULL}
    config = get_kv_cache_config(specs, 2 * PAGE * 100, LIMITS)
    assert len(config.kv_cache_groups) == 2
    check_config(config, specs, 2 * PAGE * 100)
    unpadded = MambaSpec(16, ((4, 16),), (torch.float32,))
    with pytest.raises(SpecMismatchError, match="page sizes"):
        group_layers({"attn.0": FULL, "mamba.0": unpadded})


def test_encoder_only_model_has_no_cache() -> None:
    encoder = EncoderOnlyAttentionSpec(16, 2, 64, torch.float16)
    specs: dict[str, KVCacheSpec] = {"enc.0": encoder, "enc.1": encoder}
    config = get_kv_cache_config(specs, 0, LIMITS)
    assert config == KVCacheConfig(1, (), ())
    assert max_request_nbytes(specs, LIMITS) == 0
    check_enough_memory(specs, 0, LIMITS)  # nothing to hold: no error
    assert get_max_concurrency(config, LIMITS) == math.inf


def test_unknown_spec_types_raise() -> None:
    with pytest.raises(UnsupportedSpecError, match="str"):
        group_layers({"a": "full"})  # type: ignore[dict-item]


def test_worst_case_request_bytes_sum_layers() -> None:
    chunked = ChunkedLocalAttentionSpec(16, 2, 64, torch.float16, attention_chunk_size=64)
    cross = CrossAttentionSpec(16, 2, 64, torch.float16)
    specs: dict[str, KVCacheSpec] = {"f": FULL, "s": SLIDE, "c": chunked, "x": cross}
    limits = RequestLimits(1024, 256, max_num_encoder_tokens=1500)
    expected = PAGE * (math.ceil(1024 / 16) + math.ceil((128 - 1 + 256) / 16) + 1
                       + math.ceil((64 + 256) / 16) + math.ceil(1500 / 16))
    assert max_request_nbytes(specs, limits) == expected


def test_not_enough_memory_message_has_numbers_and_fitting_length() -> None:
    specs = full_model(4)
    needed = 4 * math.ceil(1024 / 16) * PAGE
    available = needed // 3
    with pytest.raises(ConfigError) as info:
        check_enough_memory(specs, available, LIMITS)
    fitting = max(n for n in range(1, 1025)
                  if max_request_nbytes(specs, RequestLimits(n, 256)) <= available)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for number in (needed, available, 1024, fitting):
        assert str(number) in message
    assert f"largest max_model_len that fits is {fitting}" in message
    with pytest.raises(ConfigError, match="largest max_model_len"):
        get_kv_cache_config(specs, available, LIMITS)
    with pytest.raises(ConfigError, match="available_nbytes=0"):
        check_enough_memory(specs, 0, LIMITS)


@settings(max_examples=30, deadline=None)
@given(num_layers=st.integers(1, 4), window=st.integers(1, 100),
       max_model_len=st.integers(1, 400), available_pages=st.integers(0, 80))
def test_estimate_max_model_len_matches_linear_scan(
        num_layers: int, window: int, max_model_len: int, available_pages: int) -> None:
    slide = SlidingWindowSpec(8, 1, 4, torch.float32, sliding_window=window)
    full = FullAttentionSpec(8, 1, 4, torch.float32)
    specs: dict[str, KVCacheSpec] = {**{f"f{i}": full for i in range(num_layers)}, "s": slide}
    limits = RequestLimits(max_model_len, 16)
    available = available_pages * full.page_size_bytes
    fits = [n for n in range(1, max_model_len + 1)
            if max_request_nbytes(specs, RequestLimits(n, 16)) <= available]
    assert estimate_max_model_len(specs, available, limits) == max(fits, default=0)


def test_override_sets_num_blocks() -> None:
    specs = hybrid(2, 2)
    config = get_kv_cache_config(specs, 2 * PAGE * 1000, LIMITS, num_blocks_override=177)
    assert config.num_blocks == 177
    check_config(config, specs, None)
    with pytest.raises(ConfigError, match="num_blocks_override must be > 0, got 0"):
        get_kv_cache_config(specs, 2 * PAGE * 1000, LIMITS, num_blocks_override=0)
    # One block more than a request's worst case: block 0 is the pool's null block.
    needed = max_num_blocks_per_request(group_layers(specs), LIMITS) + 1
    with pytest.raises(ConfigError, match=f"needs {needed} blocks"):
        get_kv_cache_config(specs, 2 * PAGE * 1000, LIMITS, num_blocks_override=needed - 1)
    assert get_kv_cache_config(specs, 2 * PAGE * 1000, LIMITS,
                               num_blocks_override=needed).num_blocks == needed


def test_max_concurrency() -> None:
    specs = full_model(2)
    config = get_kv_cache_config(specs, 2 * PAGE * 640, LIMITS)
    assert get_max_concurrency(config, LIMITS) == 640 / math.ceil(1024 / 16)


def test_unify_takes_smallest_num_blocks() -> None:
    specs = hybrid(2, 2)
    configs = [get_kv_cache_config(specs, 2 * PAGE * n, LIMITS) for n in (500, 300, 800)]
    unified = unify_kv_cache_configs(configs)
    assert [c.num_blocks for c in unified] == [300, 300, 300]
    for config in unified:
        check_config(config, specs, 2 * PAGE * 300)
    assert [c.num_blocks for c in configs] == [500, 300, 800]  # inputs untouched


def test_unify_rejects_different_groups_and_empty() -> None:
    a = get_kv_cache_config(hybrid(2, 2), 2 * PAGE * 500, LIMITS)
    b = get_kv_cache_config(full_model(4), 4 * PAGE * 500, LIMITS)
    with pytest.raises(ConfigError, match="worker 1"):
        unify_kv_cache_configs([a, b])
    with pytest.raises(ConfigError):
        unify_kv_cache_configs([])


def test_as_full_attention_records_windows() -> None:
    chunked = ChunkedLocalAttentionSpec(16, 2, 64, torch.float16, attention_chunk_size=32)
    converted = as_full_attention({"f": FULL, "s": SLIDE})
    assert converted["s"] == FullAttentionSpec(16, 2, 64, torch.float16, sliding_window=128)
    assert as_full_attention({"f": FULL, "c": chunked})["c"] == FullAttentionSpec(
        16, 2, 64, torch.float16, attention_chunk_size=32)
    # Now one merged group covers every layer.
    (group,) = group_layers(converted)
    assert group.kv_cache_spec == FullAttentionSpec(16, 2, 64, torch.float16,
                                                    sliding_window=128)
    assert as_full_attention({"s": SLIDE}) == {"s": SLIDE}


def test_request_limits_validate() -> None:
    with pytest.raises(ConfigError, match="dcp_world_size must be > 0, got 0"):
        RequestLimits(10, 10, dcp_world_size=0)
    with pytest.raises(ConfigError, match="max_model_len must be > 0, got -1"):
        RequestLimits(-1, 10)
