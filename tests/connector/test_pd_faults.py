"""Aborts, failed loads and bad params across real P and D processes: nothing leaks.

Leases on P are long (30 s) unless a test is about expiry, and every test waits
far less than that for P to free, so a release seen here came from a reader's
report or notice, not from the lease running out.
"""

from __future__ import annotations

import secrets

import pytest

from tests.connector.engine_proc import EngineHost, EngineRef
from tests.connector.harness import EngineSpec
from tests.connector.pd import decode, engine, finish, prefill, prompt
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def wait_stat(e: EngineRef, name: str, value: int, timeout_s: float = 10.0) -> None:
    wait_until(lambda: getattr(e.call("stats"), name), timeout_s, interval_s=0.01,
               until=lambda now: now == value, message=f"{e.name}: {name} to reach {value}")


def test_abort_on_p_before_finish_frees_everything(hosts: tuple[EngineHost, EngineHost]) -> None:
    p = engine(hosts[0], EngineSpec("p-abort"))
    try:
        p.add("endless", prompt(50, seed=1), {"do_remote_decode": True}, max_tokens=10**6)
        p.wait_status("endless", {"running"})
        p.call("abort", "endless")
        status = p.status("endless")
        assert status["status"] == "aborted" and status["params"] is None
        finish(p, timeout_s=5.0)
        assert p.call("stats").num_grants_issued == 0
    finally:
        p.close()


def test_abort_on_d_before_its_load_tells_p_to_free(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    p, d = engine(hosts[0], EngineSpec("p-dabort", tp_size=2)), engine(hosts[1],
                                                                      EngineSpec("d-dabort"))
    try:
        tokens = prompt(60, seed=2)
        params = prefill(p, "r", tokens)
        d.add("r", tokens, params, paused=True)  # never scheduled
        d.call("abort", "r")
        finish(p, d, timeout_s=10.0)  # P's lease is 30 s: the notice freed it
        assert d.status("r")["num_computed_here"] == 0
    finally:
        p.close()
        d.close()


def test_abort_on_d_during_its_load_waits_for_the_load_then_frees(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    # P hands out params but then stops stepping, so its workers have not issued
    # the grant yet: P's agent holds D's read until it is (grant_wait_s).
    p = engine(hosts[0], EngineSpec("p-dabort2", agent={"grant_wait_s": 20.0}))
    d = engine(hosts[1], EngineSpec("d-dabort2", tp_size=2, agent={"reply_timeout_s": 20.0}))
    try:
        tokens = prompt(80, seed=3)
        p.call("freeze_on_handout", True)
        params = prefill(p, "r", tokens)
        d.add("r", tokens, params)
        wait_stat(d, "num_loads_in_flight", 1)
        d.call("abort", "r")
        status = d.status("r")
        assert status["status"] == "aborted" and status["delayed"], status  # blocks kept
        assert d.call("free_blocks")[0] < d.call("free_blocks")[1]
        p.call("freeze", False)  # grant issued: the read completes, then D frees
        finish(p, d, timeout_s=10.0)
        status = d.status("r")
        assert status["ready_ok"] is None and status["num_computed_here"] == 0
        assert d.call("stats").num_transfers == 2  # both D ranks read; nothing was exposed
    finally:
        p.close()
        d.close()


def test_failed_load_recomputes_the_same_kv(hosts: tuple[EngineHost, EngineHost]) -> None:
    # short lease: the real grant is never used and must expire on P
    p = engine(hosts[0], EngineSpec("p-fail", block_size=32, lease_s=1.5,
                                    agent={"grant_wait_s": 0.3}))
    d = engine(hosts[1], EngineSpec("d-fail", tp_size=2, block_size=16))
    try:
        shared = prompt(100, seed=4)
        d.add("warm", shared[:40])  # D holds tokens [0, 32) locally
        d.wait_status("warm", {"finished"})
        params = prefill(p, "r", shared)
        params["grant"] = secrets.token_urlsafe(16)  # P never issued this one
        status = decode(d, "r", shared, params)  # KV checked against the prompt's
        assert status["num_local"] == 32 and status["num_external"] == len(shared) - 1 - 32
        # the load failed, so D rolled back to its first bad block (= the end of
        # its local hit) and computed everything after it
        assert status["ready_ok"] is True
        assert status["num_computed_here"] == len(shared) - 32 + 1
        stats = d.call("stats")
        assert (stats.num_loads_failed, stats.num_failures, stats.num_transfers) == (1, 2, 0)
        finish(p, d, timeout_s=10.0)
    finally:
        p.close()
        d.close()


def test_dead_prefill_engine_fails_the_load_and_d_recomputes(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    p = engine(hosts[0], EngineSpec("p-dead"))
    d = engine(hosts[1], EngineSpec("d-dead"))
    try:
        tokens = prompt(45, seed=5)
        params = prefill(p, "r", tokens)
        p.close()  # P's agents are gone before D reads
        status = decode(d, "r", tokens, params)
        assert status["num_computed_here"] == len(tokens) + 1
        assert d.call("stats").num_loads_failed == 1
        finish(d)
    finally:
        d.close()


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True},  # nothing to read from
        {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
         "remote_port": "5600", "remote_block_ids": [1], "remote_block_size": 16,
         "remote_num_tokens": 10, "grant": "x" * 22},  # port as a string
        "not a dict",
    ],
)
def test_malformed_params_prefill_locally(
    hosts: tuple[EngineHost, EngineHost], params: object
) -> None:
    d = engine(hosts[1], EngineSpec(f"d-bad-{secrets.token_hex(3)}"))
    try:
        tokens = prompt(30, seed=6)
        status = decode(d, "r", tokens, params)
        assert (status["num_external"], status["num_computed_here"]) == (0, len(tokens) + 1)
        finish(d)
    finally:
        d.close()


def test_params_of_another_prompt_are_refused_and_d_caches_only_its_own_kv(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    """D refuses params P issued for another prompt before reading (their ``kv_digest``);
    P's agent would refuse the read too (``binding.py``)."""
    p = engine(hosts[0], EngineSpec("p-bind", tp_size=2))
    d = engine(hosts[1], EngineSpec("d-bind", block_size=32))
    try:
        victim, attacker = prompt(80, seed=7), prompt(80, seed=8)
        params = prefill(p, "attacker", attacker)
        status = decode(d, "victim", victim, params)  # KV checked against victim's own
        assert status["ready_ok"] is None  # no load at all: computed here
        assert status["num_computed_here"] == len(victim) + 1
        stats = d.call("stats")
        assert (stats.num_loads_failed, stats.num_transfers, stats.nbytes,
                stats.num_params_refused) == (0, 0, 0, 1)
        # the victim's blocks in D's prefix cache hold the victim's KV: a later
        # request hits them and its whole KV is still right
        again = decode(d, "again", victim, prefill(p, "honest", victim))
        assert again["num_local"] == 64 and again["ready_ok"] is True
        finish(p, d, timeout_s=10.0)  # the refused grant was given back, not left to expire
    finally:
        p.close()
        d.close()
