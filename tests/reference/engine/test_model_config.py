"""Tests for kvbridge.reference.engine.model_config: presets, validation, TP splits, config.json."""

from __future__ import annotations

import dataclasses

import pytest

from kvbridge.errors import ConfigError
from kvbridge.reference.engine.model_config import (
    ModelConfig,
    config_from_hf,
    get_model_config,
    model_names,
)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_presets_are_gqa_and_byte_vocab(name: str) -> None:
    config = get_model_config(name)
    assert config.name == name
    assert config.num_heads % config.num_kv_heads == 0
    assert config.vocab_size >= 259
    assert config.q_size == config.num_heads * config.head_dim
    assert config.kv_size == config.num_kv_heads * config.head_dim


def test_small_is_bigger_than_tiny() -> None:
    tiny, small = get_model_config("tiny"), get_model_config("small")
    assert small.num_layers > tiny.num_layers and small.hidden_size > tiny.hidden_size
    assert small.num_queries_per_kv > 1
    assert set(model_names()) == {"tiny", "small"}


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="tiny"):
        get_model_config("huge")


@pytest.mark.parametrize(
    "changes",
    [
        {"num_kv_heads": 3},  # 8 query heads not a multiple of 3
        {"head_dim": 31},
        {"num_layers": 0},
        {"eos_token_id": 300},
        {"dtype": "float64"},
        {"rope_theta": 0.0},
    ],
)
def test_invalid_configs_raise(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        dataclasses.replace(get_model_config("tiny"), **changes)  # type: ignore[arg-type]


def test_tp_sizes() -> None:
    tiny = get_model_config("tiny")  # 8 q heads, 8 kv heads, intermediate 512
    for tp_size in (1, 2, 4, 8):
        tiny.check_tp_size(tp_size)
    with pytest.raises(ConfigError, match="tp_size 3"):
        tiny.check_tp_size(3)
    mqa = dataclasses.replace(tiny, num_kv_heads=1)
    mqa.check_tp_size(4)  # the single KV head is replicated
    with pytest.raises(ConfigError):
        tiny.check_tp_size(16)  # more ranks than query heads


def test_config_from_hf() -> None:
    hf = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "rope_theta": 500000.0,
        "max_position_embeddings": 512,
        "eos_token_id": [257, 258],
        "torch_dtype": "bfloat16",
    }
    config = config_from_hf(hf, "local")
    assert isinstance(config, ModelConfig)
    assert (config.head_dim, config.num_kv_heads, config.eos_token_id) == (16, 2, 257)
    assert (config.dtype, config.rope_theta, config.max_model_len) == ("bfloat16", 5e5, 512)
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_hf({**hf, "hidden_size": "64"})
