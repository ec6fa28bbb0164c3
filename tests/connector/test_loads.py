"""RemoteLoads on its own: D's loads from planning to finish, and requests that end early.

``tests/connector/test_scheduler.py`` drives it through ``ConnectorScheduler``
with a real ``KVCacheManager``; these tests pin the part's own contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvbridge.connector.held_grants import HeldGrants
from kvbridge.connector.loads import RemoteLoads
from kvbridge.connector.params import KVTransferParams
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
    assert d.finish("r") is False
    assert d.take_finished() == {"r"} and d.take_finished() == set()
    assert d.take_invalid_block_ids() == {3}
    assert d.first_bad_token(req, []) == (32, {3})
    assert d.first_bad_token(req, []) is None  # reported once
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
    assert d.finish("busy") is True  # now they may be freed
    assert d.take_finished() == set()


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
