"""MLA (a tiny DeepSeek-V2) through KVBridgeConnector in real vLLM, homogeneous and mixed TP.

vLLM keeps an MLA layer as one latent per token (``kv_lora_rank`` 512 +
``qk_rope_head_dim`` 64 = 576 elements), ``[blocks, 1, 16, 576]`` on CPU,
replicated on every TP rank. kvbridge moves it as it is: every D rank reads
one replica of each block, spread over the P ranks that hold one.

Three servers, each both P and D, float32: ``a`` and ``b`` at TP 1, ``t`` at
TP 2, started together. The reference is P's own colocated answer (a request without
``kv_transfer_params``). Both flows are checked: the classic one (D computes
the prompt's last token) and the first-token one (``kvbridge proxy``'s: D
continues after P's token, having loaded the whole prompt).

vLLM turns prefix caching (and chunked prefill) off for MLA on CPU: D has no
local prefix hit, so a prompt it saw before is loaded again, whole.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.integrations.vllm.client import complete
from tests.integrations.vllm.conftest import TinyModelFactory
from tests.integrations.vllm.pd import (
    BYTES,
    EXTERNAL_PREFIX_CACHE_HITS,
    FAILURES,
    TRANSFERS,
    ZERO_CONFIG,
    at_once,
    counters,
    pd_complete,
    poll_metrics,
    prefill,
    prompt_ids,
    tp_specs,
    wait_usage,
)
from tests.integrations.vllm.servers import ServersForTest, ServerSpec, VllmServer
from tests.marks import full_only

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MLA_BLOCK_SIZE = 16  # what vLLM's CPU MLA kernel takes (vLLM sets it)
NUM_LAYERS = 3
LATENT_DIM = 576
# per block, whole model: 3 layers x 16 slots x 576 latent x 4 bytes (float32)
MLA_BLOCK_NBYTES = NUM_LAYERS * MLA_BLOCK_SIZE * LATENT_DIM * 4
NUM_NEW_TOKENS = 8
# Across TP sizes the sums of a position run in another order; this random model's
# greedy picks agree for a few tokens (``test_mla_answers_of_tp_2_match_tp_1_colocated``).
TP_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def tiny_deepseek(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("float32", initializer_range=0.02, kind="mla")


def mla_spec(model: Path, tp: int, instance: str) -> ServerSpec:
    """An MLA server on vLLM's reference CPU MLA backend, named: on a CPU with AMX vLLM
    would otherwise pick AMX_MLA (bf16 only, block 128, prefix caching on), and the
    facts these tests rely on (block 16, no prefix cache) would depend on the host."""
    return ServerSpec(model, dtype="float32", block_size=None, tensor_parallel_size=tp,
                      kv_transfer_config=json.dumps(ZERO_CONFIG), instance=instance,
                      extra_args=("--attention-backend", "CPU_MLA"))


def first_token_flow(p: VllmServer, d: VllmServer, prompt: list[int],
                     max_tokens: int = NUM_NEW_TOKENS) -> tuple[list[int], dict[str, float]]:
    """P's token then D's continuation (``kvbridge proxy``'s flow, by hand); D's counter moves."""
    before = counters(d.base_url)
    first = complete(p.base_url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = first.kv_transfer_params
    assert params is not None and params.get("do_remote_prefill"), first.response
    rest = complete(d.base_url, prompt + first.token_ids, max_tokens - 1,
                    kv_transfer_params=params)
    after = poll_metrics(d.base_url, lambda m: (
        m.get(TRANSFERS, 0.0) + m.get(FAILURES, 0.0)
        >= before[TRANSFERS] + before[FAILURES] + 1))
    moved = {name: after.get(name, 0.0) - before[name] for name in before}
    return first.token_ids + rest.token_ids, moved


def num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // MLA_BLOCK_SIZE)


@pytest.fixture
def servers_a_b(vllm_servers: ServersForTest,
                tiny_deepseek: Path) -> tuple[VllmServer, VllmServer]:
    # ``t`` (TP 2) starts with them: the TP tests below use it (three starts at once on
    # two cores take less than two starts after one another)
    a, b, _ = vllm_servers.shared_all(mla_spec(tiny_deepseek, 1, "a"),
                                      mla_spec(tiny_deepseek, 1, "b"),
                                      mla_spec(tiny_deepseek, 2, "t"))
    return a, b


@pytest.mark.parametrize("num_prompt_tokens", [300, *full_only(5, MLA_BLOCK_SIZE)])
def test_mla_first_token_flow_equals_colocated_and_moves_the_latents(
    servers_a_b: tuple[VllmServer, VllmServer], num_prompt_tokens: int
) -> None:
    p, d = servers_a_b
    prompt = prompt_ids(num_prompt_tokens, seed=40)
    expected = complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids
    tokens, moved = first_token_flow(p, d, prompt)
    assert tokens == expected
    assert (moved[TRANSFERS], moved[FAILURES]) == (1, 0)
    assert moved[EXTERNAL_PREFIX_CACHE_HITS] == num_prompt_tokens  # the whole prompt
    assert moved[BYTES] == num_blocks(num_prompt_tokens) * MLA_BLOCK_NBYTES
    wait_usage(p.base_url)
    wait_usage(d.base_url)


@pytest.mark.parametrize("num_prompt_tokens", [MLA_BLOCK_SIZE + 1, *full_only(5, 200)])
def test_mla_classic_flow_loads_all_but_the_last_token(
    servers_a_b: tuple[VllmServer, VllmServer], num_prompt_tokens: int
) -> None:
    """The classic flow moves what it should; its answer is compared with D's own.

    D computes the prompt's last token with vLLM's MLA decode path (the query
    absorbed into the latent), where colocated vLLM used its prefill path (SDPA
    over up-projected K and V): the same sums in another order. On this random
    model the two can pick another greedy token (200 tokens here does), so the
    classic flow is checked for its transfer and for answering the same from
    the same bytes; the first-token flow (D computes with the decode path, as
    colocated vLLM does) is compared with colocated vLLM above.
    """
    p, d = servers_a_b
    prompt = prompt_ids(num_prompt_tokens, seed=41)
    result = pd_complete(p.base_url, d.base_url, prompt, NUM_NEW_TOKENS, expect_transfers=1)
    assert (result.num_transfers, result.num_failures) == (1, 0)
    assert result.external_hits == num_prompt_tokens - 1
    assert result.nbytes == num_blocks(num_prompt_tokens - 1) * MLA_BLOCK_NBYTES
    # no prefix cache for MLA on CPU: the same prompt again is loaded again, whole,
    # and D answers the same from the same bytes
    again = pd_complete(p.base_url, d.base_url, prompt, NUM_NEW_TOKENS, expect_transfers=1)
    assert again.completion.token_ids == result.completion.token_ids
    assert (again.nbytes, again.external_hits) == (result.nbytes, result.external_hits)
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_mla_requests_at_once(servers_a_b: tuple[VllmServer, VllmServer]) -> None:
    """D loads and decodes five requests at once.

    P's prefills run one at a time, so that P's tokens are those of the
    reference (several prompts prefilled in one step may differ in the last
    bit from each alone, and a greedy pick with them).
    """
    p, d = servers_a_b
    prompts = [prompt_ids(n, seed=50 + n) for n in (3, 16, 33, 120, 250)]  # 1 to 16 blocks
    expected = [complete(p.base_url, prompt, NUM_NEW_TOKENS).token_ids for prompt in prompts]
    prefills = [complete(p.base_url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
                for prompt in prompts]
    before = counters(d.base_url)
    rests = at_once([partial(complete, d.base_url, prompt + first.token_ids, NUM_NEW_TOKENS - 1,
                             kv_transfer_params=first.kv_transfer_params)
                     for prompt, first in zip(prompts, prefills, strict=True)])
    assert [first.token_ids + rest.token_ids
            for first, rest in zip(prefills, rests, strict=True)] == expected
    after = poll_metrics(d.base_url, lambda m: m.get(TRANSFERS, 0) >= before[TRANSFERS] + 5)
    assert after[BYTES] - before[BYTES] == sum(
        num_blocks(len(prompt)) for prompt in prompts) * MLA_BLOCK_NBYTES
    wait_usage(p.base_url)
    wait_usage(d.base_url)


def test_mla_with_p_and_d_of_different_tp_sizes(
    vllm_servers: ServersForTest, tiny_deepseek: Path,
) -> None:
    tp1, tp2 = vllm_servers.shared_all(mla_spec(tiny_deepseek, 1, "a"),
                                       mla_spec(tiny_deepseek, 2, "t"))
    for num_tokens in (9, 100):
        prompt = prompt_ids(num_tokens, seed=60)
        expected = complete(tp2.base_url, prompt, TP_NEW_TOKENS).token_ids
        tokens, moved = first_token_flow(tp2, tp1, prompt, TP_NEW_TOKENS)  # P TP 2 -> D TP 1
        assert tokens == expected, "P TP 2 -> D TP 1"
        # one replica read, spread over P's two ranks (layers [0, 2) and [2, 3))
        assert (moved[TRANSFERS], moved[FAILURES]) == (1, 0)
        assert moved[BYTES] == num_blocks(num_tokens) * MLA_BLOCK_NBYTES

        prompt = prompt_ids(num_tokens, seed=61)
        expected = complete(tp1.base_url, prompt, TP_NEW_TOKENS).token_ids
        tokens, moved = first_token_flow(tp1, tp2, prompt, TP_NEW_TOKENS)  # P TP 1 -> D TP 2
        assert tokens == expected, "P TP 1 -> D TP 2"
        # each D rank holds the whole latent: each reads P's one copy
        assert moved[FAILURES] == 0 and moved[TRANSFERS] >= 1
        prompt = prompt_ids(num_tokens, seed=62)  # the classic flow, P TP 2 -> D TP 1
        down = pd_complete(tp2.base_url, tp1.base_url, prompt, expect_transfers=1)
        assert (down.num_transfers, down.num_failures) == (1, 0)
        assert down.nbytes == num_blocks(num_tokens - 1) * MLA_BLOCK_NBYTES
        for server in (tp1, tp2):
            wait_usage(server.base_url)


def test_mla_answers_of_tp_2_match_tp_1_colocated(
    vllm_servers: ServersForTest, tiny_deepseek: Path,
) -> None:
    """The TP test's premise: float32 greedy tokens do not depend on the TP size here."""
    tp1, tp2 = vllm_servers.shared_all(mla_spec(tiny_deepseek, 1, "a"),
                                       mla_spec(tiny_deepseek, 2, "t"))
    for seed in (60, 61, 62):
        prompt = prompt_ids(100, seed=seed)
        assert (complete(tp1.base_url, prompt, TP_NEW_TOKENS).token_ids
                == complete(tp2.base_url, prompt, TP_NEW_TOKENS).token_ids)


def test_mla_p_refuses_a_dense_d(
    vllm_servers: ServersForTest, tiny_deepseek: Path, tiny_llama_fp32: Path,
) -> None:
    """Params of an MLA P sent to a Llama D: refused at the handshake, the log names it."""
    # D: test_pd_tp.py's TP 1 server, started with its TP 2 server (the package runs
    # test_pd_tp.py next: ``conftest.MODULE_ORDER``)
    tp1, tp2 = tp_specs(tiny_llama_fp32)
    p, d, _ = vllm_servers.shared_all(mla_spec(tiny_deepseek, 1, "a"), tp1, tp2)
    prompt = prompt_ids(40, seed=62)
    params = prefill(p.base_url, prompt)
    before = counters(d.base_url)
    try:  # vLLM's default kv_load_failure_policy: fail the request, never answer it
        done = complete(d.base_url, prompt, NUM_NEW_TOKENS, kv_transfer_params=params)
    except httpx.HTTPStatusError as exc:
        assert exc.response.status_code >= 400
    else:
        assert done.finish_reason not in ("length", "stop"), done.response
    poll_metrics(d.base_url, lambda m: m.get(FAILURES, 0) > before[FAILURES])
    log = d.log_path.read_text(errors="replace")
    assert "is_mla: local False != remote True" in log
