"""RemoteKVTracker applies the reference engine's load-failure policy to what the connector reports.

The connector (``ConnectorScheduler``) says where a finished load's valid KV
ends; the tracker resumes the request from there (``recompute``) or hands it
back to fail (``fail``). Worker outputs are written by hand.
"""

from __future__ import annotations

from collections import deque

import pytest

from kvbridge.connector.outputs import WorkerOutput
from kvbridge.errors import ConfigError
from kvbridge.reference.engine.remote_kv import LoadFailurePolicy, RemoteKVTracker
from kvbridge.reference.engine.request import EngineRequest, RequestStatus
from tests.connector.helpers import TOKENS, manager, remote, request, scheduler


def load_that_fails(policy: LoadFailurePolicy
                    ) -> tuple[list[tuple[EngineRequest, str]], EngineRequest,
                               deque[EngineRequest]]:
    """Admit an 80-token request loading all but its last token; blocks 2..4 fail."""
    conn, mgr = scheduler(), manager()
    tracker = RemoteKVTracker(mgr, conn, policy)
    req = request("r", TOKENS[:80], remote(80))
    hits, num_local = mgr.get_computed_blocks(req)
    num_ext, load_async = tracker.num_matched_tokens(req, num_local)
    assert (num_local, num_ext, load_async) == (0, 79, True)
    assert tracker.start_loading(req, hits, num_local, num_ext)
    conn.build_connector_meta()
    block_ids = mgr.get_block_ids("r")[0]
    waiting: deque[EngineRequest] = deque()
    assert tracker.update(WorkerOutput(invalid_block_ids=set(block_ids[2:5])), waiting) == []
    failed = tracker.update(WorkerOutput(finished_recving={"r"}), waiting)
    return failed, req, waiting


def test_recompute_resumes_from_the_first_bad_block() -> None:
    failed, req, waiting = load_that_fails("recompute")
    assert failed == [] and list(waiting) == [req]
    assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 2 * 16


def test_fail_hands_the_request_back_with_the_reason() -> None:
    failed, req, waiting = load_that_fails("fail")
    assert not waiting and [r for r, _ in failed] == [req]
    assert "KV missing from token 32" in failed[0][1]
    assert "load_failure_policy" in failed[0][1]  # and what would recompute it


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="load_failure_policy"):
        RemoteKVTracker(manager(), scheduler(), "retry")  # type: ignore[arg-type]
