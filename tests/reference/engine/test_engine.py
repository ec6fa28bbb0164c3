"""End-to-end tests of ``LLMEngine`` and ``AsyncEngine`` on the micro model (colocated).

Most engines run their single TP rank in-process; the TP 2 comparison spawns real
worker processes and is marked ``integration``. Every comparison is greedy output
token for token against a reference engine with a roomy cache and budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest

from kvbridge.errors import ConfigError
from kvbridge.reference.engine.async_engine import AsyncEngine
from kvbridge.reference.engine.engine import InvalidRequestError, LLMEngine
from kvbridge.reference.engine.engine_config import EngineConfig
from kvbridge.reference.engine.request import FinishReason, RequestOutput, SamplingParams
from kvbridge.topology import KVLayout
from tests.reference.engine.helpers import MICRO
from tests.waiting import wait_until_async

PROMPTS: list[list[int]] = [
    [256, *b"short"],
    [256, *b"The quick brown fox jumps over the lazy dog, again and again."],
    [256, *b"0123456789" * 6],
    [256, *b"Paged attention reads keys and values through a block table."],
]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def make_engine(**overrides: object) -> LLMEngine:
    options: dict[str, object] = {"model": MICRO, "num_blocks": 96, "in_process": True}
    options.update(overrides)
    return LLMEngine(EngineConfig(**options))  # type: ignore[arg-type]


def tokens_of(outputs: list[RequestOutput]) -> list[list[int]]:
    assert all(o.finished for o in outputs)
    return [o.new_token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy completions of PROMPTS, each run alone on a roomy engine."""
    with make_engine(enable_prefix_caching=False) as engine:
        return [tokens_of(engine.generate([p], GREEDY))[0] for p in PROMPTS]


@pytest.fixture
def engine() -> Iterator[LLMEngine]:
    with make_engine() as eng:
        yield eng


def test_batched_generation_equals_one_at_a_time(reference: list[list[int]],
                                                 engine: LLMEngine) -> None:
    outputs = engine.generate(PROMPTS, GREEDY)
    assert tokens_of(outputs) == reference
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs)
    assert [o.num_prompt_tokens for o in outputs] == [len(p) for p in PROMPTS]
    assert all(o.ttft_s is not None and o.ttft_s >= 0 for o in outputs)
    stats = engine.get_stats().scheduler
    assert stats.num_free_blocks == stats.num_usable_blocks


def test_sixteen_concurrent_requests_equal_one_at_a_time(reference: list[list[int]]) -> None:
    # Distinct prompts (no prefix sharing) of many lengths, 4 per reference prompt.
    prompts = [p[: len(p) - k] for p in PROMPTS for k in (0, 1, 2, 3)]
    with make_engine(enable_prefix_caching=False, num_blocks=160) as engine:
        alone = [tokens_of(engine.generate([p], GREEDY))[0] for p in prompts]
        together = tokens_of(engine.generate(prompts, GREEDY))
    assert together == alone
    assert alone[::4] == reference


def test_chunked_prefill_equals_unchunked(reference: list[list[int]]) -> None:
    with make_engine(max_num_batched_tokens=7) as engine:
        assert tokens_of(engine.generate(PROMPTS, GREEDY)) == reference


def test_unchunked_engine_equals_reference(reference: list[list[int]]) -> None:
    with make_engine(enable_chunked_prefill=False,
                     max_num_batched_tokens=MICRO.max_model_len) as engine:
        assert tokens_of(engine.generate(PROMPTS, GREEDY)) == reference


def test_prefix_cache_hits_give_the_same_output(reference: list[list[int]],
                                                engine: LLMEngine) -> None:
    engine.generate(PROMPTS[1:3], GREEDY)
    again = engine.generate(PROMPTS[1:3], GREEDY)
    assert tokens_of(again) == reference[1:3]
    assert all(o.num_cached_tokens >= 48 for o in again)  # all full prompt blocks but one
    # A partial hit: same first blocks, different tail.
    variant = PROMPTS[1][:40] + list(b" and a different ending")
    with make_engine(enable_prefix_caching=False) as fresh:
        expected = tokens_of(fresh.generate([variant], GREEDY))
    (hit,) = engine.generate([variant], GREEDY)
    assert hit.num_cached_tokens == 32 and hit.new_token_ids == expected[0]
    assert engine.get_stats().scheduler.prefix_cache_hits > 0


