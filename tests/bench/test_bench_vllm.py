"""Smoke tests of ``kvbridge bench vllm --model-kind``: model sizes, the table, one real run.

The real run (two vLLM servers, a Gemma 3 shape, two prompt lengths, one
request each) checks what the sliding-window row is for: D loads a long
prompt's window, not the prompt, so the bytes per loaded token fall with the
length. No time is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvbridge.bench import tables as bench_tables
from kvbridge.bench import vllm_bench
from kvbridge.bench.cli import build_parser
from kvbridge.bench.vllm_models import describe, model_shape

GEMMA3 = {"hidden_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "sliding_window": 96,
          "layer_types": ["sliding_attention"] * 4 + ["full_attention"]}
QWEN3_NEXT = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}


def _model(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_sliding_window_model_counts_its_window_layers_apart(tmp_path: Path) -> None:
    shape = model_shape(_model(tmp_path, GEMMA3))
    # 2 KV heads x 32 x (K+V) x 2 bytes = 256 bytes per token and layer
    assert (shape["kv_bytes_per_token"], shape["full_kv_bytes_per_token"]) == (5 * 256, 256)
    assert (shape["num_sliding_layers"], shape["sliding_window"]) == (4, 96)
    assert "4 sliding-window layers keep 96 tokens" in describe(shape)


def test_a_linear_attention_model_counts_only_its_attention_layers(tmp_path: Path) -> None:
    shape = model_shape(_model(tmp_path, QWEN3_NEXT))
    assert shape["kv_bytes_per_token"] == shape["full_kv_bytes_per_token"] == 2 * 2 * 64 * 2
    assert shape["num_linear_layers"] == 3 and "sliding_window" not in shape
    assert "3 linear-attention layers keep a state per request" in describe(shape)


def test_an_unknown_model_kind_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="model kind 'mamba'"):
        vllm_bench.run(quick=True, model_kind="mamba")
    args = build_parser().parse_args(["vllm", "--model-kind", "linear"])
    assert args.model_kind == "linear"


def test_the_table_names_a_models_linear_attention_layers() -> None:
    row = {"prompt_tokens": 64, "num_requests": 1, "ttft_ms": 10.0}
    report = {"settings": {"model": "m", "requests": 1, "idle_s": 1.0,
                           "shape": {"layers": 4, "kv_heads": 2, "head_dim": 64,
                                     "kv_bytes_per_token": 512, "num_linear_layers": 3}},
              "configs": {"colocated": {"rows": [row], "idle_cpu": {}}}}
    assert "linear-attention layers keep a state" in bench_tables.vllm_table(report)


def _vllm_or_skip() -> None:
    if importlib.util.find_spec("vllm") is None:
        reason = "vllm is not installed (make setup-vllm)"
        if os.environ.get("KVBRIDGE_REQUIRE_VLLM") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


@pytest.mark.integration  # two vLLM servers
@pytest.mark.timeout(600)
def test_a_sliding_window_model_moves_only_the_window_of_a_long_prompt(tmp_path: Path) -> None:
    _vllm_or_skip()
    from kvbridge.bench import vllm_bench

    # a deadline a loaded machine keeps: no synchronous load is late (and so failed)
    report = vllm_bench.run(quick=True, lengths=[40, 800], requests=1, connectors=["kvbridge"],
                            out=str(tmp_path), model_kind="swa",
                            kvbridge_extra={"sync_load_deadline_s": 10.0})
    assert bench_tables.passed("vllm", report), report["configs"]
    short, long = report["configs"]["kvbridge"]["rows"]
    assert (short["num_failures"], long["num_failures"]) == (0, 0)
    # first-token flow: D loads every prompt token (a fallback to the classic flow: all but one)
    assert long["loaded_tokens_per_request"] in (800, 799)
    # a 40-token prompt is inside the window: every layer moves it (two 32-token blocks
    # of 2 KV heads x 64 x 2 bytes per layer); of 800 tokens the window layers move
    # at most 4 blocks each, the full-attention layer all 25
    block_nbytes = 32 * 256
    assert short["mib_per_request"] * (1 << 20) == 5 * 2 * block_nbytes
    assert long["mib_per_request"] * (1 << 20) <= (25 + 4 * 4) * block_nbytes
    assert long["bytes_per_loaded_token"] < short["bytes_per_loaded_token"] / 2
