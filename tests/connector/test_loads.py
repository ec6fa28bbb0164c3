"""RemoteLoads on its own: D's loads from planning to finish, and requests that end early.

``tests/connector/test_scheduler.py`` drives it through ``ConnectorScheduler``
with a real ``KVCacheManager``; these tests pin the part's own contract.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from kvbridge.connector.held_grants import HeldGrants
from kvbridge.connector.loads import LoadEnd, RemoteLoads
from kvbridge.connector.params import (
    KVTransferParams,
    check_signature,
    params_key,
    parse_kv_transfer_params,
    sign_params,
)
from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from tests.connector.helpers import NOW, Req

BS = 16


@dataclass(frozen=True)
class Blocks:
    """A request's blocks per KV cache group, as ``BlockIds``."""

    groups: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def remote(num_tokens: int, **changes: object) -> KVTransferParams:
    fields: dict[str, object] = {
        "do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "10.0.0.1",
        "remote_port": 5600, "remote_block_ids": list(range(100, 100 + -(-num_tokens // BS))),
        "remote_block_size": BS, "remote_num_tokens": num_tokens, "grant": "g" * 22,
        "expires_at": NOW + 10,
    }
    fields.update(changes)
    return KVTransferParams(**fields)  # type: ignore[arg-type]


def loads(may_load: bool = True) -> RemoteLoads:
    return RemoteLoads(BS, may_load=may_load, clock=lambda: NOW)


def test_a_load_from_plan_to_a_failed_finish() -> None:
    d = loads()
    req = Req("r", list(range(40)), remote(40))
    # local hit 16; the last prompt token is recomputed: load [16, 39)
    assert d.plan(req, 16) == (23, True)
    assert d.plan(req, 16) == (23, True)  # asked again before allocation: same answer
    assert d.state("r") == "planned"
    d.record_allocation(req, Blocks(([1, 2, 3],)), 23)
    assert d.state("r") == "allocated"
    recvs, notices = d.dispatch()
    assert notices == [] and len(recvs) == 1
    assert (recvs[0].local_block_ids, recvs[0].first_token, recvs[0].num_tokens) == (
        [1, 2, 3], 16, 23)
    assert d.state("r") == "dispatched" and d.num_in_flight == 1 and d.num_started == 1
    assert d.dispatch() == ([], [])
    assert d.plan(req, 16) == (0, False)  # loaded at most once

    d.mark_invalid([3, 99])  # 99 belongs to no load: logged, ignored
    end = d.finish("r")
    assert end == LoadEnd(False, (1, 2, 3), frozenset({3}))
    assert end.first_bad_token(16) == 32 and end.first_bad_token(16, [2]) == 16
    assert d.finish("r") is None  # finished once
    assert (d.num_failed, d.state("r"), d.has_pending_work()) == (1, None, False)


def test_allocation_beyond_the_plan_records_nothing() -> None:
    d = loads()
    req = Req("r", list(range(40)), remote(40))
    assert d.plan(req, 0) == (39, True)
    with pytest.raises(ConfigError, match="40 external tokens"):
        d.record_allocation(req, Blocks(([1, 2, 3],)), 40)
    with pytest.raises(ConfigError, match="need 3 blocks in 1 group"):
        d.record_allocation(req, Blocks(([1, 2],)), 39)
    assert d.state("r") == "planned"


def test_end_request_says_whether_the_blocks_must_wait() -> None:
    d = loads()
    assert d.end_request(Req("plain", [1, 2, 3])) is None  # not a load: P may serve it
    assert d.end_request(Req("serve", [1, 2, 3], remote(3, do_remote_prefill=False,
                                                          do_remote_decode=True))) is None
    early = Req("early", list(range(40)), remote(40))
    assert d.end_request(early) is False  # ended before planning: P is told at once
    _, notices = d.dispatch()
    assert [(n.request_id, n.ok) for n in notices] == [("early", False)]

    busy = Req("busy", list(range(40)), remote(40))
    d.plan(busy, 0)
    d.record_allocation(busy, Blocks(([1, 2, 3],)), 39)
    d.dispatch()
    assert d.end_request(busy) is True  # a worker may be writing into its blocks
    end = d.finish("busy")
    assert end is not None and end.aborted  # now they may be freed


def test_a_prefill_only_engine_gives_the_grant_back_once() -> None:
    d = loads(may_load=False)
    req = Req("r", list(range(40)), remote(40))
    assert d.plan(req, 0) == (0, False)
    assert d.plan(req, 0) == (0, False)
    _, notices = d.dispatch()
    assert [(n.request_id, n.grant, n.ok) for n in notices] == [("r", "g" * 22, False)]


def test_d_reads_with_the_digest_p_issued_its_grant_under() -> None:
    topo = EngineTopology(tp_size=1, pp_size=1, block_size=BS, num_kv_heads=4, is_mla=False,
                          layout=KVLayout.HND, num_layers=2)
    p = HeldGrants("p", "10.0.0.1", 5600, topo, BS, lease_s=30.0, clock=lambda: NOW)
    prompt = list(range(50))
    params = p.hold(Req("on-p", prompt), [5, 6, 7, 8])
    assert params is not None
    [send], _ = p.dispatch()
    d = loads()
    req = Req("on-d", prompt, params)
    num_ext, _ = d.plan(req, 0)
    d.record_allocation(req, Blocks(([1, 2, 3, 4],)), num_ext)
    [recv], _ = d.dispatch()
    assert recv.kv_digest == send.kv_digest
    assert (recv.grant, recv.remote_block_ids) == (send.grant, send.block_ids)


SECRET = b"a cluster secret of 32 bytes...."


def signed_pair(secret_p: bytes | None = SECRET, secret_d: bytes | None = SECRET
                ) -> tuple[HeldGrants, RemoteLoads]:
    """A P that signs its params with ``secret_p``, a D that checks them with ``secret_d``."""
    topo = EngineTopology(tp_size=1, pp_size=1, block_size=BS, num_kv_heads=4, is_mla=False,
                          layout=KVLayout.HND, num_layers=2)
    p = HeldGrants("p", "10.0.0.1", 5600, topo, BS, lease_s=30.0, clock=lambda: NOW,
                   params_key=params_key(secret_p))
    d = RemoteLoads(BS, may_load=True, clock=lambda: NOW, params_key=params_key(secret_d))
    return p, d


def through_json(params: KVTransferParams, **changes: object) -> KVTransferParams | None:
    """What D parses after the params went through a client as JSON (and ``changes``)."""
    raw = json.loads(json.dumps(params.to_json_dict()))
    raw.update(changes)
    return parse_kv_transfer_params(raw)


def test_signed_params_pass_through_json_and_d_reads() -> None:
    p, d = signed_pair()
    prompt = list(range(50))
    params = p.hold(Req("on-p", prompt), [5, 6, 7, 8])
    assert params is not None and params.signature is not None
    assert d.plan(Req("on-d", prompt, through_json(params)), 0) == (49, True)
    assert d.num_refused == {}


@pytest.mark.parametrize("changes", [
    {"signature": None},  # stripped
    {"signature": "0" * 64},  # made up
    {"remote_host": "10.6.6.6"}, {"remote_port": 6666}, {"remote_engine_id": "rogue"},
    {"remote_block_ids": [8, 7, 6, 5]}, {"remote_num_tokens": 40}, {"grant": "x" * 22},
    {"expires_at": NOW + 3600}, {"remote_tp_size": 2}, {"remote_block_size": 32},
    {"remote_ports": [6666]}, {"remote_groups": [[0, 4]]}, {"kv_digest": "ab" * 32},
])
def test_d_plans_no_read_and_contacts_no_one_for_params_p_did_not_sign(
        changes: dict[str, object]) -> None:
    p, d = signed_pair()
    prompt = list(range(50))
    params = p.hold(Req("on-p", prompt), [5, 6, 7, 8])
    assert params is not None
    forged = through_json(params, **changes)
    assert forged is not None
    req = Req("on-d", prompt, forged)
    assert d.plan(req, 0) == (0, False)
    assert d.plan(req, 0) == (0, False)  # and not on a second ask
    recvs, notices = d.dispatch()
    assert (recvs, notices) == ([], [])  # nothing planned, no notice to the named host
    assert sum(d.num_refused.values()) == 1
    assert set(d.num_refused) <= {"unsigned", "bad_signature"}
    assert d.end_request(req) is False
    assert d.dispatch() == ([], [])


def test_params_of_a_p_with_another_secret_or_none_are_refused() -> None:
    prompt = list(range(50))
    for secret_p, reason in ((b"another secret of 32 bytes......", "bad_signature"),
                             (None, "unsigned")):
        p, d = signed_pair(secret_p=secret_p)
        params = p.hold(Req("on-p", prompt), [5, 6, 7, 8])
        assert params is not None
        assert d.plan(Req("on-d", prompt, params), 0) == (0, False)
        assert d.num_refused == {reason: 1}


def test_without_a_secret_params_are_unsigned_and_unchecked() -> None:
    p, d = signed_pair(secret_p=None, secret_d=None)
    prompt = list(range(50))
    params = p.hold(Req("on-p", prompt), [5, 6, 7, 8])
    assert params is not None and params.signature is None
    assert d.plan(Req("on-d", prompt, params), 0) == (49, True)


def test_signed_params_for_another_prompt_are_refused_before_any_read_and_given_back() -> None:
    p, d = signed_pair()
    params = p.hold(Req("on-p", list(range(50))), [5, 6, 7, 8])
    assert params is not None
    req = Req("on-d", list(range(1, 51)), params)
    assert d.plan(req, 0) == (0, False)
    recvs, notices = d.dispatch()
    assert recvs == [] and [(n.remote_host, n.grant, n.ok) for n in notices] == [
        ("10.0.0.1", params.grant, False)]
    assert d.num_refused == {"prompt_mismatch": 1}


def test_params_key_is_derived_and_not_the_secret() -> None:
    key = params_key(SECRET)
    assert key is not None and len(key) == 32 and SECRET not in key
    assert params_key(None) is None
    assert check_signature(sign_params(remote(40), key), key) is None
    assert check_signature(remote(40), key) == "unsigned"
    assert check_signature(sign_params(remote(40), params_key(b"x" * 32)), key) == "bad_signature"
