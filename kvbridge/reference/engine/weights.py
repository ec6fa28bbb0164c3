"""Full (unsharded) model weights: Llama tensor names, seeded init, safetensors I/O.

Every TP rank builds or loads the SAME full weight dictionary and the model keeps
only its slices, so TP=1 and TP=N compute one function. Names follow the Llama /
Hugging Face checkpoint format (``model.layers.N.self_attn.q_proj.weight``...)
and linear weights are ``[out_features, in_features]``.

Seeded weights draw each tensor from its own ``torch.Generator`` seeded from the
config seed and the tensor's name, so a tensor does not depend on the order in
which the others were drawn. The model runner calls :func:`init_weights` or
:func:`load_safetensors_dir`; tests write checkpoints with :func:`save_safetensors`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from kvbridge.errors import ConfigError
from kvbridge.reference.engine.model_config import ModelConfig

Weights = dict[str, torch.Tensor]

_LAYER = "model.layers.{}."

#: Shrinks the EOS logit of seeded models so most answers run for dozens of tokens.
_EOS_SCALE = 0.75


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the model needs, in checkpoint order."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for layer in range(config.num_layers):
        p = _LAYER.format(layer)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (config.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _init_std(name: str, shape: tuple[int, ...], config: ModelConfig) -> float | None:
    """Standard deviation of a random tensor; ``None`` for norm weights (all ones).

    Chosen (by measuring) so that a random model behaves usefully for tests:
    fan-in scaling keeps projections near unit RMS; residual-stream writers are
    scaled by 1/sqrt(2L) so the stream does not grow with depth; a small
    embedding and peaked attention (larger queries and keys) make the output
    depend on the cached context, not mostly on the current token, so losing
    one cached block changes the continuation; a large LM head spreads the
    logits (few near-ties for greedy decoding, varied text).
    """
    if name.endswith("norm.weight"):
        return None
    if name == "model.embed_tokens.weight":
        return 0.3
    std = 1.0 / math.sqrt(shape[1])  # fan-in
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return std / math.sqrt(2 * config.num_layers)
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return std * 2.5
    if name == "lm_head.weight":
        return std * 4.0
    return std


def _silent_tokens(config: ModelConfig) -> list[int]:
    """Token ids the seeded model should not generate."""
    spoken = {*range(0x20, 0x7F), ord("\n"), config.eos_token_id}
    return [t for t in range(config.vocab_size) if t not in spoken]


def init_weights(config: ModelConfig) -> Weights:
    """Seeded random weights for ``config`` (same on every process and run).

    The LM head rows of every token but printable ASCII, newline and EOS are
    zero: a zero logit (practically) never beats the spread of the others, so
    the seeded model writes readable characters (valid UTF-8 one token at a
    time, easy to stream) and ends with EOS now and then, as a trained model does.

    Returns:
        Name -> tensor on the CPU in ``config.torch_dtype``.
    """
    weights: Weights = {}
    for name, shape in weight_shapes(config).items():
        std = _init_std(name, shape, config)
        if std is None:
            weights[name] = torch.ones(shape, dtype=config.torch_dtype)
            continue
        # crc32 is stable across processes (unlike hash()) and mixes the name in.
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + zlib.crc32(name.encode()))
        tensor = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        if name == "lm_head.weight":
            tensor[_silent_tokens(config)] = 0.0
            tensor[config.eos_token_id] *= _EOS_SCALE
        weights[name] = tensor.to(config.torch_dtype)
    return weights


def check_weights(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Check that ``weights`` holds every tensor ``config`` needs, with the right shape.

    Extra names are allowed (checkpoints carry e.g. rotary buffers).

    Raises:
        ConfigError: a missing tensor or a shape mismatch (names and shapes in the message).
    """
    shapes = weight_shapes(config)
    missing = [name for name in shapes if name not in weights]
    if missing:
        raise ConfigError(f"{len(missing)} weights missing, first: {missing[:3]}")
    for name, shape in shapes.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ConfigError(f"weight {name} has shape {got}, model {config.name} needs {shape}")


def load_safetensors_dir(path: str | Path, config: ModelConfig) -> Weights:
    """Load every ``*.safetensors`` file in directory ``path`` as full weights.

    A checkpoint without ``lm_head.weight`` ties it to the embedding, as
    Llama checkpoints with ``tie_word_embeddings`` do.

    Args:
        path: Directory holding one or more shards.
        config: Model the weights must fit.

    Returns:
        Name -> CPU tensor in ``config.torch_dtype`` (only the names the model uses).

    Raises:
        ConfigError: ``path`` is not a directory, holds no safetensors file, a
            name appears in two shards, or a tensor is missing or misshaped.
    """
    from safetensors.torch import load_file

    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"weights directory {directory} does not exist")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors file in {directory}")
    loaded: Weights = {}
    for file in files:
        shard = load_file(str(file))
        duplicates = loaded.keys() & shard.keys()
        if duplicates:
            raise ConfigError(
                f"{file.name} repeats {len(duplicates)} tensors, e.g. {min(duplicates)}"
            )
        loaded.update(shard)
    if "lm_head.weight" not in loaded and "model.embed_tokens.weight" in loaded:
        loaded["lm_head.weight"] = loaded["model.embed_tokens.weight"]
    check_weights(loaded, config)
    return {name: loaded[name].to(config.torch_dtype) for name in weight_shapes(config)}


def save_safetensors(weights: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write ``weights`` to one safetensors file at ``path`` (tensors made contiguous)."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in weights.items()}, str(path))
