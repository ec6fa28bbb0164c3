"""``VllmSchedulerSide`` driven as vLLM's scheduler drives it, without a server.

What vLLM acts on comes from the workers: this side reads vLLM's
``KVConnectorOutput`` and never edits it. A synchronous load's end reaches it
from every worker (``SyncLoadsEnded``, vLLM's worker metadata) and counts
once all of them reported; requests whose blocks vLLM keeps for kvbridge are
freed by asking the workers to report them received
(``StepMetadata.report_received``).

``kvbridge.integrations.vllm`` imports vLLM: imported in the tests, so that
collection works without vLLM (``conftest.py`` skips or fails them then).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from tests.connector.helpers import TOKENS, remote

BLOCK_SIZE = 16


@dataclass
class Blocks:
    block_ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.block_ids


def scheduler_side(tp_size: int) -> Any:
    from kvbridge.integrations.vllm.facts import EngineFacts
    from kvbridge.integrations.vllm.scheduler_side import VllmSchedulerSide
    from kvbridge.integrations.vllm.settings import parse_settings

    facts = EngineFacts("d", "both", tp_size=tp_size, pp_size=1, block_size=BLOCK_SIZE,
                        num_kv_heads=2, head_size=8, num_layers=2, is_mla=False,
                        model_id="m", kv_bytes_per_token=4)
    settings = parse_settings({"insecure": True, "sync_load_max_bytes": 1 << 20})
    return VllmSchedulerSide(facts, settings)


def vllm_request(request_id: str, num_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = remote(num_tokens, expires_at=time.time() + 600).to_json_dict()
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(request_id, list(TOKENS[:num_tokens]), sampling, None)


def admit(side: Any, request: Any, first_block: int) -> bool:
    """vLLM admits ``request`` (no local hit) and allocates its blocks; True: asynchronous."""
    num_tokens, is_async = side.get_num_new_matched_tokens(request, 0)
    assert num_tokens == request.num_prompt_tokens - 1
    num_blocks = -(-request.num_prompt_tokens // BLOCK_SIZE)
    blocks = Blocks((list(range(first_block, first_block + num_blocks)),))
    side.update_state_after_alloc(request, blocks, num_tokens)
    return bool(is_async)


def read_only(side: Any, **fields: Any) -> None:
    """Hand vLLM's aggregated output to the side; it must come back unchanged."""
    from vllm.v1.outputs import KVConnectorOutput

    output = KVConnectorOutput(**fields)
    before = copy.deepcopy(output)
    side.update_connector_output(output)
    assert output == before


def test_a_late_synchronous_read_counts_every_worker_then_vllm_frees_its_request() -> None:
    from vllm.v1.request import RequestStatus

    from kvbridge.integrations.vllm.messages import SyncLoadsEnded

    side = scheduler_side(tp_size=2)
    # the first load from P is asynchronous; once it went well, P is warm
    first = vllm_request("first", 40)
    assert admit(side, first, 1)
    assert side.build_connector_meta(0).sync_loads == frozenset()
    read_only(side, finished_recving={"first"})
    # now a small load is synchronous: the step's forward computes on it
    late = vllm_request("late", 40)
    assert not admit(side, late, 10)
    meta = side.build_connector_meta(39)
    assert meta.sync_loads == {"late"} and meta.report_received == frozenset()
    # rank 0's read ended; rank 1's goes on (cancelled at its deadline, not yet quiet)
    read_only(side, kv_connector_worker_meta=SyncLoadsEnded({0: frozenset({"late"})}))
    assert side.scheduler.load_state("late") == "dispatched"
    # vLLM fails the request (policy fail): its blocks wait for the read to end
    late.status = RequestStatus.FINISHED_ERROR
    assert side.request_finished(late, ([10, 11, 12],)) == (True, None)
    assert side.build_connector_meta(0).report_received == frozenset()
    read_only(side, kv_connector_worker_meta=SyncLoadsEnded({1: frozenset({"late"})}))
    assert side.scheduler.load_state("late") is None
    # every worker reports it received in the next step: vLLM frees its blocks then
    assert side.build_connector_meta(0).report_received == {"late"}
    read_only(side, finished_recving={"late"})  # that report, back: no load of kvbridge's
    assert side.build_connector_meta(0).report_received == frozenset()
    assert not side.has_pending_work()


def test_a_request_aborted_before_its_read_started_is_reported_received() -> None:
    from vllm.v1.request import RequestStatus

    side = scheduler_side(tp_size=1)
    aborted = vllm_request("aborted", 40)
    assert admit(side, aborted, 1)
    aborted.status = RequestStatus.FINISHED_ABORTED
    # vLLM keeps the blocks of a request waiting for its KV until it is received
    assert side.request_finished(aborted, ([1, 2, 3],)) == (False, None)
    meta = side.build_connector_meta(0)
    assert meta.work.reqs_to_recv == [] and meta.report_received == {"aborted"}
    read_only(side, finished_recving={"aborted"})
    assert side.build_connector_meta(0).report_received == frozenset()


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu", "gpu"])
def test_a_step_with_reads_to_start_starts_them_before_its_forward_on_a_cpu(cpu: bool) -> None:
    """Issue #40: vLLM starts a step's loads after its forward unless the step has
    synchronous ones; on a CPU that is after the whole forward (P's grants were issued
    one prefill late). A step whose metadata starts reads (or issues grants) asks vLLM to
    start them first (``has_sync_kv_loads``) where forwards are computed by the caller;
    a step with nothing to start, or a GPU, is left as vLLM made it."""
    from kvbridge.integrations.vllm.connector import KVBridgeConnector

    side = scheduler_side(tp_size=1)
    connector = SimpleNamespace(_scheduler_side=lambda: side, _start_before_forward=cpu)

    def build() -> bool:
        output = SimpleNamespace(total_num_scheduled_tokens=8, has_sync_kv_loads=False)
        KVBridgeConnector.build_connector_meta(connector, output)  # type: ignore[arg-type]
        return output.has_sync_kv_loads

    assert admit(side, vllm_request("read", 40), 1)  # an asynchronous load: a read to start
    assert build() is cpu
    assert build() is False  # nothing new to start
