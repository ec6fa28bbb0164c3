"""P/D hand-off through the real connector: two processes, real managers, real UCX.

The prefill engines live in one child process and the decode engines in
another, each a ``MiniEngine`` (real ``KVCacheManager``, ``ConnectorScheduler``,
one ``ConnectorWorker`` + transfer agent per TP rank) stepped by its own loop
thread. A request goes to P with ``do_remote_decode``; the params P returns go
to D, which loads the prompt's KV and computes only what it must. Every check
compares D's cache with the KV the prompt must produce (the same function P
used), and every test ends with both engines holding no block.
"""

from __future__ import annotations

import pytest

from tests.connector.engine_proc import EngineHost
from tests.connector.harness import EngineSpec
from tests.connector.pd import decode, engine, finish, prefill, prompt

pytestmark = pytest.mark.integration


PAIRS = {
    # P -> D: TP sizes, block sizes, layouts, host-buffer staging
    "tp1_to_tp1": (EngineSpec("p11", tp_size=1), EngineSpec("d11", tp_size=1)),
    "tp2_to_tp1_bigger_blocks_hnd": (
        EngineSpec("p21", tp_size=2, block_size=16, layout="NHD"),
        EngineSpec("d21", tp_size=1, block_size=32, layout="HND")),
    "tp1_to_tp2_smaller_blocks_host_buffer": (
        EngineSpec("p12", tp_size=1, block_size=32, layout="HND", host_buffer=True),
        EngineSpec("d12", tp_size=2, block_size=16, layout="NHD", host_buffer=True)),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_concurrent_handoffs_land_exactly_the_prompt_kv(
    hosts: tuple[EngineHost, EngineHost], name: str
) -> None:
    p_spec, d_spec = PAIRS[name]
    p, d = engine(hosts[0], p_spec), engine(hosts[1], d_spec)
    try:
        # below one block, several blocks, a partial last block of each size
        lengths = {"short": 5, "mid": 40, "long": 97}
        prompts = {rid: prompt(n, seed) for seed, (rid, n) in enumerate(lengths.items())}
        for rid, tokens in prompts.items():
            p.add(rid, tokens, {"do_remote_decode": True})
        params = {rid: p.wait_status(rid, {"finished"})["params"] for rid in prompts}
        for rid, tokens in prompts.items():
            assert params[rid]["remote_num_tokens"] == len(tokens)
            d.add(rid, tokens, params[rid], max_tokens=2)
        for rid, tokens in prompts.items():
            status = d.wait_status(rid, {"finished"})
            assert status["final_ok"] is True
            assert status["ready_ok"] is True
            # D loaded all but the last prompt token, then computed it and one decode step
            assert status["num_external"] == len(tokens) - 1
            assert status["num_computed_here"] == 2
        stats = d.call("stats")
        assert stats.num_transfers == len(prompts) * d_spec.tp_size
        assert stats.num_failures == 0 and stats.nbytes > 0
        finish(p, d, timeout_s=10.0)  # well before P's 30 s lease: readers released it
        assert p.call("stats").num_grants_released == len(prompts)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize(("p_block_size", "d_block_size"), [(16, 16), (32, 16)])
def test_local_prefix_hits_on_d_are_not_read_again(
    hosts: tuple[EngineHost, EngineHost], p_block_size: int, d_block_size: int
) -> None:
    p = engine(hosts[0], EngineSpec(f"p-hit{p_block_size}", tp_size=2, block_size=p_block_size))
    # one remote block per chunk: the skipped tokens are in the first chunk only
    d = engine(hosts[1], EngineSpec(f"d-hit{p_block_size}", layout="HND",
                                    block_size=d_block_size, agent={"chunk_nbytes": 1}))
    try:
        shared = prompt(120, seed=42)
        d.add("warm", shared[:56])  # a local request leaves 48 tokens in D's prefix cache
        assert d.wait_status("warm", {"finished"})["final_ok"] is True
        cases = {  # prompt length -> D's local hit
            "none": (prompt(70, seed=43), 0),
            "partial": (shared[:90], 48),
            "full": (shared[:49], 48),  # the hit ends at the last prompt token
            "below_one_block": (shared[:9], 0),
        }
        for rid, (tokens, num_hit) in cases.items():
            params = prefill(p, rid, tokens)
            status = decode(d, rid, tokens, params)
            assert status["num_local"] == num_hit, rid
            # loaded: everything between the hit and the last prompt token
            assert status["num_external"] == len(tokens) - 1 - num_hit, rid
            assert status["num_computed_here"] == 2, rid  # last prompt token + one decode
            assert status["ready_ok"] is (None if rid == "full" else True), rid
        stats = d.call("stats")
        assert stats.num_local_hits_skipped == 1
        assert stats.num_loads_started == len(cases) - 1
        # P frees the fully hit request on D's notice, not after its 30 s lease
        finish(p, d, timeout_s=10.0)
        assert p.call("stats").num_grants_released == len(cases)
    finally:
        p.close()
        d.close()
