"""The models of ``kvbridge bench vllm --model-kind``: build, describe, and how P/D runs them.

Called by ``kvbridge/bench/vllm_bench.py``. Every kind is a random-weight model
built at run time in a child process (transformers stays out of the
benchmark's process), one per family kvbridge moves:

==========  =====================================================================
kind        model (builder)
==========  =====================================================================
dense       Llama, GQA (``tiny_model``)
mla         DeepSeek-V2, MLA latent 576, dense MLPs (``tiny_families``); vLLM's
            reference CPU MLA backend forces block size 16 and turns prefix caching
            off (on a CPU with AMX vLLM picks AMX_MLA instead)
moe         Qwen3-MoE, dense GQA attention (``tiny_families``)
swa         Gemma 3: 4 sliding-window layers (96 tokens) + 1 full-attention layer
            (``tiny_hybrid gemma3``); D loads only the window of a long prompt
linear      Qwen3-Next: 3 gated-delta-net layers (a recurrent state per request)
            + 1 full-attention layer, MoE (``tiny_hybrid qwen3_next``); vLLM
            makes its block size hold one state's page, a size that depends on the
            CPU's attention kernels (160 tokens with AVX-512, 96 with AVX2 only)
==========  =====================================================================
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_MODEL = {"hidden": 512, "layers": 8}  # dense: ~12 MiB of bf16 KV for 1500 tokens
MODEL_KINDS = ("dense", "mla", "moe", "swa", "linear")
MODEL_LABELS = {
    "dense": f"random Llama, hidden {BENCH_MODEL['hidden']}, {BENCH_MODEL['layers']} layers",
    "mla": "random DeepSeek-V2 (MLA, dense MLPs), hidden 192, 8 layers",
    "moe": "random Qwen3-MoE, hidden 192, 8 layers",
    "swa": "random Gemma 3 (4 sliding-window layers of 96 tokens, 1 full-attention layer), "
           "hidden 128",
    "linear": "random Qwen3-Next (3 gated-delta-net layers, 1 full-attention layer, MoE), "
              "hidden 128",
}
#: ``--block-size`` per kind (vLLM may change it: MLA 16 on CPU_MLA, linear to a state's
#: page, which depends on the CPU).
BLOCK_SIZES = {"dense": 128, "mla": 128, "moe": 128, "swa": 32, "linear": 32}
_HYBRID = {"swa": "gemma3", "linear": "qwen3_next"}  # tiny_hybrid's kinds


def build_model(out_dir: Path, kind: str = "dense") -> Path:
    """Write the benchmark's random model of ``kind`` (``MODEL_KINDS``) into ``out_dir``.

    Raises:
        ValueError: an unknown ``kind``.
        subprocess.CalledProcessError: the builder failed (its stderr attached).
    """
    module = "kvbridge.integrations.vllm."
    if kind == "dense":
        argv = [f"{module}tiny_model", str(out_dir), "--hidden", str(BENCH_MODEL["hidden"]),
                "--layers", str(BENCH_MODEL["layers"])]
    elif kind in ("mla", "moe"):
        argv = [f"{module}tiny_families", str(out_dir), "--kind", kind, "--dtype", "bfloat16",
                "--layers", str(BENCH_MODEL["layers"])]
    elif kind in _HYBRID:
        argv = [f"{module}tiny_hybrid", _HYBRID[kind], str(out_dir), "--dtype", "bfloat16"]
    else:
        raise ValueError(f"model kind {kind!r}: expected one of {MODEL_KINDS}")
    subprocess.run([sys.executable, "-m", *argv], check=True, capture_output=True)
    return out_dir


def model_shape(model: Path) -> dict[str, Any]:
    """Sizes from ``config.json`` and the bf16 KV bytes one token takes in each kind of layer.

    ``kv_bytes_per_token``: every attention layer (sliding-window ones too) as
    if it kept every token; ``full_kv_bytes_per_token``: the layers that do
    keep every token (full attention). A sliding-window layer keeps
    ``sliding_window`` tokens; a linear-attention layer a state per request.

    Raises:
        ValueError: ``model`` has no ``config.json``.
    """
    if not (model / "config.json").is_file():
        raise ValueError(f"{model} has no config.json: not a model folder")
    config = json.loads((model / "config.json").read_text())
    num_heads = config["num_attention_heads"]
    num_layers = config["num_hidden_layers"]
    shape: dict[str, Any] = {"hidden": config["hidden_size"], "layers": num_layers,
                             "vocab_size": config["vocab_size"]}
    if config.get("kv_lora_rank"):  # MLA: one latent per token and layer, no K/V heads
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        nbytes = num_layers * latent * 2
        return {**shape, "kv_heads": 1, "head_dim": latent, "mla": True,
                "kv_bytes_per_token": nbytes, "full_kv_bytes_per_token": nbytes}
    layer_types = config.get("layer_types") or ["full_attention"] * num_layers
    num_full = layer_types.count("full_attention")
    num_sliding = layer_types.count("sliding_attention")
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    num_kv_heads = config.get("num_key_value_heads", num_heads)
    per_layer = 2 * num_kv_heads * head_dim * 2  # K and V, bf16
    shape.update(kv_heads=num_kv_heads, head_dim=head_dim,
                 kv_bytes_per_token=(num_full + num_sliding) * per_layer,
                 full_kv_bytes_per_token=num_full * per_layer)
    if num_sliding:
        shape.update(num_sliding_layers=num_sliding, sliding_window=config["sliding_window"])
    if num_linear := layer_types.count("linear_attention"):
        shape["num_linear_layers"] = num_linear
    return shape


def describe(shape: dict[str, Any]) -> str:
    """One line of ``model_shape``'s sizes for a report."""
    text = (f"{shape['layers']} layers, {shape['kv_heads']} KV heads x {shape['head_dim']}, "
            f"{shape['kv_bytes_per_token'] / 1024:g} KiB KV per token")
    if "sliding_window" in shape:
        text += (f" if every layer kept every token; {shape['num_sliding_layers']} "
                 f"sliding-window layers keep {shape['sliding_window']} tokens, the rest "
                 f"{shape['full_kv_bytes_per_token'] / 1024:g} KiB per token")
    if "num_linear_layers" in shape:
        text += (f" in {shape['layers'] - shape['num_linear_layers']} full-attention "
                 f"layer(s); {shape['num_linear_layers']} linear-attention layers keep a "
                 f"state per request")
    return text
