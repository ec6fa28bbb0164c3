"""P/D hand-off between two real ``LLMEngine``s: D's answers equal the colocated ones.

Each engine has its own TP worker processes, each worker its ``ConnectorWorker``
and UCX transfer agent (loopback). The test process drives the engines: a
request runs on P with ``max_tokens=1`` and ``do_remote_decode``; the
``kv_transfer_params`` P returns go with the same prompt to D, which loads the
prompt's KV from P and decodes. Four engines cover TP pairs (1,1), (2,1), (1,2)
and (2,2), block sizes 16 -> 32 and 32 -> 16, and NHD <-> HND in both directions;
a fifth fails requests whose load fails (policy ``fail``). Loads are made to fail
with params that name a grant P never issued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from kvbridge.connector.binding import kv_digest
from kvbridge.connector.params import KVTransferParams, params_key, sign_params
from kvbridge.reference.engine.engine import LLMEngine
from kvbridge.reference.engine.engine_config import ConnectorSettings, EngineConfig
from kvbridge.reference.engine.request import FinishReason, RequestOutput, SamplingParams
from kvbridge.topology import KVLayout
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.protocol.cluster_secret import cluster_secret
from tests.ports import free_port_base
from tests.reference.engine.helpers import MICRO
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

FAST = AgentConfig(connect_timeout_s=3.0, handshake_timeout_s=3.0, reply_timeout_s=5.0,
                   chunk_timeout_s=5.0, read_timeout_s=20.0, heartbeat_s=0.5)
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, ignore_eos=True)

#: name -> (tp_size, block_size, layout, load failure policy)
ENGINES = {
    "a": (1, 16, KVLayout.NHD, "recompute"),
    "b": (2, 32, KVLayout.HND, "recompute"),
    "c": (1, 32, KVLayout.HND, "recompute"),
    "d": (2, 16, KVLayout.NHD, "recompute"),
    "f": (1, 16, KVLayout.HND, "fail"),
    "g": (1, 16, KVLayout.NHD, "recompute"),
    "h": (1, 32, KVLayout.HND, "recompute"),
}
#: D engines that copy direct reads of any size out of P's workers (same host)
COPYING = {"g", "h"}
#: (P, D): (1,1) 16->32 NHD->HND; (2,1) 32->16 HND->NHD; (1,2) 16->16; (2,2) 32->16 HND->NHD;
#: (1,1) 16 NHD and (2,1) 32 HND both ways alike: direct, copied by D (local_copy.py)
PAIRS = [("a", "c"), ("b", "a"), ("a", "d"), ("b", "d"), ("a", "g"), ("b", "h")]

LONG = [256, *b"Disaggregated serving moves the KV cache from prefill to decode. " * 2]
PROMPTS: list[list[int]] = [
    [256, *b"tiny"],  # shorter than a block
    [256, *b"A prompt of about one block and a bit"],
    LONG,
]



def make_engine(name: str) -> LLMEngine:
    tp_size, block_size, layout, policy = ENGINES[name]
    agent = msgspec.structs.replace(FAST, local_copy_min_nbytes=0) if name in COPYING else FAST
    connector = ConnectorSettings(engine_id=f"engine-{name}",
                                  transfer_base_port=free_port_base(tp_size), agent=agent,
                                  load_failure_policy=policy)
    return LLMEngine(EngineConfig(model=MICRO, tp_size=tp_size, block_size=block_size,
                                  kv_layout=layout, num_blocks=256, connector=connector,
                                  max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, LLMEngine]]:
    with ThreadPoolExecutor(len(ENGINES)) as pool:  # start-up is mostly process spawn
        futures = {name: pool.submit(make_engine, name) for name in ENGINES}
        started = {}
        try:
            for name, future in futures.items():
                started[name] = future.result()
            yield started
        finally:
            for engine in started.values():
                engine.shutdown()


def colocated(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    with LLMEngine(EngineConfig(model=MICRO, num_blocks=64, in_process=True)) as engine:
        return [o.new_token_ids for o in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return colocated(PROMPTS)


def handoff(p: LLMEngine, d: LLMEngine, prompts: Sequence[Sequence[int]],
            tag: str) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """Prefill ``prompts`` on P (one token each), then decode them on D together."""
    firsts = p.generate(prompts, FIRST, kv_transfer_params=[{"do_remote_decode": True}]
                        * len(prompts))
    for out in firsts:
        assert isinstance(out.kv_transfer_params, KVTransferParams)
        assert out.kv_transfer_params.do_remote_prefill
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt, first in zip(ids, prompts, firsts, strict=True):
        d.add_request(request_id, prompt, GREEDY, first.kv_transfer_params)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    final: dict[str, RequestOutput] = {}

    def all_finished() -> bool:
        for out in d.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
        p.step()  # P collects its readers' reports and frees
        return len(final) == len(ids)

    wait_until(all_finished, 60, interval_s=0.002, message=f"D to finish {ids}",
               describe=lambda _: f"finished {sorted(final)}")
    outs = [final[i] for i in ids]
    return firsts, [dataclasses.replace(o, new_token_ids=tokens[o.request_id]) for o in outs]


def settle(*engines: LLMEngine) -> None:
    """Step until no engine holds blocks for transfers; then every block is free."""

    def settled() -> bool:
        if not any(e.has_pending_transfers() or e.has_unfinished() for e in engines):
            return True
        for engine in engines:
            engine.step()
        return False

    wait_until(settled, 30, interval_s=0.002, message="transfers to settle")
    for engine in engines:
        stats = engine.get_stats()
        assert stats.scheduler.num_free_blocks == stats.scheduler.num_usable_blocks
        assert stats.connector is not None and stats.connector.num_held_blocks == 0


@pytest.mark.parametrize(("p_name", "d_name"), PAIRS)
def test_decode_after_remote_prefill_equals_colocated(
        engines: dict[str, LLMEngine], reference: list[list[int]], p_name: str,
        d_name: str) -> None:
    p, d = engines[p_name], engines[d_name]
    d.manager.reset_prefix_cache()  # no local hits from earlier tests
    before = d.get_stats().connector
    assert before is not None
    firsts, outs = handoff(p, d, PROMPTS, f"{p_name}{d_name}")
    assert [f.new_token_ids[0] for f in firsts] == [r[0] for r in reference]
    assert [o.new_token_ids for o in outs] == reference
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.finish_reason is FinishReason.LENGTH
        # Everything but the last prompt token came from P (no local hits).
        assert out.num_cached_tokens == 0 and out.num_remote_tokens == len(prompt) - 1
    settle(p, d)
    stats = d.get_stats().connector
    assert stats is not None and stats.num_transfers > 0 and stats.nbytes > 0
    num_reads = stats.num_transfers - before.num_transfers
    num_copies = stats.num_local_copies - before.num_local_copies
    assert num_copies == (num_reads if d_name in COPYING else 0), (num_reads, num_copies)


def test_prefix_hits_on_decode(engines: dict[str, LLMEngine]) -> None:
    p, d = engines["b"], engines["a"]  # P blocks of 32, D blocks of 16
    d.manager.reset_prefix_cache()
    shared = LONG[:64]
    partial = [*shared, *b" but this prompt ends differently from the others"]
    expected = colocated([LONG, partial])
    _, (full_first,) = handoff(p, d, [LONG], "hit-0")
    # The same prompt again: D holds all of it but the last (partial) block.
    _, (full_hit,) = handoff(p, d, [LONG], "hit-1")
    assert full_hit.new_token_ids == full_first.new_token_ids == expected[0]
    assert full_hit.num_cached_tokens == (len(LONG) - 1) // 16 * 16
    # A prompt sharing 64 tokens: D loads only what it lacks.
    _, (part,) = handoff(p, d, [partial], "hit-2")
    assert part.new_token_ids == expected[1]
    assert part.num_cached_tokens == 64
    assert part.num_cached_tokens + part.num_remote_tokens in (64, len(partial) - 1)
    settle(p, d)


def test_concurrent_handoffs(engines: dict[str, LLMEngine]) -> None:
    p, d = engines["a"], engines["d"]
    d.manager.reset_prefix_cache()
    prompts = [[256, *f"request number {i}: ".encode(), *b"x" * (i * 5)] for i in range(16)]
    _, outs = handoff(p, d, prompts, "many")
    assert [o.new_token_ids for o in outs] == colocated(prompts)
    settle(p, d)


def forged_params(p: LLMEngine, prompt: Sequence[int]) -> KVTransferParams:
    """Params naming P's real address but a grant P never issued: every read fails.

    Signed with the cluster secret (the zero config's host secret) and bound to
    the prompt, as a buggy P's would be: D plans the load, and P refuses the read.
    """
    settings = p.config.connector
    assert settings is not None
    num_blocks = -(-len(prompt) // p.config.block_size)
    block_ids = list(range(1, num_blocks + 1))
    params = KVTransferParams(
        do_remote_prefill=True, remote_engine_id=settings.engine_id, remote_host=settings.host,
        remote_port=settings.transfer_base_port, remote_block_ids=block_ids,
        remote_tp_size=p.config.tp_size, remote_block_size=p.config.block_size,
        remote_num_tokens=len(prompt), grant="forged-grant-never-issued",
        kv_digest=kv_digest(prompt, block_ids).hex())
    return sign_params(params, params_key(cluster_secret(settings.host)))


def run_on(d: LLMEngine, p: LLMEngine, request_id: str) -> RequestOutput:
    """Step D (and P) until ``request_id`` finishes on D; its output with all tokens."""
    tokens: list[int] = []

    def finished() -> RequestOutput | None:
        for out in d.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
                if out.finished:
                    return dataclasses.replace(out, new_token_ids=tokens)
        p.step()
        return None

    out = wait_until(finished, 60, interval_s=0.002, message=f"{request_id} to finish on D",
                     describe=lambda _: f"{len(tokens)} tokens so far")
    assert out is not None
    return out


def test_failed_load_is_recomputed(engines: dict[str, LLMEngine],
                                   reference: list[list[int]]) -> None:
    p, d = engines["b"], engines["c"]
    d.manager.reset_prefix_cache()
    d.add_request("forged", LONG, GREEDY, forged_params(p, LONG))
    out = run_on(d, p, "forged")
    assert out.new_token_ids == reference[2]
    assert out.num_remote_tokens == 0  # nothing valid arrived: all recomputed
    stats = d.get_stats().connector
    assert stats is not None and stats.num_loads_failed >= 1
    settle(p, d)


def test_failed_load_fails_the_request_with_policy_fail(engines: dict[str, LLMEngine]) -> None:
    p, d = engines["a"], engines["f"]
    d.add_request("doomed", LONG, GREEDY, forged_params(p, LONG))
    out = run_on(d, p, "doomed")
    assert out.finished and out.finish_reason is FinishReason.ERROR
    assert out.error is not None and "doomed" in out.error
    assert out.new_token_ids == []
    settle(p, d)


def test_abort_on_decode_during_the_load_leaks_nothing(
        engines: dict[str, LLMEngine]) -> None:
    p, d = engines["a"], engines["d"]
    d.manager.reset_prefix_cache()
    (first,) = p.generate([LONG], FIRST, kv_transfer_params=[{"do_remote_decode": True}])
    d.add_request("gone", LONG, GREEDY, first.kv_transfer_params)
    assert d.step() == []  # admitted: waits for its KV, the load is dispatched
    assert d.get_stats().scheduler.num_waiting_for_remote_kvs == 1
    assert d.abort_request("gone")
    settle(p, d)


def test_malformed_params_mean_local_prefill(engines: dict[str, LLMEngine],
                                             reference: list[list[int]]) -> None:
    d = engines["c"]
    (out,) = d.generate([PROMPTS[1]], GREEDY,
                        kv_transfer_params=[{"do_remote_prefill": True, "remote_port": "x"}])
    assert out.new_token_ids == reference[1] and out.num_remote_tokens == 0


def test_ended_loads_and_releases_wake_the_engines(engines: dict[str, LLMEngine],
                                                   reference: list[list[int]]) -> None:
    """D's workers wake D when its load ends, P's wake P when the grant is released;
    nothing else sets the flags in between (the test steps by hand, so a ``True``
    from ``wait`` is the workers' doing)."""
    p, d = engines["b"], engines["d"]  # TP 2 on both sides: every rank reports
    d.manager.reset_prefix_cache()
    [first] = p.generate([LONG], FIRST, kv_transfer_params=[{"do_remote_decode": True}])
    p.wakeup.clear()
    d.wakeup.clear()
    d.add_request("wake", LONG, GREEDY, first.kv_transfer_params)
    d.step()  # starts the load on every D rank
    assert d.wakeup.wait(20.0), "no wake-up from D's workers after the load"
    assert p.wakeup.wait(20.0), "no wake-up from P's workers after the readers' reports"
    tokens: list[int] = []

    def decoded() -> bool:
        for out in d.step():
            tokens.extend(out.new_token_ids)
        if d.last_step_num_tokens == 0:  # idle: sleep until a worker wakes the engine
            d.wakeup.clear()
            d.wakeup.wait(0.05)
        return len(tokens) >= MAX_TOKENS

    wait_until(decoded, 60, interval_s=0.0, message="D to finish after its wake-up",
               describe=lambda _: tokens)
    assert tokens == reference[PROMPTS.index(LONG)]
    settle(p, d)
