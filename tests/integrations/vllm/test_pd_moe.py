"""MoE with dense GQA attention (a tiny Qwen3-MoE) through KVBridgeConnector in real vLLM.

The experts change nothing for the connector (the attention cache is a dense
one); this checks that once, cheaply: a P and a D at TP 1, float32, classic
flow, P's own colocated answer as the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.client import complete
from tests.integrations.vllm.conftest import TinyModelFactory
from tests.integrations.vllm.pd import (
    BLOCK_SIZE,
    LATE_SYNC_LOADS,
    NUM_NEW_TOKENS,
    counters,
    kv_config,
    pd_complete,
    prompt_ids,
    wait_usage,
)
from tests.integrations.vllm.servers import ServersForTest, ServerSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# per block on D: 3 layers x 2 KV heads x 128 slots x (K+V of 48) x 4 bytes
MOE_BLOCK_NBYTES = 3 * 2 * BLOCK_SIZE * 96 * 4


def test_moe_pd_answers_equal_colocated(
    vllm_servers: ServersForTest, tiny_model_factory: TinyModelFactory,
) -> None:
    model: Path = tiny_model_factory("float32", initializer_range=0.2, kind="moe")
    # policy recompute: small loads are synchronous (a late one would be recomputed)
    p, d = vllm_servers.private_all(*(ServerSpec(
        model, dtype="float32", block_size=BLOCK_SIZE,
        kv_transfer_config=kv_config("recompute"), instance=name) for name in ("p", "d")))
    was_late = False
    for num_tokens in (5, BLOCK_SIZE, 700):
        prompt = prompt_ids(num_tokens, seed=80)
        expected = complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids
        late_before = counters(d.base_url)[LATE_SYNC_LOADS]
        result = pd_complete(p.base_url, d.base_url, prompt, expect_transfers=1)
        assert result.completion.token_ids == expected
        late = counters(d.base_url)[LATE_SYNC_LOADS] > late_before
        # a late load's read is cancelled (a failure, recomputed), unless it ended first
        assert result.num_transfers + result.num_failures == 1
        assert result.num_failures == 0 or late
        # every load here is small (synchronous), but the first from a P is not: it
        # connects to P's ranks, which no forward waits on; nor is one after a late
        # load (recomputed: a loaded machine), which turned P cold
        assert result.num_sync_loads == (0 if num_tokens == 5 or was_late else 1)
        was_late = late
        assert result.external_hits == num_tokens - 1
        if not result.num_failures:
            assert result.nbytes == -(-(num_tokens - 1) // BLOCK_SIZE) * MOE_BLOCK_NBYTES
    wait_usage(p.base_url)
    wait_usage(d.base_url)
