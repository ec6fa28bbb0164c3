"""Helpers of the P/D tests: start engines, run a prompt on P, hand it to D, check the end."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tests.connector.engine_proc import EngineHost, EngineRef
from tests.connector.harness import EngineSpec
from tests.ports import free_port_base

FAST = {"connect_timeout_s": 2.0, "handshake_timeout_s": 2.0, "reply_timeout_s": 3.0,
        "chunk_timeout_s": 3.0, "heartbeat_s": 0.5, "read_timeout_s": 10.0}


def engine(host: EngineHost, spec: EngineSpec) -> EngineRef:
    """Start ``spec`` in ``host`` on free ports, with short network timeouts."""
    return EngineRef(host, replace(spec, base_port=free_port_base(spec.tp_size),
                                   agent={**FAST, **spec.agent}))


def prompt(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(length)]


def prefill(p: EngineRef, request_id: str, tokens: list[int]) -> dict[str, Any]:
    """Run the prompt on P with max_tokens=1; return the kv_transfer_params for D."""
    p.add(request_id, tokens, {"do_remote_decode": True})
    status = p.wait_status(request_id, {"finished"})
    assert status["params"] is not None and status["params"]["do_remote_prefill"]
    return dict(status["params"])


def decode(d: EngineRef, request_id: str, tokens: list[int], params: Any) -> dict[str, Any]:
    """Run the request on D (max_tokens=2); its KV must be the prompt's at the end."""
    d.add(request_id, tokens, params, max_tokens=2)
    status = d.wait_status(request_id, {"finished"})
    assert status["final_ok"] is True, f"{request_id}: D's KV differs from the prompt's"
    return status


def finish(*engines: EngineRef, timeout_s: float = 30.0) -> None:
    """Every engine gives every block back and reports no error."""
    for e in engines:
        e.wait_idle(timeout_s)
        assert e.call("errors") == []
        assert e.call("stats").num_held_blocks == 0
