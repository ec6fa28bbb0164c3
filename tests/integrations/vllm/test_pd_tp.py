"""Heterogeneous TP through KVBridgeConnector in real vLLM: P TP 2 -> D TP 1 and P TP 1 -> D TP 2.

Float32 tiny Llama with wide logits (greedy tokens agree between TP 1 and TP 2
colocated, ``test_colocated.py``). Two servers, each both P and D: a TP 1 and a
TP 2 one (``pd.tp_specs``; test_pd_mla.py, run just before, starts them together).
The reference is P's own colocated answer (without the connector's params), asked
before D sees the prompt: D's prefix cache must not hold it.
A D rank reads its heads from every P rank holding them: D TP 1 reads half
its heads from each of P's two ranks (one read, counted once); each rank of
D TP 2 reads its half from P's one rank (two reads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.client import complete
from tests.integrations.vllm.pd import (
    BLOCK_SIZE,
    NUM_NEW_TOKENS,
    TEXT_PROMPTS,
    answers_at_once,
    first_texts,
    kvbridge_proxy,
    pd_complete,
    prompt_ids,
    tp_specs,
    wait_usage,
)
from tests.integrations.vllm.servers import (
    ServersForTest,
    group_pids,
    shm_mapped_by_group,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# per block, whole model: 2 layers x 2 KV heads x 128 slots x (K+V of 32) x 4 bytes
BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 64 * 4


def test_p_and_d_with_different_tp_sizes(
    vllm_servers: ServersForTest, tiny_llama_fp32: Path
) -> None:
    tp1, tp2 = vllm_servers.shared_all(*tp_specs(tiny_llama_fp32))
    for num_tokens in (9, 300, 1100):
        num_blocks = -(-(num_tokens - 1) // BLOCK_SIZE)
        prompt = prompt_ids(num_tokens, seed=20)
        expected = complete(tp2.base_url, prompt, NUM_NEW_TOKENS).token_ids
        down = pd_complete(tp2.base_url, tp1.base_url, prompt, expect_transfers=1)
        assert down.completion.token_ids == expected, "P TP 2 -> D TP 1"
        assert len(down.params["remote_ports"]) == 2 and down.params["remote_tp_size"] == 2
        assert (down.num_transfers, down.num_failures) == (1, 0)
        assert down.nbytes == num_blocks * BLOCK_NBYTES
        assert down.external_hits == num_tokens - 1

        prompt = prompt_ids(num_tokens, seed=21)
        expected = complete(tp1.base_url, prompt, NUM_NEW_TOKENS).token_ids
        up = pd_complete(tp1.base_url, tp2.base_url, prompt, expect_transfers=2)
        assert up.completion.token_ids == expected, "P TP 1 -> D TP 2"
        assert (up.num_transfers, up.num_failures) == (2, 0)
        assert up.nbytes == num_blocks * BLOCK_NBYTES  # each D rank half of every block
        assert up.external_hits == num_tokens - 1
        for server in (tp1, tp2):
            wait_usage(server.base_url)


def test_first_tokens_that_are_half_a_character_through_kvbridge_proxy_p_tp2_d_tp1(
    vllm_servers: ServersForTest, tiny_llama_fp32: Path, tmp_path: Path
) -> None:
    """As issue 28 saw it: P TP 2 -> D TP 1 behind ``kvbridge proxy``, answers
    whose first token is half a UTF-8 character among whole ones, all at once."""
    tp1, tp2 = vllm_servers.shared_all(*tp_specs(tiny_llama_fp32))
    model = str(tp2.spec.model)
    texts = first_texts(tp2.base_url, model, TEXT_PROMPTS)
    split = [prompt for prompt, text in zip(TEXT_PROMPTS, texts, strict=True) if not text]
    whole = [prompt for prompt, text in zip(TEXT_PROMPTS, texts, strict=True) if text]
    assert len(split) >= 3, texts
    prompts = [*split[:3], *whole[:3]]
    expected = answers_at_once(tp2.base_url, model, prompts, NUM_NEW_TOKENS, stream=False)
    with kvbridge_proxy(tp2.base_url, tp1.base_url, tmp_path / "proxy.log") as proxy:
        for stream in (False, True):
            got = answers_at_once(proxy, model, prompts, NUM_NEW_TOKENS, stream=stream)
            for prompt, want, answer in zip(prompts, expected, got, strict=True):
                assert answer == want, (stream, prompt[:40])
    for server in (tp1, tp2):
        wait_usage(server.base_url)


def test_tp2_float32_matches_tp1_colocated_and_stops_clean(
    vllm_servers: ServersForTest, tiny_llama_fp32: Path
) -> None:
    """The premise of the tests above (greedy tokens do not depend on the TP size
    here), asked without ``kv_transfer_params``; then the harness's promise for
    TP 2 (last here: it stops the shared TP 2 server)."""
    tp1, tp2 = vllm_servers.shared_all(*tp_specs(tiny_llama_fp32))
    for num_prompt_tokens in (5, 17, 128, 300, 600):
        prompt = prompt_ids(num_prompt_tokens, seed=2)
        answer_tp1 = complete(tp1.base_url, prompt, NUM_NEW_TOKENS)
        answer_tp2 = complete(tp2.base_url, prompt, NUM_NEW_TOKENS)
        assert answer_tp2.token_ids == answer_tp1.token_ids, f"{num_prompt_tokens} prompt tokens"

    # TP 2 is what leaves /dev/shm files behind: its workers' message queues
    # (multiprocessing's psm_*) and, where the vLLM library loaded for this CPU has
    # the shared-memory all-reduce (_C_AVX512, not _C_AVX2), its buffers (vllm_dist_*),
    # which vLLM never unlinks. Which ones is vLLM's choice on this CPU: stop() must
    # remove whatever the group maps and take every process of the group along.
    # (Only this server's files: other test runs may have servers up meanwhile.)
    assert tp2.pid is not None
    mapped = shm_mapped_by_group(tp2.pid)
    assert mapped, "a TP 2 server maps no /dev/shm file"
    tp2.stop()
    assert group_pids(tp2.pid) == []
    assert [path for path in mapped if path.exists()] == []
