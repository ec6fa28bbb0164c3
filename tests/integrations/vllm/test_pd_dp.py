"""A data-parallel D (``--data-parallel-size 2``) behind KVBridgeConnector in real vLLM.

vLLM runs one engine per DP rank, each with its own connector and agents
(engine id ``<id>_dp<rank>``); its API server spreads requests over them. P's
``kv_transfer_params`` travel in each request, so whichever rank serves it
reads the prompt from P's agents: every answer equals colocated and both of
D's DP engines load through the connector.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations.vllm.client import complete, metric_samples
from tests.integrations.vllm.pd import (
    BLOCK_NBYTES,
    BLOCK_SIZE,
    NUM_NEW_TOKENS,
    TRANSFERS,
    ZERO_CONFIG,
    pd_complete,
    prompt_ids,
    wait_usage,
)
from tests.integrations.vllm.servers import ServersForTest, ServerSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_a_data_parallel_d_loads_on_whichever_rank_serves(
    vllm_servers: ServersForTest, tiny_llama: Path,
) -> None:
    def spec(instance: str, *extra: str) -> ServerSpec:
        return ServerSpec(tiny_llama, dtype="bfloat16", block_size=BLOCK_SIZE,
                          kv_transfer_config=json.dumps(ZERO_CONFIG), extra_args=extra,
                          instance=instance)

    p = vllm_servers.shared(spec("p"))
    d = vllm_servers.private(spec("d-dp2", "--data-parallel-size", "2"))
    for i, num_tokens in enumerate([5, 300, 700, 129, 40, 900]):
        prompt = prompt_ids(num_tokens, seed=90 + i)
        expected = complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids
        result = pd_complete(p.base_url, d.base_url, prompt, expect_transfers=1)
        assert result.completion.token_ids == expected
        assert (result.num_transfers, result.num_failures) == (1, 0)
        assert result.nbytes == -(-(num_tokens - 1) // BLOCK_SIZE) * BLOCK_NBYTES
    by_engine = {s.labels["engine"]: s.value for s in metric_samples(d.base_url, TRANSFERS)}
    assert sorted(by_engine) == ["0", "1"] and all(by_engine.values()), by_engine
    wait_usage(p.base_url)
    wait_usage(d.base_url)