def test_preemption_under_block_pressure_gives_the_same_output(
        reference: list[list[int]]) -> None:
    # MICRO's max_model_len of 256 needs 16 blocks: 17 leave little room for 4 prompts
    # growing by 40 tokens each.
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with make_engine(num_blocks=17, enable_prefix_caching=False) as tight, \
            make_engine(enable_prefix_caching=False) as roomy:
        pressured = tokens_of(tight.generate(PROMPTS, params))
        stats = tight.get_stats().scheduler
        assert pressured == tokens_of(roomy.generate(PROMPTS, params))
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_usable_blocks
    assert [t[:MAX_TOKENS] for t in pressured] == reference


def test_seeded_sampling_is_reproducible_in_any_batch(engine: LLMEngine) -> None:
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234,
                            ignore_eos=True)
    alone = tokens_of(engine.generate([PROMPTS[2]], seeded))
    batched = tokens_of(engine.generate(PROMPTS, seeded))
    assert batched[2] == alone[0]
    other = tokens_of(engine.generate([PROMPTS[2]], msgspec.structs.replace(seeded, seed=99)))
    assert other != alone


def test_text_prompts_are_byte_encoded(engine: LLMEngine) -> None:
    (by_text,) = engine.generate(["short"], GREEDY)
    (by_ids,) = engine.generate([PROMPTS[0]], GREEDY)
    assert by_text.new_token_ids == by_ids.new_token_ids


def test_bad_requests_raise_and_change_nothing(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="non-empty"):
        engine.add_request("empty", [])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("vocab", [1, MICRO.vocab_size])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("long", [1] * MICRO.max_model_len)
    # 16 blocks of 16 tokens leave 15 usable (one is the null block): too few for
    # one max_model_len=256 request, so the engine refuses to start.
    with pytest.raises(ConfigError, match="null block"):
        make_engine(num_blocks=16)
    engine.add_request("dup", [1, 2])
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [3])
    assert engine.abort_request("dup") and not engine.has_unfinished()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_kv_transfer_params_without_a_connector_prefill_locally(
        reference: list[list[int]], engine: LLMEngine) -> None:
    outputs = engine.generate(PROMPTS[:1], GREEDY,
                              kv_transfer_params=[{"do_remote_prefill": True}])
    assert tokens_of(outputs) == reference[:1]
    assert outputs[0].num_remote_tokens == 0 and outputs[0].kv_transfer_params is None


def test_abort_mid_generation_frees_its_blocks(engine: LLMEngine) -> None:
    engine.add_request("a", PROMPTS[2], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    engine.step()
    engine.step()
    assert engine.abort_request("a")
    outputs = [o for _ in range(MAX_TOKENS) for o in engine.step()]
    assert {o.request_id for o in outputs} == {"b"} and outputs[-1].finished
    stats = engine.get_stats().scheduler
    assert stats.num_free_blocks == stats.num_usable_blocks


def test_engine_config_validation() -> None:
    with pytest.raises(ConfigError, match="unknown model"):
        EngineConfig(model="nope")
    with pytest.raises(ConfigError, match="tp_size"):
        EngineConfig(model=MICRO, tp_size=3)
    with pytest.raises(ConfigError, match="max_model_len"):
        EngineConfig(model=MICRO, num_blocks=4).kv_cache_config()
    sized = EngineConfig(model=MICRO, kv_memory_nbytes=4 << 20).kv_cache_config()
    assert sized.num_blocks == (4 << 20) // (2 * 2 * 16 * 8 * 32 * 4)


def test_async_engine_streams_and_aborts(reference: list[list[int]]) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        streamed: list[int] = []
        async for out in engine.generate_stream("s", PROMPTS[1], GREEDY):
            assert len(out.new_token_ids) == 1
            streamed += out.new_token_ids
        assert streamed == reference[1]
        results = await asyncio.gather(*(engine.generate(f"g{i}", p, GREEDY)
                                         for i, p in enumerate(PROMPTS)))
        assert [r.new_token_ids for r in results] == reference
        async for _ in engine.generate_stream("leaver", PROMPTS[2], GREEDY):
            break  # the client goes away: the request is aborted
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate_stream("bad", []):
                pass
        stats = (await wait_until_async(engine.get_stats, 1.0,
                                        until=lambda s: s.scheduler.num_running == 0,
                                        message="the aborted stream to stop")).scheduler
        assert stats.num_free_blocks == stats.num_usable_blocks

    engine = AsyncEngine(EngineConfig(model=MICRO, num_blocks=96, in_process=True))
    try:
        asyncio.run(scenario(engine))
    finally:
        engine.shutdown()
    assert not engine.is_running


@pytest.mark.integration
@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
def test_tp2_equals_tp1(reference: list[list[int]], layout: KVLayout) -> None:
    with make_engine(tp_size=2, in_process=False, kv_layout=layout,
                     max_num_batched_tokens=24) as engine:
        assert tokens_of(engine.generate(PROMPTS, GREEDY)) == reference
