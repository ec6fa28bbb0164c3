"""HeldGrants on its own: P's holds from a finished prefill to the release of its blocks.

``tests/connector/test_scheduler.py`` drives it through ``ConnectorScheduler``;
these tests pin the part's own contract (what it queues, counts and returns).
"""

from __future__ import annotations

import json

from kvbridge.connector.binding import kv_digest
from kvbridge.connector.held_grants import HeldGrants
from kvbridge.connector.params import check_signature, params_key, parse_kv_transfer_params
from kvbridge.topology import EngineTopology, KVLayout
from tests.connector.helpers import NOW, Req

BS = 16


def holder(base_port: int = 7000, max_held_blocks: int | None = None) -> HeldGrants:
    topo = EngineTopology(tp_size=2, pp_size=1, block_size=BS, num_kv_heads=4, is_mla=False,
                          layout=KVLayout.HND, num_layers=2)
    return HeldGrants("me", "10.0.0.2", base_port, topo, BS, lease_s=30.0, clock=lambda: NOW,
                      max_held_blocks=max_held_blocks)


def test_hold_queues_a_grant_for_the_prompt_blocks_until_release() -> None:
    grants = holder()
    prompt = list(range(40))
    params = grants.hold(Req("r", prompt), [5, 6, 7, 8])  # 40 tokens fill 3 blocks of 16
    assert params is not None
    assert (params.remote_block_ids, params.remote_num_tokens) == ([5, 6, 7], 40)
    assert (params.remote_engine_id, params.remote_host, params.remote_port) == (
        "me", "10.0.0.2", 7000)
    assert (params.remote_tp_size, params.remote_block_size) == (2, BS)
    assert params.expires_at == NOW + 30.0 and params.do_remote_prefill
    sends, releases = grants.dispatch()
    assert releases == [] and len(sends) == 1
    assert (sends[0].request_id, sends[0].block_ids, sends[0].grant) == ("r", [5, 6, 7],
                                                                         params.grant)
    assert sends[0].kv_digest == kv_digest(prompt, [5, 6, 7])
    assert grants.dispatch() == ([], [])
    assert (grants.num_held_blocks, grants.num_held_requests, grants.num_issued) == (3, 1, 1)
    assert grants.has_pending_work()  # held blocks end only through worker outputs

    assert grants.revoke("r") and not grants.revoke("other")
    assert grants.dispatch() == ([], ["r"])
    grants.release("r")
    grants.release("r")  # reported twice: released once
    assert (grants.num_held_blocks, grants.num_held_requests, grants.num_released) == (0, 0, 1)
    assert not grants.has_pending_work()


def test_hold_serves_nothing_without_two_tokens_or_known_ports() -> None:
    assert holder().hold(Req("one", [7]), [5]) is None  # D recomputes the only token
    unported = holder(base_port=0)
    assert unported.hold(Req("r", list(range(20))), [5, 6]) is None
    assert unported.num_issued == 0 and unported.dispatch() == ([], [])
    unported.set_ports([7100, 7101])
    params = unported.hold(Req("r", list(range(20))), [5, 6])
    assert params is not None
    assert (params.remote_port, params.remote_ports) == (7100, [7100, 7101])


def test_hold_refuses_blocks_that_cannot_be_bound_to_the_prompt() -> None:
    grants = holder()
    assert grants.hold(Req("r", list(range(20))), [-1, 6]) is None
    assert grants.num_issued == 0 and not grants.has_pending_work()


def test_at_the_cap_the_oldest_holds_are_revoked_first() -> None:
    grants = holder(max_held_blocks=8)
    prompt = list(range(48))  # 3 blocks each
    for rid in ("a", "b"):
        assert grants.hold(Req(rid, prompt), [1, 2, 3]) is not None
    grants.dispatch()
    assert grants.hold(Req("c", prompt), [4, 5, 6]) is not None  # 9 > 8: "a" goes
    assert grants.dispatch()[1] == ["a"]
    assert grants.num_evicted == 1 and grants.num_held_blocks == 9  # until "a" is released
    grants.release("a")
    assert grants.hold(Req("d", prompt), [7, 8, 9]) is not None  # "b" goes, "c" is new
    assert grants.dispatch()[1] == ["b"]
    assert grants.revoke("b") and grants.dispatch()[1] == []  # asked once only
    assert grants.num_evicted == 2


def test_a_hold_that_cannot_fit_under_the_cap_is_not_made() -> None:
    grants = holder(max_held_blocks=4)
    prompt = list(range(80))
    assert grants.hold(Req("big", prompt), [1, 2, 3, 4, 5]) is None  # 5 blocks > 4
    assert grants.hold(Req("a", prompt[:48]), [1, 2, 3]) is not None
    # "a" is not dispatched yet (a revocation would reach the workers before its grant)
    assert grants.hold(Req("b", prompt[:48]), [4, 5, 6]) is None
    sends, releases = grants.dispatch()
    assert ([send.request_id for send in sends], releases) == (["a"], [])
    assert (grants.num_held_requests, grants.num_evicted) == (1, 0)
    assert grants.hold(Req("c", prompt[:48]), [4, 5, 6]) is not None  # now "a" may go
    assert grants.dispatch()[1] == ["a"]


def serde_json_float(text: str) -> float:
    """A float read as serde_json (Rust; vllm-router) reads it without its
    ``float_roundtrip`` feature: all digits as one integer, made a float (rounded
    past 2**53), then scaled by a power of ten (rounded again)."""
    mantissa, _, exponent = text.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    scale = int(exponent or 0) - len(fraction)
    value = float(int(whole + fraction))
    return value * 10.0 ** scale if scale >= 0 else value / 10.0 ** -scale


def test_params_still_verify_after_a_router_reads_and_rewrites_them() -> None:
    """vllm-router parses P's answer and writes D's request anew: with expires_at at
    full float precision, about 1 in 9 came back 1 ULP off and D refused them as
    bad_signature. P's expires_at is whole seconds, which every JSON parser reads exactly."""
    key = params_key(b"s" * 32)
    changed = 0
    for i in range(200):
        now = NOW + i * 0.7071067811865476  # clocks with all 17 digits in play
        changed += serde_json_float(repr(now + 30.0)) != now + 30.0
        grants = HeldGrants("me", "10.0.0.2", 7000, holder().topology, BS, lease_s=30.0,
                            clock=lambda now=now: now, params_key=key)
        params = grants.hold(Req(f"r{i}", list(range(40))), [5, 6, 7])
        assert params is not None and params.expires_at is not None
        assert now + 29.0 < params.expires_at <= now + 30.0
        relayed = json.loads(json.dumps(params.to_json_dict()), parse_float=serde_json_float)
        parsed = parse_kv_transfer_params(json.loads(json.dumps(relayed)))
        assert parsed is not None and check_signature(parsed, key) is None, params.expires_at
    assert changed > 10  # the premise: such a router changes full-precision floats
