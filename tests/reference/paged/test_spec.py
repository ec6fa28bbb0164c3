"""Tests for kvbridge.reference.paged.spec: page sizes, worst cases, merging, records."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def kv_nbytes(block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's K and V, measured on a real tensor."""
    return torch.empty(2, block_size, num_kv_heads, head_size, dtype=dtype).nbytes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [
    lambda bs, h, d, t: FullAttentionSpec(bs, h, d, t),
    lambda bs, h, d, t: SlidingWindowSpec(bs, h, d, t, sliding_window=64),
    lambda bs, h, d, t: ChunkedLocalAttentionSpec(bs, h, d, t, attention_chunk_size=128),
    lambda bs, h, d, t: CrossAttentionSpec(bs, h, d, t),
])
def test_attention_page_size_is_k_and_v_of_one_block(make, dtype) -> None:  # type: ignore[no-untyped-def]
    spec = make(16, 3, 72, dtype)
    assert spec.page_size_bytes == kv_nbytes(16, 3, 72, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_page_size_has_one_latent_per_token(dtype: torch.dtype) -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=dtype)
    assert mla.page_size_bytes == torch.empty(16, 1, 576, dtype=dtype).nbytes
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=dtype)
    assert 2 * mla.page_size_bytes == full.page_size_bytes
    # Worst case is full attention's page count, with the smaller page.
    assert mla.max_memory_usage_bytes(1000, 64) * 2 == full.max_memory_usage_bytes(1000, 64)


def test_mamba_page_size_sums_states_and_respects_padding() -> None:
    shapes = ((3, 5), (7,))
    dtypes = (torch.float32, torch.bfloat16)
    raw = sum(torch.empty(s, dtype=d).nbytes for s, d in zip(shapes, dtypes, strict=True))
    spec = MambaSpec(block_size=8, shapes=shapes, dtypes=dtypes)
    assert spec.page_size_bytes == raw
    padded = MambaSpec(block_size=8, shapes=shapes, dtypes=dtypes, page_size_padded=raw + 100)
    assert padded.page_size_bytes == raw + 100
    assert padded.unpadded_page_size_bytes == raw
    # One state per request, whatever the length; speculative steps add pages.
    assert padded.max_memory_usage_bytes(100_000, 8192) == raw + 100
    spec3 = dataclasses.replace(spec, num_speculative_blocks=2)
    assert spec3.max_memory_usage_bytes(10, 10) == 3 * raw


def test_mamba_padding_smaller_than_state_raises() -> None:
    with pytest.raises(ConfigError, match=r"page_size_padded=10 .* 60"):
        MambaSpec(block_size=8, shapes=((15,),), dtypes=(torch.float32,), page_size_padded=10)
    with pytest.raises(ConfigError, match="2 shapes and 1 dtypes"):
        MambaSpec(block_size=8, shapes=((1,), (2,)), dtypes=(torch.float32,))
    with pytest.raises(ConfigError, match=r"\(4, 0\)"):
        MambaSpec(block_size=8, shapes=((4, 0),), dtypes=(torch.float32,))


@pytest.mark.parametrize("dcp", [1, 2, 3, 8])
@pytest.mark.parametrize("max_model_len", [1, 15, 16, 17, 1000])
def test_full_attention_worst_case(max_model_len: int, dcp: int) -> None:
    spec = FullAttentionSpec(16, 2, 64, torch.float16)
    tokens_per_rank = math.ceil(max_model_len / dcp)
    num_pages = math.ceil(tokens_per_rank / 16)
    assert spec.max_memory_usage_bytes(max_model_len, 4, dcp_world_size=dcp) == (
        num_pages * spec.page_size_bytes)


def _max_blocks_spanned(num_tokens: int, block_size: int) -> int:
    """Most blocks ``num_tokens`` consecutive tokens can touch, over every start offset."""
    return max((start + num_tokens - 1) // block_size - start // block_size + 1
               for start in range(block_size))


@settings(max_examples=80, deadline=None)
@given(block_size=st.integers(1, 32), window=st.integers(1, 300),
       batched=st.integers(1, 300), max_model_len=st.integers(1, 1000))
def test_sliding_window_worst_case_covers_every_alignment(
        block_size: int, window: int, batched: int, max_model_len: int) -> None:
    spec = SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=window)
    got = spec.max_memory_usage_bytes(max_model_len, batched)
    assert got % spec.page_size_bytes == 0
    num_tokens = min(window - 1 + batched, max_model_len)
    spanned = _max_blocks_spanned(num_tokens, block_size)
    # The bound is tight up to one page and never below what any alignment needs.
    assert spanned * spec.page_size_bytes <= got <= (spanned + 1) * spec.page_size_bytes


