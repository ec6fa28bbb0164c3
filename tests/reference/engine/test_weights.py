"""Tests for kvbridge.reference.engine.weights: seeded init and Llama safetensors loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.reference.engine.runner import ModelRunner
from kvbridge.reference.engine.weights import (
    init_weights,
    load_safetensors_dir,
    save_safetensors,
    weight_shapes,
)
from tests.reference.engine.helpers import MICRO, PROMPTS, generate


def test_seeded_weights_are_reproducible_and_seed_dependent() -> None:
    a, b = init_weights(MICRO), init_weights(MICRO)
    other = init_weights(dataclasses.replace(MICRO, seed=1))
    assert list(a) == list(weight_shapes(MICRO))
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name
        assert tuple(tensor.shape) == weight_shapes(MICRO)[name]
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor))
        else:
            assert not torch.equal(tensor, other[name]), name
    assert "model.layers.1.self_attn.k_proj.weight" in a


def write_checkpoint(weights: dict[str, torch.Tensor], directory: Path) -> None:
    """Two shards, like a real multi-file checkpoint."""
    names = sorted(weights)
    half = len(names) // 2
    save_safetensors({n: weights[n] for n in names[:half]}, directory / "model-00001.safetensors")
    save_safetensors({n: weights[n] for n in names[half:]}, directory / "model-00002.safetensors")


def test_safetensors_round_trip_drives_the_model(tmp_path: Path) -> None:
    config = dataclasses.replace(MICRO, seed=5)
    weights = init_weights(config)
    write_checkpoint(weights, tmp_path)
    loaded = load_safetensors_dir(tmp_path, MICRO)  # the file's weights, not MICRO's seed
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[n], weights[n]) for n in weights)

    def tokens(source: object) -> list[int]:
        runner = ModelRunner(MICRO, 0, 1, None, 16, 16, "NHD", weights=source)  # type: ignore[arg-type]
        return generate(runner, PROMPTS[1], list(range(8)), 6)

    from_dir = tokens(str(tmp_path))
    assert from_dir == tokens(weights)
    assert from_dir != tokens(None)  # seeded weights of MICRO (seed 0) differ


def test_missing_lm_head_is_tied_to_the_embedding(tmp_path: Path) -> None:
    weights = init_weights(MICRO)
    del weights["lm_head.weight"]
    save_safetensors(weights, tmp_path / "model.safetensors")
    loaded = load_safetensors_dir(tmp_path, MICRO)
    assert torch.equal(loaded["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_bad_checkpoints_raise(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        load_safetensors_dir(tmp_path, MICRO)
    with pytest.raises(ConfigError, match="does not exist"):
        load_safetensors_dir(tmp_path / "nope", MICRO)
    weights = init_weights(MICRO)
    name = "model.layers.1.mlp.down_proj.weight"

    missing = tmp_path / "missing"
    missing.mkdir()
    save_safetensors({n: t for n, t in weights.items() if n != name}, missing / "m.safetensors")
    with pytest.raises(ConfigError, match="missing"):
        load_safetensors_dir(missing, MICRO)

    misshaped = tmp_path / "misshaped"
    misshaped.mkdir()
    save_safetensors({**weights, name: weights[name][:, :-1]}, misshaped / "m.safetensors")
    with pytest.raises(ConfigError, match="down_proj"):
        load_safetensors_dir(misshaped, MICRO)

    duplicated = tmp_path / "duplicated"
    duplicated.mkdir()
    save_safetensors(weights, duplicated / "a.safetensors")
    save_safetensors({name: weights[name]}, duplicated / "b.safetensors")
    with pytest.raises(ConfigError, match="repeats"):
        load_safetensors_dir(duplicated, MICRO)
