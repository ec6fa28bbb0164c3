"""What vLLM's CPU build can run on this host, asked of vLLM's own code in a child.

``python -m tests.integrations.vllm.vllm_probe`` imports vLLM (so the import check of
``conftest.vllm_importable`` is this probe) and prints one JSON object:

- ``fp8_kv_refusal``: vLLM's reason for refusing an fp8 KV cache on this CPU, from the
  check its CPU attention backend runs when a server builds its attention
  (``cpu_attn._get_attn_isa``), or null where an fp8 cache runs.
- ``fp8_kv_refusal_without_avx512_amx``: the same check with torch told that this
  CPU has neither AVX-512 nor AMX: the reason every host without them gets (what the
  suite's skip path shows on a host that has them).

vLLM loads into this child only: pytest's process never imports it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: What the tests' servers ask of the CPU attention backend: their model's dtype, the
#: suite's block size and the tiny Llama's head size.
_PROBED = (torch.bfloat16, 128, 64)


def fp8_kv_refusal() -> str | None:
    """vLLM's message refusing an fp8 KV cache here, or None if it runs."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(*_PROBED, kv_cache_dtype="fp8")
    except NotImplementedError as exc:
        return str(exc)
    return None


@contextmanager
def without_avx512_amx() -> Iterator[None]:
    """torch's CPU feature checks answer "absent" for AVX-512 and AMX meanwhile."""
    saved = torch.cpu._is_avx512_supported, torch.cpu._is_amx_tile_supported
    torch.cpu._is_avx512_supported = lambda: False  # type: ignore[assignment]
    torch.cpu._is_amx_tile_supported = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cpu._is_avx512_supported, torch.cpu._is_amx_tile_supported = saved


def probe() -> dict[str, Any]:
    import vllm  # noqa: F401  (the import check: a failure here is the skip's reason)

    real = fp8_kv_refusal()
    with without_avx512_amx():
        simulated = fp8_kv_refusal()
    return {"fp8_kv_refusal": real, "fp8_kv_refusal_without_avx512_amx": simulated}


if __name__ == "__main__":
    print(json.dumps(probe()))