def test_sliding_window_example_and_dcp() -> None:
    spec = SlidingWindowSpec(4, 1, 1, torch.float32, sliding_window=4)
    # window 4, 2 new tokens -> 5 tokens held: 2 pages, +1 for alignment.
    assert spec.max_memory_usage_bytes(100, 2) == 3 * spec.page_size_bytes
    # Capped by max_model_len: 3 tokens -> 1 page + 1.
    assert spec.max_memory_usage_bytes(3, 2) == 2 * spec.page_size_bytes
    with pytest.raises(ConfigError, match="dcp_world_size=2"):
        spec.max_memory_usage_bytes(100, 2, dcp_world_size=2)


@pytest.mark.parametrize(("chunk", "batched", "max_model_len"),
                         [(64, 16, 10_000), (64, 16, 50), (8, 100, 1000), (128, 1, 129)])
def test_chunked_local_worst_case(chunk: int, batched: int, max_model_len: int) -> None:
    spec = ChunkedLocalAttentionSpec(16, 2, 32, torch.bfloat16, attention_chunk_size=chunk)
    num_tokens = min(chunk + batched, max_model_len)
    assert spec.max_memory_usage_bytes(max_model_len, batched) == (
        math.ceil(num_tokens / 16) * spec.page_size_bytes)


def test_cross_attention_worst_case_follows_encoder_length() -> None:
    spec = CrossAttentionSpec(16, 4, 64, torch.float16)
    page = spec.page_size_bytes
    got = spec.max_memory_usage_bytes(448, 8192, max_num_encoder_tokens=1500)
    assert got == math.ceil(1500 / 16) * page
    # The decoder length does not matter, the encoder length does.
    assert spec.max_memory_usage_bytes(10, 8192, max_num_encoder_tokens=1500) == got
    # Default encoder budget is the batched-token budget.
    assert spec.max_memory_usage_bytes(10, 100) == math.ceil(100 / 16) * page
    with pytest.raises(ConfigError, match="max_num_encoder_tokens must be > 0, got 0"):
        spec.max_memory_usage_bytes(10, 100, max_num_encoder_tokens=0)


def test_encoder_only_keeps_no_cache() -> None:
    spec = EncoderOnlyAttentionSpec(16, 4, 64, torch.float16)
    assert spec.page_size_bytes == 0
    assert spec.max_memory_usage_bytes(4096, 4096) == 0


@pytest.mark.parametrize(("kwargs", "name", "value"), [
    ({"block_size": 0}, "block_size", 0),
    ({"num_kv_heads": -1}, "num_kv_heads", -1),
    ({"head_size": 0}, "head_size", 0),
    ({"sliding_window": 0}, "sliding_window", 0),
    ({"attention_chunk_size": -8}, "attention_chunk_size", -8),
])
def test_non_positive_sizes_raise_with_numbers(kwargs: dict[str, int], name: str,
                                               value: int) -> None:
    base = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}
    with pytest.raises(ConfigError, match=f"{name} must be > 0, got {value}"):
        FullAttentionSpec(**{**base, **kwargs})  # type: ignore[arg-type]


def test_bad_limits_and_types_raise() -> None:
    spec = FullAttentionSpec(16, 2, 64, torch.float16)
    with pytest.raises(ConfigError, match="max_model_len must be > 0, got 0"):
        spec.max_memory_usage_bytes(0, 10)
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be > 0, got -3"):
        spec.max_memory_usage_bytes(10, -3)
    with pytest.raises(ConfigError, match="dtype"):
        FullAttentionSpec(16, 2, 64, "float16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot both be set"):
        FullAttentionSpec(16, 2, 64, torch.float16, sliding_window=4, attention_chunk_size=8)
    with pytest.raises(UnsupportedSpecError):
        _ = KVCacheSpec(16).page_size_bytes
    with pytest.raises(UnsupportedSpecError):
        KVCacheSpec(16).max_memory_usage_bytes(10, 10)


def test_specs_are_frozen_and_hashable() -> None:
    spec = FullAttentionSpec(16, 2, 64, torch.float16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]
    assert {spec, FullAttentionSpec(16, 2, 64, torch.float16)} == {spec}
    # Same fields, different kind: not equal.
    assert spec != MLAAttentionSpec(16, 2, 64, torch.float16)


def test_merge_identical_and_recorded_windows() -> None:
    plain = FullAttentionSpec(16, 2, 64, torch.float16)
    windowed = FullAttentionSpec(16, 2, 64, torch.float16, sliding_window=512)
    assert merge_specs([plain, plain]) == plain
    merged = merge_specs([plain, windowed, plain])
    assert merged.sliding_window == 512 and merged.attention_chunk_size is None
    mamba = MambaSpec(8, ((4,),), (torch.float32,))
    assert merge_specs([mamba, mamba]) is mamba


