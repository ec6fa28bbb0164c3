"""Random-weight models of other families than Llama, small enough for vLLM on two CPU cores.

Beside ``tiny_model`` (dense GQA Llama), for the vLLM tests and ``kvbridge bench
vllm --model-kind``:

- ``mla``: a DeepSeek-V2 (multi-head latent attention, dense MLPs). vLLM's CPU
  MLA kernel takes only DeepSeek's latent: ``kv_lora_rank`` 512 +
  ``qk_rope_head_dim`` 64 (576 elements per token and layer); vLLM sets block
  size 16 for it and turns off prefix caching and chunked prefill on CPU. The
  rest is tiny. Its MLPs are dense: with random weights, a router's near ties
  flip experts on the last bit of a float, so the same position computed by
  vLLM's decode and prefill paths, at TP 1 and 2 or alone and batched, could
  pick other tokens (measured: 5 of 9 prompts at ``initializer_range`` 0.05).
- ``moe``: a Qwen3-MoE (dense GQA attention, 4 experts of which 2 per token).

Same tokenizer as ``tiny_model`` and the same promise: everything is a function
of ``seed``, so greedy outputs compare across servers and runs. The tests build
them in a subprocess (``python -m kvbridge.integrations.vllm.tiny_families
DIR --kind mla``) so that ``transformers`` never loads into pytest.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kvbridge.integrations.vllm.tiny_model import (
    MAX_POSITION_EMBEDDINGS,
    VOCAB_SIZE,
    Dtype,
    _train_tokenizer,
)

Kind = Literal["mla", "moe"]
KINDS: tuple[Kind, ...] = ("mla", "moe")

#: What vLLM's CPU MLA kernel takes (``CPUMLABackend.get_supported_head_sizes``).
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
MLA_LATENT_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM


def build_tiny_family(
    out_dir: str | Path,
    kind: Kind,
    *,
    dtype: Dtype = "float32",
    initializer_range: float = 0.02,
    seed: int = 0,
    num_layers: int = 3,
) -> Path:
    """Write a random-weight model of ``kind``, its tokenizer and generation config.

    Shapes (hidden 192, 4 attention heads) split evenly over tensor-parallel 2.

    Args:
        out_dir: Folder to write (created if missing; files in it are replaced).
        kind: ``"mla"`` (DeepSeek-V2) or ``"moe"`` (Qwen3-MoE).
        dtype: Weight dtype stored and named in ``config.json``.
        initializer_range: Standard deviation of the random weights. For the MLA
            model keep 0.02: wider weights make its float32 answers depend on the
            order of sums (decode against prefill path, TP 1 against 2).
        seed: Seeds the weights and the tokenizer's corpus; same seed, same files.
        num_layers: Decoder layers (MoE from the second on for ``moe``; all dense for
            ``mla``).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: an unknown ``kind``, or ``num_layers`` below 1.

    Side effects:
        None on the caller's torch RNG (the weights are drawn in a forked RNG).
    """
    if num_layers < 1:
        raise ValueError(f"num_layers {num_layers} < 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(seed)
    tokenizer.save_pretrained(out)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE, hidden_size=192, intermediate_size=384,
        num_hidden_layers=num_layers, num_attention_heads=4,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS, initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, dtype=dtype,
    )
    config: PreTrainedConfig
    model_cls: type[PreTrainedModel]
    if kind == "mla":
        config = DeepseekV2Config(
            **common, num_key_value_heads=4, kv_lora_rank=KV_LORA_RANK, q_lora_rank=None,
            qk_rope_head_dim=QK_ROPE_HEAD_DIM, qk_nope_head_dim=32, v_head_dim=32,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=64, first_k_dense_replace=num_layers, topk_method="greedy",
            n_group=1, topk_group=1,
        )
        model_cls = DeepseekV2ForCausalLM
    elif kind == "moe":
        config = Qwen3MoeConfig(  # type: ignore[call-arg, unused-ignore]  # head_dim: kwargs in the stubs
            **common, num_key_value_heads=2, head_dim=48, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[0],
        )
        model_cls = Qwen3MoeForCausalLM
    else:
        raise ValueError(f"unknown kind {kind!r}; choose one of {KINDS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        do_sample=False,
    ).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m kvbridge.integrations.vllm.tiny_families OUT_DIR --kind mla|moe ...``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    parser.add_argument("--initializer-range", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=3, help="decoder layers (default 3)")
    args = parser.parse_args(argv)
    build_tiny_family(args.out_dir, args.kind, dtype=args.dtype,
                      initializer_range=args.initializer_range, seed=args.seed,
                      num_layers=args.layers)


if __name__ == "__main__":
    main()
