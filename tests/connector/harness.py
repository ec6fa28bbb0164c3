"""A model-free engine loop around the real connector, for the connector tests.

``MiniEngine`` is what the reference engine does with the connector, minus the
model: a real ``KVCacheManager`` (prefix caching on), a ``ConnectorScheduler``,
one ``ConnectorWorker`` per TP rank (each with its own transfer agent and cache
tensors) and a ``KVOutputAggregator``. "Computing" a token writes its KV, a
deterministic function of the token prefix (like a real model's KV), into every
rank's head slice, so any engine can say what a request's cache must hold, and
a recomputed token gets the same bytes as a loaded one.

Request lifecycle::

    waiting -> (remote load) loading -> ready -> running -> finished
            -> (local prefill)                   running -> finished
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbridge.connector.aggregator import KVOutputAggregator
from kvbridge.connector.params import KVTransferParams, parse_kv_transfer_params
from kvbridge.connector.scheduler import ConnectorScheduler, LoadFailurePolicy, Role
from kvbridge.connector.worker import ConnectorWorker
from kvbridge.layout import KVLayout
from kvbridge.paged.hashing import BlockHasher
from kvbridge.paged.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvbridge.paged.manager import KVCacheManager
from kvbridge.paged.request import Request
from kvbridge.paged.spec import FullAttentionSpec
from kvbridge.topology import EngineTopology
from kvbridge.transfer.agent import AgentConfig
from kvbridge.transfer.security import CompatInfo

NUM_LAYERS = 2
NUM_KV_HEADS = 4
HEAD_DIM = 8
DTYPE = torch.float32
HASH_SEED = b"kvbridge-connector-tests"
OUTPUT_TOKEN = 7


@dataclass(frozen=True)
class EngineSpec:
    """One engine of a test."""

    engine_id: str
    role: Role = "both"
    tp_size: int = 1
    block_size: int = 16
    layout: str = "NHD"
    num_blocks: int = 64
    base_port: int = 0
    lease_s: float = 30.0
    host_buffer: bool = False
    policy: LoadFailurePolicy = "recompute"
    agent: dict[str, Any] = field(default_factory=dict)

    def topology(self) -> EngineTopology:
        return EngineTopology(
            tp_size=self.tp_size, pp_size=1, block_size=self.block_size,
            num_kv_heads=NUM_KV_HEADS, is_mla=False, layout=KVLayout.parse(self.layout),
            num_layers=NUM_LAYERS,
        )


def token_kv(prompt: list[int], position: int) -> torch.Tensor:
    """KV of token ``position`` (``[layers, 2, heads, head_dim]``), set by its prefix."""
    digest = hashlib.blake2b(repr(prompt[: position + 1]).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randn((NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM), generator=gen, dtype=DTYPE)


def expected_kv(tokens: list[int], start: int, end: int) -> torch.Tensor:
    """``[layers, 2, end - start, heads, head_dim]`` that tokens ``[start, end)`` must hold."""
    if end <= start:
        return torch.empty((NUM_LAYERS, 2, 0, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE)
    return torch.stack([token_kv(tokens, t) for t in range(start, end)], dim=2)


class EngineRequest(Request):
    """A paged ``Request`` plus what the connector and the loop need."""

    __slots__ = ("kv_transfer_params", "max_tokens", "status", "num_local", "num_external",
                 "num_computed_here", "ready_ok", "final_ok", "output_params", "paused")

    def __init__(self, request_id: str, prompt: list[int], hasher: BlockHasher,
                 params: KVTransferParams | None, max_tokens: int, paused: bool) -> None:
        super().__init__(request_id, prompt, hasher)
        self.kv_transfer_params = params
        self.max_tokens = max_tokens
        self.status = "waiting"
        self.num_local = 0
        self.num_external = 0
        self.num_computed_here = 0  # tokens whose KV this engine computed itself
        self.ready_ok: bool | None = None  # loaded KV complete when the wait ended?
        self.final_ok: bool | None = None  # whole KV right when the request finished?
        self.output_params: dict[str, Any] | None = None
        self.paused = paused


class MiniEngine:
    """See the module docstring. ``step()`` is one engine step; thread-safe via ``lock``."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        topo = spec.topology()
        self.block_size = spec.block_size
        kv_spec = FullAttentionSpec(spec.block_size, NUM_KV_HEADS, HEAD_DIM, DTYPE)
        layers = tuple(f"layer{i}" for i in range(NUM_LAYERS))
        config = KVCacheConfig(spec.num_blocks, (), (KVCacheGroupSpec(layers, kv_spec),))
        self.hasher = BlockHasher("sha256", HASH_SEED, spec.block_size)
        self.manager = KVCacheManager(config, 4096, self.hasher)
        self.connector = ConnectorScheduler(
            spec.engine_id, spec.role, topo, "127.0.0.1", spec.base_port or 1, spec.block_size,
            lease_s=spec.lease_s, load_failure_policy=spec.policy,
        )
        self.heads_per_rank = topo.num_heads_per_rank
        compat = CompatInfo("mini", str(DTYPE), NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS,
                            topo.layout, spec.block_size, False)
        self.caches: list[list[torch.Tensor]] = []
        self.workers: list[ConnectorWorker] = []
        for rank in range(spec.tp_size):
            worker = ConnectorWorker(
                spec.engine_id, topo, rank, 0, compat, host="127.0.0.1",
                base_port=spec.base_port, secret=None, host_buffer=spec.host_buffer,
                agent_config=AgentConfig(**spec.agent),
            )
            caches = [torch.zeros(self._cache_shape(), dtype=DTYPE) for _ in range(NUM_LAYERS)]
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.caches.append(caches)
        self.aggregator = KVOutputAggregator(spec.tp_size)
        self.requests: dict[str, EngineRequest] = {}
        self.delayed: set[str] = set()  # finished, blocks kept for the connector
        self.lock = threading.Lock()
        self.errors: list[str] = []
        # freeze the loop after a step that handed params out (before they are acted on)
        self.freeze_on_handout = False
        self.handed_out = False

    def _cache_shape(self) -> tuple[int, ...]:
        s = self.spec
        if KVLayout.parse(s.layout) is KVLayout.NHD:
            return (2, s.num_blocks, s.block_size, self.heads_per_rank, HEAD_DIM)
        return (2, s.num_blocks, self.heads_per_rank, s.block_size, HEAD_DIM)

    # ---------------------------------------------------------------- commands
    def add(self, request_id: str, prompt: list[int], params: object = None,
            max_tokens: int = 1, paused: bool = False) -> None:
        req = EngineRequest(request_id, prompt, self.hasher, parse_kv_transfer_params(params),
                            max_tokens, paused)
        self.requests[request_id] = req

    def abort(self, request_id: str) -> None:
        req = self.requests[request_id]
        if req.status not in ("finished", "aborted"):
            self._finish(req, aborted=True)

    def busy(self) -> bool:
        active = any(r.status not in ("finished", "aborted") and not r.paused
                     for r in self.requests.values())
        return active or bool(self.delayed) or self.connector.has_pending_work()

    # ---------------------------------------------------------------- one step
    def step(self) -> None:
        for req in list(self.requests.values()):
            if req.paused:
                continue
            if req.status == "waiting":
                self._schedule_new(req)
            elif req.status in ("ready", "running"):
                self._run(req)
        meta = self.connector.build_connector_meta()
        for worker in self.workers:
            worker.start_load_kv(meta)
        for worker in self.workers:
            worker.wait_for_save()
        out = self.aggregator.aggregate([w.get_output() for w in self.workers])
        assert out is not None
        self.connector.update_connector_output(out)
        invalid = self.connector.take_invalid_block_ids()
        for request_id in self.connector.take_finished_recving():
            self._load_done(self.requests[request_id], invalid)
        for request_id in self.connector.take_finished_sending():
            self.manager.free(request_id)
            self.delayed.discard(request_id)

    def _schedule_new(self, req: EngineRequest) -> None:
        hits, num_local = self.manager.get_computed_blocks(req)
        num_ext, is_async = self.connector.get_num_new_matched_tokens(req, num_local)
        if is_async:
            new = self.manager.allocate_slots(req, 0, num_local, hits,
                                              num_external_computed_tokens=num_ext,
                                              delay_cache_blocks=True)
            if new is None:
                return
            self.connector.update_state_after_alloc(req, self.manager.get_blocks(req.request_id),
                                                    num_ext)
            req.num_local, req.num_external, req.status = num_local, num_ext, "loading"
            return
        new = self.manager.allocate_slots(req, req.num_tokens - num_local, num_local, hits)
        if new is None:
            return
        req.num_local, req.num_computed_tokens = num_local, num_local
        req.status = "running"
        self._run(req)

    def _load_done(self, req: EngineRequest, invalid: set[int]) -> None:
        assert req.status == "loading", (req.request_id, req.status)
        first_bad = self.connector.handle_load_failure(req, invalid)
        loaded_end = req.num_local + req.num_external
        req.num_computed_tokens = loaded_end if first_bad is None else first_bad
        # a request must never run on half-loaded KV: check what it will run on
        got = self.logical(req.request_id, 0, req.num_computed_tokens)
        req.ready_ok = torch.equal(got, expected_kv(list(req.all_token_ids), 0,
                                                    req.num_computed_tokens))
        self.manager.cache_blocks(req, req.num_computed_tokens)
        req.status = "ready"

    def _run(self, req: EngineRequest) -> None:
        """Compute every uncomputed token, sample one token, maybe finish."""
        num_new = req.num_tokens - req.num_computed_tokens
        needs_slots = req.status == "ready" or req.num_output_tokens > 0
        if needs_slots and self.manager.allocate_slots(req, num_new) is None:
            return
        self._compute(req, req.num_computed_tokens, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        req.status = "running"
        req.append_output_token_ids(OUTPUT_TOKEN)
        if req.num_output_tokens >= req.max_tokens:
            self._finish(req, aborted=False)

    def _finish(self, req: EngineRequest, *, aborted: bool) -> None:
        if not aborted:  # the last sampled token has no KV yet
            end = req.num_tokens - 1
            got = self.logical(req.request_id, 0, end)
            req.final_ok = torch.equal(got, expected_kv(list(req.all_token_ids), 0, end))
        block_ids = self.manager.get_block_ids(req.request_id)[0]
        delay, params = self.connector.request_finished(req, block_ids, aborted=aborted)
        req.status = "aborted" if aborted else "finished"
        req.output_params = params.to_json_dict() if params is not None else None
        self.handed_out |= params is not None
        if delay:
            self.delayed.add(req.request_id)
        else:
            self.manager.free(req)

    def _compute(self, req: EngineRequest, start: int, end: int) -> None:
        tokens = list(req.all_token_ids)
        block_ids = self.manager.get_block_ids(req.request_id)[0]
        nhd = KVLayout.parse(self.spec.layout) is KVLayout.NHD
        for position in range(start, end):
            kv = token_kv(tokens, position)  # [layers, 2, heads, dim]
            block, slot = block_ids[position // self.block_size], position % self.block_size
            for rank, caches in enumerate(self.caches):
                heads = kv[:, :, rank * self.heads_per_rank : (rank + 1) * self.heads_per_rank]
                for layer, cache in enumerate(caches):
                    if nhd:
                        cache[:, block, slot] = heads[layer]
                    else:
                        cache[:, block, :, slot] = heads[layer]
        req.num_computed_here += end - start

    # ---------------------------------------------------------------- queries
    def logical(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """The request's tokens ``[start, end)`` as ``[layers, 2, n, heads, dim]``, all ranks."""
        block_ids = self.manager.get_block_ids(request_id)[0]
        positions = range(start, end)
        nhd = KVLayout.parse(self.spec.layout) is KVLayout.NHD
        per_rank = []
        for caches in self.caches:
            layers = []
            for cache in caches:
                tokens = []
                for p in positions:
                    block, slot = block_ids[p // self.block_size], p % self.block_size
                    tokens.append(cache[:, block, slot] if nhd else cache[:, block, :, slot])
                if tokens:
                    layers.append(torch.stack(tokens, dim=1))
                else:
                    layers.append(torch.empty((2, 0, self.heads_per_rank, HEAD_DIM), dtype=DTYPE))
            per_rank.append(torch.stack(layers))
        return torch.cat(per_rank, dim=3)

    def status(self, request_id: str) -> dict[str, Any]:
        req = self.requests[request_id]
        return {
            "status": req.status, "num_local": req.num_local, "num_external": req.num_external,
            "num_computed_here": req.num_computed_here, "ready_ok": req.ready_ok,
            "final_ok": req.final_ok,
            "params": req.output_params, "delayed": request_id in self.delayed,
        }

    def free_blocks(self) -> tuple[int, int]:
        self.manager.check_integrity()
        return self.manager.num_free_blocks, self.manager.num_usable_blocks

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()


class EngineLoop:
    """Steps a ``MiniEngine`` in a thread (as a serving engine's busy loop does)."""

    def __init__(self, engine: MiniEngine) -> None:
        self.engine = engine
        self.frozen = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while not self._stop.is_set():
            with self.engine.lock:
                busy = not self.frozen and self.engine.busy()
                if busy:
                    try:
                        self.engine.step()
                    except Exception as exc:  # surfaced to the test through status
                        self.engine.errors.append(repr(exc))
                        self.frozen = True
                    if self.engine.freeze_on_handout and self.engine.handed_out:
                        self.frozen = True
                    self.engine.handed_out = False
            time.sleep(0.002 if busy else 0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