@pytest.mark.parametrize("specs", [
    [FullAttentionSpec(16, 2, 64, torch.float16, sliding_window=4),
     FullAttentionSpec(16, 2, 64, torch.float16, sliding_window=8)],
    [FullAttentionSpec(16, 2, 64, torch.float16, sliding_window=4),
     FullAttentionSpec(16, 2, 64, torch.float16, attention_chunk_size=8)],
    [FullAttentionSpec(16, 2, 64, torch.float16), FullAttentionSpec(16, 4, 64, torch.float16)],
    [FullAttentionSpec(16, 2, 64, torch.float16), MLAAttentionSpec(16, 2, 64, torch.float16)],
    [SlidingWindowSpec(16, 2, 64, torch.float16, sliding_window=4),
     SlidingWindowSpec(16, 2, 64, torch.float16, sliding_window=5)],
])
def test_merge_rejects_differing_specs(specs: list[KVCacheSpec]) -> None:
    with pytest.raises(SpecMismatchError) as info:
        merge_specs(specs)
    assert isinstance(info.value, ValueError)


@dataclasses.dataclass(frozen=True, slots=True)
class _AlienSpec(FullAttentionSpec):
    """A spec type the library does not know."""


def test_merge_and_uniform_reject_unknown_types() -> None:
    alien = _AlienSpec(16, 2, 64, torch.float16)
    with pytest.raises(UnsupportedSpecError, match="_AlienSpec"):
        merge_specs([alien])
    with pytest.raises(UnsupportedSpecError, match="_AlienSpec"):
        is_uniform_type({"a": alien})
    with pytest.raises(ConfigError):
        merge_specs([])


def test_is_uniform_type() -> None:
    f = FullAttentionSpec
    assert is_uniform_type({"a": f(16, 2, 64, torch.float16), "b": f(16, 8, 128, torch.float32)})
    assert not is_uniform_type({"a": f(16, 2, 64, torch.float16), "b": f(32, 2, 64, torch.float16)})
    sw = SlidingWindowSpec
    assert not is_uniform_type({"a": sw(16, 2, 64, torch.float16, sliding_window=4),
                                "b": sw(16, 2, 64, torch.float16, sliding_window=8)})
    assert not is_uniform_type({"a": f(16, 2, 64, torch.float16),
                                "b": sw(16, 2, 64, torch.float16, sliding_window=4)})


def test_uniform_type_specs_sum_pages_and_take_max_pages() -> None:
    small = FullAttentionSpec(16, 2, 64, torch.float16)
    big = FullAttentionSpec(16, 8, 64, torch.float32)
    uniform = UniformTypeSpecs(16, (("a", small), ("b", big)))
    assert uniform.page_size_bytes == small.page_size_bytes + big.page_size_bytes
    assert uniform.max_memory_usage_bytes(100, 10) == math.ceil(100 / 16) * (
        small.page_size_bytes + big.page_size_bytes)
    assert uniform.specs_by_layer == {"a": small, "b": big}
    with pytest.raises(SpecMismatchError):
        UniformTypeSpecs(16, (("a", small), ("b", SlidingWindowSpec(16, 2, 64, torch.float16,
                                                                   sliding_window=4))))
    with pytest.raises(ConfigError, match="distinct layer names"):
        UniformTypeSpecs(16, (("a", small), ("a", big)))


def test_config_records_validate() -> None:
    spec = FullAttentionSpec(16, 2, 64, torch.float16)
    group = KVCacheGroupSpec(("l0", "l1"), spec)
    with pytest.raises(ConfigError, match="duplicate layer names"):
        KVCacheGroupSpec(("l0", "l0"), spec)
    with pytest.raises(ConfigError, match="at least one"):
        KVCacheGroupSpec((), spec)
    with pytest.raises(UnsupportedSpecError):
        KVCacheGroupSpec(("l0",), "full")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="size must be > 0, got 0"):
        KVCacheTensor(0, ("l0",))
    with pytest.raises(ConfigError, match="num_blocks must be > 0, got 0"):
        KVCacheConfig(0, (), (group,))
    with pytest.raises(ConfigError, match="not a multiple of num_blocks=3"):
        KVCacheConfig(3, (KVCacheTensor(10, ("l0",)),), (group,))
    with pytest.raises(ConfigError, match="two groups"):
        KVCacheConfig(3, (), (group, KVCacheGroupSpec(("l1",), spec)))
    with pytest.raises(ConfigError, match="two tensors"):
        KVCacheConfig(3, (KVCacheTensor(3, ("l0",)), KVCacheTensor(3, ("l0", "l1"))), (group,))
    with pytest.raises(ConfigError, match=r"no group: \['zz'\]"):
        KVCacheConfig(3, (KVCacheTensor(3, ("zz",)),), (group,))
    ok = KVCacheConfig(3, (KVCacheTensor(3, ("l0",)), KVCacheTensor(6, ("l1",))), (group,))
    assert ok.kv_cache_groups == (group,)
