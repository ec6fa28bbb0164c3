"""Random-weight hybrid models for vLLM on two CPU cores: several KV cache groups.

Two shapes whose caches vLLM's hybrid KV cache manager splits into groups,
built like ``tiny_model``'s Llama (same byte-level tokenizer, everything a
function of ``seed``):

- ``gemma3``: Gemma 3 (``Gemma3ForCausalLM``): sliding-window layers and one
  full-attention layer; the sliding window's groups keep only the window's
  blocks.
- ``qwen3_next``: Qwen3-Next (``Qwen3NextForCausalLM``): gated-delta-net
  linear attention (a recurrent state per request, vLLM's Mamba groups) and
  one full-attention layer, with MoE feed-forward layers. vLLM's CPU kernel
  takes linear head sizes of 64 (32 is refused).

``python -m kvbridge.integrations.vllm.tiny_hybrid KIND OUT_DIR``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    PretrainedConfig,
    Qwen3NextConfig,
)

from kvbridge.integrations.vllm.tiny_model import (
    MAX_POSITION_EMBEDDINGS,
    VOCAB_SIZE,
    Dtype,
    _train_tokenizer,
)

Kind = Literal["gemma3", "qwen3_next"]
KINDS: tuple[Kind, ...] = ("gemma3", "qwen3_next")

#: Gemma 3's sliding window, in tokens (a few blocks of 32).
SLIDING_WINDOW = 96


def build_tiny_hybrid(out_dir: str | Path, kind: Kind, *, dtype: Dtype = "bfloat16",
                      seed: int = 0, initializer_range: float = 0.02) -> Path:
    """Write a random-weight hybrid model of ``kind``, its tokenizer and generation config.

    Args:
        out_dir: Folder to write (created if missing; files in it are replaced).
        kind: ``"gemma3"`` (4 sliding-window layers of ``SLIDING_WINDOW`` tokens
            and 1 full-attention layer) or ``"qwen3_next"`` (3 linear-attention
            layers and 1 full-attention layer, MoE of 4 experts).
        dtype: Weight dtype stored and named in ``config.json``.
        seed: Seeds the weights and the tokenizer's corpus.
        initializer_range: Standard deviation of the random weights; a wider one
            (0.2, in float32) spreads the logits so that greedy picks survive a
            different order of the same arithmetic (a prompt computed in two
            parts, as P/D does, instead of one).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(seed)
    tokenizer.save_pretrained(out)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.eos_token_id}
    config: PretrainedConfig
    if kind == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            query_pre_attn_scalar=32, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention"] * 4 + ["full_attention"],
            max_position_embeddings=MAX_POSITION_EMBEDDINGS, initializer_range=initializer_range,
            tie_word_embeddings=True, dtype=dtype, **ids,
        )
        config.architectures = ["Gemma3ForCausalLM"]
    elif kind == "qwen3_next":
        config = Qwen3NextConfig(
            vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, decoder_sparse_step=1,
            max_position_embeddings=MAX_POSITION_EMBEDDINGS, initializer_range=initializer_range,
            tie_word_embeddings=False, dtype=dtype, **ids,
        )
        config.architectures = ["Qwen3NextForCausalLM"]
    else:
        raise ValueError(f"unknown kind {kind!r}: one of {KINDS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     do_sample=False).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m kvbridge.integrations.vllm.tiny_hybrid KIND OUT_DIR [--dtype D] [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--initializer-range", type=float, default=0.02)
    args = parser.parse_args(argv)
    build_tiny_hybrid(args.out_dir, args.kind, dtype=args.dtype, seed=args.seed,
                      initializer_range=args.initializer_range)


if __name__ == "__main__":
    main()
