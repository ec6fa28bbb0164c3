"""Scheduler tests on the real ``KVCacheManager``, without a model.

A stand-in "model" picks each next token as a hash of the whole context, so a
request recomputed after preemption (or split into chunks) must produce the same
tokens as one that ran straight through: exactly what a real model does under
greedy sampling. Every step is also checked against the worker-side limits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ConfigError
from kvbridge.reference.engine.request import (
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from kvbridge.reference.engine.runner import StepLimits
from kvbridge.reference.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvbridge.reference.paged.hashing import BlockHasher
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvbridge.reference.paged.manager import KVCacheManager
from kvbridge.reference.paged.spec import FullAttentionSpec

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
EOS = 300
VOCAB = 301


def make_scheduler(num_blocks: int = 64, *, max_num_seqs: int = 8, budget: int = 32,
                   chunked: bool = True) -> Scheduler:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=2,
                             dtype=__import__("torch").float32)
    config = KVCacheConfig(num_blocks, (KVCacheTensor(spec.page_size_bytes * num_blocks,
                                                      ("l0",)),),
                           (KVCacheGroupSpec(("l0",), spec),))
    hasher = BlockHasher("sha256", b"test", BLOCK_SIZE)
    manager = KVCacheManager(config, MAX_MODEL_LEN, hasher, log_stats=True)
    sched_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                   max_model_len=MAX_MODEL_LEN, eos_token_id=EOS,
                                   enable_chunked_prefill=chunked)
    return Scheduler(sched_config, manager, clock=iter(range(10**6)).__next__)


def add(sched: Scheduler, request_id: str, prompt: Sequence[int], max_tokens: int = 4,
        ignore_eos: bool = True) -> EngineRequest:
    request = EngineRequest(request_id, prompt,
                            SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                            sched.manager.hasher, 0.0)
    sched.add_request(request)
    return request


def next_token(context: Sequence[int]) -> int:
    """The stand-in model: a token determined by the whole context."""
    digest = hashlib.sha256(repr(list(context)).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 256


class Driver:
    """Runs steps and keeps every request's context as the 'model' saw it."""

    def __init__(self, sched: Scheduler, eos_at: dict[str, int] | None = None) -> None:
        self.sched = sched
        self.ends: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, RequestOutput] = {}
        self.steps: list[SchedulerOutput] = []
        self.eos_at = eos_at or {}
        limits = StepLimits(num_blocks=sched.manager.kv_cache_config.num_blocks,
                            block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                            vocab_size=VOCAB, max_num_reqs=sched.config.max_num_seqs,
                            max_num_batched_tokens=sched.config.max_num_batched_tokens)
        self.limits = limits

    def step(self) -> list[RequestOutput]:
        out = self.sched.schedule()
        self.steps.append(out)
        self.limits.check(out.step_batch())
        sampled = []
        for s in out.scheduled:
            request = self.sched.requests[s.req_id]
            if s.is_new:  # admitted: starts at a prefix-cache hit (whole blocks) or 0
                assert s.start_pos % BLOCK_SIZE == 0, (s.req_id, s.start_pos)
            else:  # continues exactly where its previous step ended
                assert s.start_pos == self.ends[s.req_id], (s.req_id, s.start_pos)
            end = s.start_pos + len(s.token_ids)
            self.ends[s.req_id] = end
            assert s.token_ids == list(request.all_token_ids[s.start_pos:end])
            assert s.sample == (end == request.num_tokens)
            if s.sample:
                n = len(self.tokens.get(s.req_id, []))
                eos = self.eos_at.get(s.req_id) == n
                sampled.append(EOS if eos else next_token(request.all_token_ids[:end]))
        outputs = self.sched.update_from_output(out, sampled)
        for o in outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finished[o.request_id] = o
        return outputs

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
            self.sched.manager.check_integrity()
        raise AssertionError("requests did not finish")


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    sched = make_scheduler(budget=16)
    prompt = list(range(1, 41))
    add(sched, "long", prompt, max_tokens=2)
    driver = Driver(sched)
    driver.run()
    chunks = [(s.start_pos, len(s.token_ids), s.sample) for out in driver.steps
              for s in out.scheduled]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]
    assert driver.finished["long"].finish_reason is FinishReason.LENGTH
    assert sched.manager.num_free_blocks == sched.manager.num_usable_blocks


