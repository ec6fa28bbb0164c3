"""The vLLM test harness on colocated servers (no KV connector): the baseline P/D tests need.

What later tests lean on is checked here: greedy output of the tiny model is a
function of the prompt alone (repeated, prefix-cached, on a second server), the
metrics parse and count what they claim, and a server that cannot start fails
fast. At TP 2 in float32, and a stopped TP 2 server leaving no processes or
/dev/shm files behind: ``test_pd_tp.py``, on its servers.

The first server test starts test_pd.py's P and D along with the reference (the
package runs that module next: ``conftest.MODULE_ORDER``), three starts at once.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.integrations.vllm.client import (
    CACHE_CONFIG_INFO,
    KV_CACHE_USAGE,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    cache_config,
    complete,
    metrics,
    poll_metrics,
)
from tests.integrations.vllm.pd import pd_spec
from tests.integrations.vllm.servers import ServersForTest, ServerSpec, VllmServerError
from tests.marks import full_only

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK_SIZE = 128
VOCAB_SIZE = 512  # tiny_model.VOCAB_SIZE (not imported: transformers stays out of pytest)
NUM_NEW_TOKENS = 16


def prompt_ids(num_tokens: int, seed: int = 0) -> list[int]:
    """Random token ids without the special tokens 0 (BOS) and 1 (EOS)."""
    rng = random.Random(num_tokens * 1000 + seed)
    return rng.choices(range(2, VOCAB_SIZE), k=num_tokens)


@pytest.fixture
def bf16_spec(tiny_llama: Path) -> ServerSpec:
    return ServerSpec(tiny_llama, dtype="bfloat16", block_size=BLOCK_SIZE)


# First here: it starts (and stops) a server of its own while the pool is empty, so
# it stops none of those the tests below start.
def test_server_that_exits_fails_fast_with_its_log(
    vllm_servers: ServersForTest, tmp_path: Path
) -> None:
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    with pytest.raises(VllmServerError, match=r"exited with .* while starting") as raised:
        vllm_servers.private(ServerSpec(not_a_model), startup_timeout_s=120)
    assert str(not_a_model) in str(raised.value)  # the log's tail is in the message


@pytest.mark.parametrize("num_prompt_tokens", [600, *full_only(5, 128)])
def test_same_prompt_twice_gives_same_tokens(
    vllm_servers: ServersForTest, bf16_spec: ServerSpec, num_prompt_tokens: int
) -> None:
    # test_pd.py's P and D start together with it (three starts on two cores take less
    # than one after the other); P serves the next test here, D runs test_pd.py
    server, _, _ = vllm_servers.shared_all(bf16_spec, pd_spec(bf16_spec.model, "p"),
                                           pd_spec(bf16_spec.model, "d"))
    prompt = prompt_ids(num_prompt_tokens)

    first = complete(server.base_url, prompt, NUM_NEW_TOKENS)
    second = complete(server.base_url, prompt, NUM_NEW_TOKENS)  # full blocks now cached

    assert first.prompt_token_ids == prompt
    assert len(first.token_ids) == NUM_NEW_TOKENS
    assert first.finish_reason == "length"
    assert first.kv_transfer_params is None  # no connector
    assert second.token_ids == first.token_ids
    assert second.text == first.text


def test_second_server_gives_same_tokens(
    vllm_servers: ServersForTest, bf16_spec: ServerSpec
) -> None:
    # the second: test_pd.py's P (shared), its connector idle without kv_transfer_params
    server_a, server_b = vllm_servers.shared_all(bf16_spec, pd_spec(bf16_spec.model, "p"))
    assert server_a.base_url != server_b.base_url

    prompts: list[str | list[int]] = [prompt_ids(n) for n in (5, 128, 600)]
    prompts.append("The prefill server hands its KV cache to the decode server.")
    for prompt in prompts:
        answer_a = complete(server_a.base_url, prompt, NUM_NEW_TOKENS)
        answer_b = complete(server_b.base_url, prompt, NUM_NEW_TOKENS)
        assert answer_b.token_ids == answer_a.token_ids, f"prompt {prompt!r:.60}"
        assert answer_b.text == answer_a.text


def test_metrics_count_prefix_cache_hits_and_blocks_come_back(
    vllm_servers: ServersForTest, bf16_spec: ServerSpec
) -> None:
    server = vllm_servers.shared(bf16_spec)
    config = cache_config(server.base_url)
    assert config["block_size"] == str(BLOCK_SIZE)
    assert config["enable_prefix_caching"] == "True"
    assert int(config["num_gpu_blocks"]) > 0
    prompt = prompt_ids(600, seed=1)  # not sent by any other test: nothing cached yet
    num_cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # full blocks; the last token runs

    before = metrics(server.base_url)
    assert before[CACHE_CONFIG_INFO] == 1.0
    complete(server.base_url, prompt, NUM_NEW_TOKENS)
    middle = poll_metrics(
        server.base_url, lambda m: m[PROMPT_TOKENS] >= before[PROMPT_TOKENS] + len(prompt)
    )
    complete(server.base_url, prompt, NUM_NEW_TOKENS)
    after = poll_metrics(
        server.base_url, lambda m: m[PREFIX_CACHE_QUERIES] >= middle[PREFIX_CACHE_QUERIES] + 1
    )

    assert middle[PREFIX_CACHE_HITS] == before[PREFIX_CACHE_HITS]
    assert middle[PREFIX_CACHE_QUERIES] - before[PREFIX_CACHE_QUERIES] == len(prompt)
    assert after[PREFIX_CACHE_HITS] - middle[PREFIX_CACHE_HITS] == num_cached == 512
    assert after[PREFIX_CACHE_QUERIES] - middle[PREFIX_CACHE_QUERIES] == len(prompt)
    # Finished requests free their blocks; cached-but-unused blocks count as free.
    poll_metrics(server.base_url, lambda m: m[KV_CACHE_USAGE] == 0.0)
