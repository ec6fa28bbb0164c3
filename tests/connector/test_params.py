"""kv_transfer_params: parsing never raises, bad params mean a local prefill."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.params import KVTransferParams, parse_kv_transfer_params


def full_params(**changes: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": "10.0.0.1",
        "remote_port": 5600, "remote_block_ids": [3, 9, 4], "remote_tp_size": 2,
        "remote_pp_size": 1, "remote_block_size": 16, "remote_num_tokens": 40,
        "grant": "g" * 22, "expires_at": 1_800_000_000.5,
    }
    params.update(changes)
    return params


def test_complete_params_round_trip_through_json() -> None:
    parsed = parse_kv_transfer_params(full_params())
    assert parsed is not None and parsed.do_remote_prefill and parsed.remote_block_ids == [3, 9, 4]
    text = json.dumps(parsed.to_json_dict())
    assert parse_kv_transfer_params(json.loads(text)) == parsed
    assert parse_kv_transfer_params(parsed) == parsed  # a struct is accepted too


def test_request_to_p_needs_only_the_flag() -> None:
    parsed = parse_kv_transfer_params({"do_remote_decode": True})
    assert parsed == KVTransferParams(do_remote_decode=True)
    assert parsed.to_json_dict() == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_ports": [],
        "remote_block_ids": [], "remote_tp_size": 1, "remote_pp_size": 1, "remote_num_tokens": 0,
    }


def test_vllm_toy_proxy_nulls_count_as_absent() -> None:
    # vLLM's toy proxy sends these nulls to P, plus keys kvbridge does not know
    raw = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None,
           "remote_request_id": "abc"}
    assert parse_kv_transfer_params(raw) == KVTransferParams(do_remote_decode=True)


def test_per_rank_ports_must_match_the_world_size() -> None:
    ok = parse_kv_transfer_params(full_params(remote_tp_size=2, remote_ports=[5601, 5733]))
    assert ok is not None and ok.remote_ports == [5601, 5733]
    assert parse_kv_transfer_params(full_params(remote_tp_size=2, remote_ports=[5601])) is None
    assert parse_kv_transfer_params(full_params(remote_ports=[0])) is None


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (full_params(remote_port="5600"), "remote_port"),
        (full_params(remote_port=70000), "remote_port"),
        (full_params(remote_block_ids=[1, -2]), "remote_block_ids"),
        (full_params(remote_block_size=0), "remote_block_size"),
        (full_params(grant=None), "grant"),
        (full_params(remote_host=None), "remote_host"),
        (full_params(remote_num_tokens=0), "remote_num_tokens"),
        (full_params(remote_block_ids=[]), "remote_block_ids"),
        (full_params(remote_num_tokens=49), "remote_block_ids (3 blocks"),  # needs 4
        (["not", "an", "object"], "expected a JSON object"),
        ("do_remote_prefill", "expected a JSON object"),
    ],
)
def test_malformed_params_are_dropped_with_a_warning(
    raw: object, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector.params"):
        assert parse_kv_transfer_params(raw) is None
    assert problem in caplog.text


def test_no_params_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_kv_transfer_params(None) is None
    assert caplog.text == ""


def test_a_loaded_request_is_never_served_onward() -> None:
    parsed = parse_kv_transfer_params(full_params(do_remote_decode=True))
    assert parsed is not None and parsed.do_remote_prefill and not parsed.do_remote_decode


def test_unknown_fields_are_ignored() -> None:
    parsed = parse_kv_transfer_params(full_params(some_future_field=1))
    assert parsed is not None and parsed.grant == "g" * 22


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(full_params())), _json_values, max_size=6)
       | _json_values)
def test_parsing_arbitrary_json_never_raises(raw: object) -> None:
    parsed = parse_kv_transfer_params(raw)
    if parsed is not None and parsed.do_remote_prefill:
        assert parsed.missing_for_prefill() == []


def test_the_first_token_flow_mark_reaches_p_and_is_left_out_when_false() -> None:
    parsed = parse_kv_transfer_params({"do_remote_decode": True, "first_token_flow": True})
    assert parsed is not None and parsed.first_token_flow
    assert parsed.to_json_dict()["first_token_flow"] is True
    assert "first_token_flow" not in KVTransferParams(do_remote_decode=True).to_json_dict()
