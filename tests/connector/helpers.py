"""Builders for the connector's single-process tests: a ``ConnectorScheduler``, a real
``KVCacheManager``, engine requests with remote params, and the engine's admission.

``admit`` goes through the engine's own tracker of remote KV
(``kvbridge/reference/engine/remote_kv.py``), so the tests see what the reference engine
does with the connector, not a copy of it. Used by ``test_scheduler.py`` and
``test_binding.py``; :func:`wait_finished` also by
``tests/integration/test_fused_kv_worker.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.connector.params import KVTransferParams
from kvbridge.connector.scheduler import ConnectorScheduler
from kvbridge.connector.worker import ConnectorWorker
from kvbridge.reference.engine.remote_kv import RemoteKVTracker
from kvbridge.reference.engine.request import EngineRequest, SamplingParams
from kvbridge.reference.paged.hashing import BlockHasher
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvbridge.reference.paged.manager import KVCacheManager
from kvbridge.reference.paged.spec import FullAttentionSpec
from kvbridge.topology import EngineTopology, KVLayout
from tests.connector.harness import DTYPE, HASH_SEED
from tests.waiting import wait_until

NOW = 1_800_000_000.0  # the connectors' wall clock


@dataclass(frozen=True)
class Req:
    """An engine request as ``ConnectorRequest`` sees it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    kv_transfer_params: KVTransferParams | None = None
    num_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
TOKENS = list(range(500, 600))


def topology(block_size: int = 16, tp_size: int = 2) -> EngineTopology:
    return EngineTopology(tp_size=tp_size, pp_size=1, block_size=block_size, num_kv_heads=4,
                          is_mla=False, layout=KVLayout.HND, num_layers=2)


def scheduler(block_size: int = 16, **kwargs: Any) -> ConnectorScheduler:
    """Engine ``me`` (role ``both`` unless ``role=``) at 10.0.0.2:7000, its clock at NOW."""
    kwargs.setdefault("lease_s", 30.0)
    return ConnectorScheduler("me", kwargs.pop("role", "both"), topology(block_size),
                              "10.0.0.2", 7000, block_size, clock=lambda: NOW, **kwargs)


def manager(block_size: int = 16, num_blocks: int = 32) -> KVCacheManager:
    spec = FullAttentionSpec(block_size, 4, 8, DTYPE)
    config = KVCacheConfig(num_blocks, (), (KVCacheGroupSpec(("l0", "l1"), spec),))
    return KVCacheManager(config, 1024, BlockHasher("sha256", HASH_SEED, block_size))


def remote(num_tokens: int, block_size: int = 16, **changes: Any) -> KVTransferParams:
    """Params of a remote prefill of ``num_tokens`` by engine ``p`` (P's blocks 100, 101, ...)."""
    fields: dict[str, Any] = {
        "do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "10.0.0.1",
        "remote_port": 5600, "remote_block_ids": list(range(100, 100 + math.ceil(
            num_tokens / block_size))), "remote_block_size": block_size,
        "remote_num_tokens": num_tokens, "grant": "g" * 22, "expires_at": NOW + 10,
    }
    fields.update(changes)
    return KVTransferParams(**fields)


def request(rid: str, tokens: list[int], params: KVTransferParams | None,
            block_size: int = 16) -> EngineRequest:
    """An engine request for one output token."""
    return EngineRequest(rid, tokens, SamplingParams(max_tokens=1),
                         BlockHasher("sha256", HASH_SEED, block_size), 0.0, params)


def admit(conn: ConnectorScheduler, mgr: KVCacheManager, req: EngineRequest) -> tuple[int, int]:
    """What the engine's scheduler does for a new request, through ``RemoteKVTracker``.

    A load is started (blocks allocated, the connector told where they are);
    a local prefill allocates nothing.

    Returns:
        ``(local hit, external tokens)``.
    """
    tracker = RemoteKVTracker(mgr, conn)
    hits, num_local = mgr.get_computed_blocks(req)
    num_ext, load_async = tracker.num_matched_tokens(req, num_local)
    assert load_async == (num_ext > 0)
    if load_async:
        assert tracker.start_loading(req, hits, num_local, num_ext)
    return num_local, num_ext


def wait_finished(worker: ConnectorWorker, request_id: str, *, recving: bool) -> set[int]:
    """Poll ``worker`` until it reports ``request_id`` done; returns the invalid block ids."""
    invalid: set[int] = set()
    side = "recving" if recving else "sending"

    def finished() -> bool:
        out = worker.get_output()
        invalid.update(out.invalid_block_ids)
        return request_id in ((out.finished_recving if recving else out.finished_sending) or ())

    wait_until(finished, 20.0, interval_s=0.01, message=f"{request_id!r} to finish {side}")
    return invalid
