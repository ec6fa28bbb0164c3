"""KV caches of different dtypes through KVBridgeConnector in real vLLM.

Quantized KV (``--kv-cache-dtype fp8``): vLLM's CPU attention keeps an fp8 cache as
``uint8`` tensors, its scales per layer in the model (1.0 for this checkpoint), the
same on P and D: kvbridge moves the bytes as they are. vLLM runs an fp8 cache only on
CPUs with AVX-512 or AMX: elsewhere that test is skipped with vLLM's own reason
(``vllm_probe``).

P and D must keep the same cache dtype: a D whose cache dtype differs is refused at
the handshake, its log names both dtypes, and the request fails (vLLM's default
``kv_load_failure_policy``), never answered from bytes of another dtype. Checked on
every host with two dtypes every CPU runs: test_pd.py's bf16 P, and a D of the same
model in float32.

Servers (bf16 tiny Llama): P and D with an fp8 cache; a float32 D; the bf16 P of
``test_pd.py`` (shared: the package runs this module while that P still runs,
``conftest.MODULE_ORDER``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integrations.vllm.client import complete
from tests.integrations.vllm.pd import (
    BLOCK_SIZE,
    FAILURES,
    NUM_NEW_TOKENS,
    TRANSFERS,
    ZERO_CONFIG,
    counters,
    pd_complete,
    poll_metrics,
    prefill,
    prompt_ids,
    wait_usage,
)
from tests.integrations.vllm.servers import ServersForTest, ServerSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# per block on D: 2 layers x 2 KV heads x 128 slots x (K+V of 32) x 1 byte
FP8_BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 64 * 1


def spec(model: Path, instance: str, *extra: str, dtype: str = "bfloat16") -> ServerSpec:
    return ServerSpec(model, dtype=dtype, block_size=BLOCK_SIZE,
                      kv_transfer_config=json.dumps(ZERO_CONFIG), extra_args=extra,
                      instance=instance)


def test_fp8_cache_moves_as_it_is(vllm_servers: ServersForTest, tiny_llama: Path,
                                  vllm_cpu: dict[str, Any]) -> None:
    if vllm_cpu["fp8_kv_refusal"]:
        pytest.skip(f"vLLM runs no fp8 KV cache on this CPU: {vllm_cpu['fp8_kv_refusal']}")
    p, d = vllm_servers.shared_all(spec(tiny_llama, "p-fp8", "--kv-cache-dtype", "fp8"),
                                   spec(tiny_llama, "d-fp8", "--kv-cache-dtype", "fp8"))
    for num_tokens in (5, 300):
        prompt = prompt_ids(num_tokens, seed=70)
        expected = complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids  # colocated, fp8
        result = pd_complete(p.base_url, d.base_url, prompt, expect_transfers=1)
        assert result.completion.token_ids == expected
        assert (result.num_transfers, result.num_failures) == (1, 0)
        assert result.nbytes == -(-(num_tokens - 1) // BLOCK_SIZE) * FP8_BLOCK_NBYTES
        assert result.external_hits == num_tokens - 1
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_a_cpu_without_avx512_or_amx_skips_fp8_with_vllms_reason(
    vllm_cpu: dict[str, Any],
) -> None:
    """The skip path above, as a host without AVX-512 and AMX takes it: vLLM's own
    check, with torch told those features are absent, gives the reason shown."""
    reason = vllm_cpu["fp8_kv_refusal_without_avx512_amx"]
    assert isinstance(reason, str) and "FP8" in reason and "AVX-512" in reason, reason


def test_a_d_of_another_cache_dtype_is_refused_at_the_handshake(
    vllm_servers: ServersForTest, tiny_llama: Path,
) -> None:
    p = vllm_servers.shared(spec(tiny_llama, "p"))  # bf16 cache: test_pd.py's P
    d = vllm_servers.shared(spec(tiny_llama, "d-f32", dtype="float32"))  # float32 cache
    prompt = prompt_ids(200, seed=71)
    params = prefill(p.base_url, prompt)
    before = counters(d.base_url)
    try:  # vLLM's default kv_load_failure_policy: fail the request, never answer it
        done = complete(d.base_url, prompt, NUM_NEW_TOKENS, kv_transfer_params=params)
    except httpx.HTTPStatusError as exc:
        assert exc.response.status_code >= 400
    else:
        assert done.finish_reason not in ("length", "stop"), done.response
    after = poll_metrics(d.base_url, lambda m: m.get(FAILURES, 0) > before[FAILURES])
    assert after[TRANSFERS] == before[TRANSFERS]
    log = d.log_path.read_text(errors="replace")
    assert "dtype: local 'float32' != remote 'bfloat16'" in log
    assert "--kv-cache-dtype" in log
    wait_usage(d.base_url)