def test_running_requests_come_first_and_waiting_ones_fill_the_budget() -> None:
    sched = make_scheduler(budget=10)
    add(sched, "a", list(range(1, 9)), max_tokens=5)
    driver = Driver(sched)
    driver.step()  # a: prefill 8
    add(sched, "b", list(range(20, 40)), max_tokens=2)
    driver.step()
    out = driver.steps[-1]
    assert [(s.req_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_scheduled_tokens == 10


def test_chunked_prefill_gives_the_same_tokens_as_one_shot() -> None:
    prompts = {f"r{i}": [i + 1] * (5 + 7 * i) for i in range(5)}
    results = []
    for budget, chunked in ((64, False), (5, True), (13, True)):
        sched = make_scheduler(budget=budget, chunked=chunked)
        for rid, p in prompts.items():
            add(sched, rid, p, max_tokens=6)
        driver = Driver(sched)
        driver.run()
        results.append(driver.tokens)
    assert results[0] == results[1] == results[2]


def test_prefix_hits_skip_cached_tokens() -> None:
    sched = make_scheduler()
    shared = list(range(1, 14))  # 13 tokens: 3 full blocks
    add(sched, "first", shared + [100], max_tokens=2)
    driver = Driver(sched)
    driver.run()
    add(sched, "second", shared + [200, 201], max_tokens=2)
    driver.step()
    (scheduled,) = driver.steps[-1].scheduled
    assert scheduled.start_pos == 12 and scheduled.token_ids == [13, 200, 201]
    driver.run()
    assert driver.finished["second"].num_cached_tokens == 12
    # The tokens equal those of a run without the cache.
    fresh = make_scheduler()
    add(fresh, "second", shared + [200, 201], max_tokens=2)
    other = Driver(fresh)
    other.run()
    assert other.tokens["second"] == driver.tokens["second"]
    assert sched.get_stats().prefix_cache_hits == 12


def test_a_full_prompt_hit_still_recomputes_the_last_token() -> None:
    sched = make_scheduler()
    prompt = list(range(1, 13))  # exactly 3 blocks
    add(sched, "a", prompt, max_tokens=1)
    driver = Driver(sched)
    driver.run()
    add(sched, "b", prompt, max_tokens=1)
    driver.step()
    (scheduled,) = driver.steps[-1].scheduled
    assert scheduled.start_pos == 8 and scheduled.sample  # last block recomputed
    assert driver.tokens["a"] == driver.tokens["b"]


def test_preemption_under_block_pressure_returns_every_block() -> None:
    prompts = {f"r{i}": [10 + i] * (6 + 3 * i) for i in range(6)}
    sched = make_scheduler(num_blocks=17, budget=32)  # 16 usable, MAX_MODEL_LEN needs 16
    for rid, p in prompts.items():
        add(sched, rid, p, max_tokens=20)
    driver = Driver(sched)
    driver.run()
    preempted = set().union(*(out.preempted_req_ids for out in driver.steps))
    assert preempted, "the test must create block pressure"
    assert sched.get_stats().num_preemptions >= len(preempted)
    assert sched.manager.num_free_blocks == sched.manager.num_usable_blocks
    roomy = make_scheduler(num_blocks=200)
    for rid, p in prompts.items():
        add(roomy, rid, p, max_tokens=20)
    reference = Driver(roomy)
    reference.run()
    assert not any(out.preempted_req_ids for out in reference.steps)
    assert driver.tokens == reference.tokens
    # A preempted request restarts from its prefix (recompute), marked new.
    for rid in preempted:
        restarts = [s for out in driver.steps for s in out.scheduled
                    if s.req_id == rid and s.is_new]
        assert len(restarts) >= 2


def test_limits_max_num_seqs_and_budget() -> None:
    sched = make_scheduler(max_num_seqs=3, budget=8)
    for i in range(7):
        add(sched, f"r{i}", [i + 1] * 5, max_tokens=3)
    driver = Driver(sched)
    driver.run()
    for out in driver.steps:
        assert len(out.scheduled) <= 3 and out.num_scheduled_tokens <= 8
    assert len(driver.finished) == 7


def test_stop_conditions() -> None:
    sched = make_scheduler()
    add(sched, "eos", [1, 2, 3], max_tokens=10, ignore_eos=False)
    add(sched, "ignore", [1, 2, 3], max_tokens=4, ignore_eos=True)
    add(sched, "long", [5] * 60, max_tokens=10)  # hits MAX_MODEL_LEN first
    driver = Driver(sched, eos_at={"eos": 2, "ignore": 1})
    driver.run()
    assert driver.tokens["eos"][-1] == EOS and len(driver.tokens["eos"]) == 3
    assert driver.finished["eos"].finish_reason is FinishReason.STOP
    assert len(driver.tokens["ignore"]) == 4 and EOS in driver.tokens["ignore"]
    assert driver.finished["ignore"].finish_reason is FinishReason.LENGTH
    assert len(driver.tokens["long"]) == MAX_MODEL_LEN - 60


def test_abort_frees_blocks_and_reports_nothing() -> None:
    sched = make_scheduler()
    add(sched, "run", list(range(1, 20)), max_tokens=10)
    add(sched, "wait", list(range(1, 5)), max_tokens=10)
    driver = Driver(sched)
    driver.step()
    assert sched.abort_request("run") and sched.abort_request("wait")
    assert not sched.abort_request("run") and not sched.abort_request("unknown")
    assert not sched.has_unfinished()
    assert sched.manager.num_free_blocks == sched.manager.num_usable_blocks
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"} and not out.scheduled
    assert sched.update_from_output(out, []) == []


def test_duplicate_id_and_mismatched_tokens_raise() -> None:
    sched = make_scheduler()
    add(sched, "a", [1, 2])
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "a", [3])
    out = sched.schedule()
    with pytest.raises(ValueError, match="0 sampled tokens for 1"):
        sched.update_from_output(out, [])


def test_a_request_larger_than_the_cache_fails_alone() -> None:
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks = 16 tokens
    add(sched, "huge", list(range(1, 30)))
    add(sched, "fine", [1, 2, 3], max_tokens=2)
    driver = Driver(sched)
    driver.run()
    assert driver.finished["huge"].finish_reason is FinishReason.ERROR
    assert "blocks" in (driver.finished["huge"].error or "")
    assert driver.finished["fine"].finish_reason is FinishReason.LENGTH


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8, max_model_len=8,
                        eos_token_id=0)
    with pytest.raises(ConfigError, match="chunked"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16,
                        eos_token_id=0, enable_chunked_prefill=False)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    max_tokens=st.integers(1, 20),
    num_blocks=st.integers(17, 40),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    shared=st.booleans(),
)
def test_any_schedule_gives_the_unconstrained_tokens(
    lengths: list[int], max_tokens: int, num_blocks: int, budget: int, max_num_seqs: int,
    shared: bool,
) -> None:
    prompts = {f"r{i}": ([7] * n if shared else [i + 1] * n) for i, n in enumerate(lengths)}
    sched = make_scheduler(num_blocks, max_num_seqs=max_num_seqs, budget=budget)
    roomy = make_scheduler(400, max_num_seqs=16, budget=64)
    for s in (sched, roomy):
        for rid, p in prompts.items():
            add(s, rid, p, max_tokens=max_tokens)
    driver, reference = Driver(sched), Driver(roomy)
    driver.run()
    reference.run()
    assert driver.tokens == reference.tokens
    assert sched.manager.num_free_blocks == sched.manager.num_usable_blocks
