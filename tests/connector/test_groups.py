"""Several KV cache groups through the connector's scheduler side: P's hold, D's plan and read.

``tests/topology/test_groups.py`` pins the block arithmetic; these tests carry a
request's groups through ``HeldGrants`` -> params (JSON) -> ``RemoteLoads`` ->
``RecvRequest``, as vLLM's hybrid KV cache manager hands them over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvbridge.connector.held_grants import HeldGrants
from kvbridge.connector.loads import RemoteLoads
from kvbridge.connector.params import parse_kv_transfer_params
from kvbridge.connector.scheduler import ConnectorScheduler
from kvbridge.topology import CacheGroup, EngineTopology, KVLayout
from tests.connector.helpers import NOW, Req

BS = 32
NULL = 0
GROUPS = (CacheGroup("tokens"), CacheGroup("window", window=96, label="sliding window 96"))
STATE_GROUPS = (CacheGroup("tokens"), CacheGroup("state", label="GDN state"))


@dataclass(frozen=True)
class Blocks:
    groups: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def topo(tp_size: int = 1) -> EngineTopology:
    return EngineTopology(tp_size=tp_size, pp_size=1, block_size=BS, num_kv_heads=2,
                          is_mla=False, layout=KVLayout.HND, num_layers=1, fused_kv=True)


def p_side(groups: tuple[CacheGroup, ...] = GROUPS) -> HeldGrants:
    return HeldGrants("p", "10.0.0.1", 5600, topo(), BS, lease_s=30.0, clock=lambda: NOW,
                      groups=groups, null_block_id=NULL)


def d_side(groups: tuple[CacheGroup, ...] = GROUPS, tp_size: int = 1) -> RemoteLoads:
    return RemoteLoads(BS, may_load=True, clock=lambda: NOW, groups=groups, null_block_id=NULL,
                       tp_size=tp_size)


def window(first_id: int, num_tokens: int) -> list[int]:
    skipped = max(0, num_tokens - 96 + 1)
    return [NULL if (i + 1) * BS <= skipped else first_id + i
            for i in range(-(-num_tokens // BS))]


def test_groups_travel_from_ps_hold_to_ds_read() -> None:
    prompt = list(range(2, 302))  # 300 tokens, 10 blocks
    p = p_side()
    served = Req("a", prompt, parse_kv_transfer_params({"do_remote_decode": True}),
                 num_computed_tokens=300)
    params = p.hold(served, (list(range(10, 20)), window(30, 300)))
    assert params is not None
    assert params.remote_groups == [(0, 10), (6, 4)]
    assert params.remote_block_ids == list(range(10, 20)) + [36, 37, 38, 39]
    [send] = p.dispatch()[0]
    assert send.block_ids == params.remote_block_ids  # one grant for every group

    wire = json.loads(json.dumps(params.to_json_dict()))  # through the proxy
    assert wire["remote_groups"] == [[0, 10], [6, 4]]
    d = d_side()
    req = Req("b", prompt, parse_kv_transfer_params(wire))
    assert d.plan(req, 0) == (299, True)
    d.record_allocation(req, Blocks((list(range(100, 110)), window(200, 299))), 299)
    [recv], _ = d.dispatch()
    assert recv.kv_digest == send.kv_digest  # P's grant accepts D's reads
    assert recv.local_block_ids == list(range(100, 110)) + [206, 207, 208, 209]
    assert recv.remote_block_ids == params.remote_block_ids
    assert (recv.first_token, recv.num_tokens, recv.missing_block_ids) == (0, 14 * BS, [])
    assert d.written_block_ids("b") == recv.local_block_ids


def test_d_prefills_itself_when_a_load_would_not_be_exact(caplog: object) -> None:
    prompt = list(range(2, 609))  # 607 tokens: P freed the window block D needs
    params = p_side().hold(Req("a", prompt, None, 607), (list(range(1, 20)), window(40, 607)))
    assert params is not None
    d = d_side()
    req = Req("b", prompt, params)
    assert d.plan(req, 0) == (0, False)
    _, [notice] = d.dispatch()
    assert notice.ok  # P lets go at once
    assert d.plan(Req("c", [*prompt, 7], params), 0) == (607, True)  # first-token flow: fine


def test_a_state_moves_only_between_equal_tp_and_token_counts() -> None:
    prompt = list(range(2, 102))
    p = p_side(STATE_GROUPS)
    assert p.hold(Req("x", prompt, None, num_computed_tokens=101),
                  (list(range(1, 5)), [NULL, NULL, NULL, 9])) is None  # decoded past the prompt
    cut = p.hold(Req("a", prompt[:-1], None, 99), (list(range(1, 5)), [NULL, NULL, NULL, 9]))
    assert cut is not None and cut.remote_num_tokens == 99 and cut.remote_groups[1] == (3, 1)
    d = d_side(STATE_GROUPS)
    assert d.plan(Req("b", prompt, cut), 32) == (67, True)  # classic flow: state after 99
    assert d_side(STATE_GROUPS, tp_size=2).plan(Req("c", prompt, cut), 0) == (0, False)
    whole = p.hold(Req("w", prompt, None, 100), (list(range(1, 5)), [NULL, NULL, NULL, 8]))
    assert whole is not None
    assert d.plan(Req("e", prompt, whole), 0) == (0, False)  # state after 100: not 99
    assert d.plan(Req("f", [*prompt, 5], whole), 0) == (100, True)  # D continues after P's token


def test_a_load_that_cannot_be_planned_fails_instead_of_reading_wrong_blocks() -> None:
    prompt = list(range(2, 102))
    params = p_side(STATE_GROUPS).hold(Req("a", prompt[:-1], None, 99),
                                       (list(range(1, 5)), [NULL, NULL, NULL, 9]))
    d = d_side(STATE_GROUPS)
    req = Req("b", prompt, params)
    assert d.plan(req, 0) == (99, True)
    d.record_allocation(req, Blocks(([5, 6, 7, 8], [NULL, NULL, NULL, NULL])), 99)  # no state
    [recv], _ = d.dispatch()
    assert recv.local_block_ids == [] and recv.missing_block_ids == [5, 6, 7, 8]


def test_the_scheduler_keeps_one_group_on_the_general_path() -> None:
    one = ConnectorScheduler("me", "both", topo(), "10.0.0.2", 7000, BS, lease_s=30.0,
                             groups=[CacheGroup("tokens")], null_block_id=NULL)
    assert one.groups is None
    two = ConnectorScheduler("me", "both", topo(), "10.0.0.2", 7000, BS, lease_s=30.0,
                             groups=GROUPS, null_block_id=NULL)
    req = Req("a", list(range(2, 102)), parse_kv_transfer_params({"do_remote_decode": True}),
              num_computed_tokens=100)
    delay, params = two.request_finished(req, ([1, 2, 3, 4], [NULL, 6, 7, 8]))
    assert delay and params is not None and params.remote_groups == [(0, 4), (1, 3)]
