"""A model-free engine loop around the real connector, for the connector tests.

``MiniEngine`` is what the reference engine does with the connector, minus the
model: a real ``KVCacheManager`` (prefix caching on), a ``ConnectorScheduler``,
the engine scheduler's own tracker of remote KV (``RemoteKVTracker``,
``kvbridge/reference/engine/remote_kv.py``: loads, rollbacks, blocks held for readers),
one ``ConnectorWorker`` per TP rank (each with its own transfer agent and cache
tensors) and a ``KVOutputAggregator``. What is left here is the model's part and
a trivial batch (every request every step). "Computing" a token writes its KV, a
deterministic function of the token prefix (like a real model's KV), into every
rank's head slice, so any engine can say what a request's cache must hold, and
a recomputed token gets the same bytes as a loaded one.

Requests are the engine's ``EngineRequest``; ``status`` names their state::

    waiting -> (remote load) loading -> ready -> running -> finished
            -> (local prefill)                   running -> finished
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbridge.connector.aggregator import KVOutputAggregator
from kvbridge.connector.params import parse_kv_transfer_params
from kvbridge.connector.scheduler import ConnectorScheduler, Role
from kvbridge.connector.worker import ConnectorWorker
from kvbridge.reference.engine.remote_kv import LoadFailurePolicy, RemoteKVTracker
from kvbridge.reference.engine.request import (
    EngineRequest,
    FinishReason,
    RequestStatus,
    SamplingParams,
)
from kvbridge.reference.paged.hashing import BlockHasher
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvbridge.reference.paged.manager import KVCacheManager
from kvbridge.reference.paged.spec import FullAttentionSpec
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.agent import AgentConfig
from kvbridge.transfer.protocol.security import CompatInfo

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


_STATUS_NAMES = {
    RequestStatus.WAITING_FOR_REMOTE_KVS: "loading",
    RequestStatus.RUNNING: "running",
    RequestStatus.FINISHED_LENGTH: "finished",
    RequestStatus.FINISHED_STOPPED: "finished",
    RequestStatus.FINISHED_ABORTED: "aborted",
    RequestStatus.FINISHED_ERROR: "failed",
}


@dataclass
class Progress:
    """What the tests ask about a request beyond the engine's own state."""

    paused: bool
    num_local: int = 0  # D's local prefix hit when the request was admitted
    num_external: int = 0  # tokens planned to load from a remote prefill
    num_computed_here: int = 0  # tokens whose KV this engine computed itself
    ready_ok: bool | None = None  # loaded KV complete when the wait ended?
    final_ok: bool | None = None  # whole KV right when the request finished?
    output_params: dict[str, Any] | None = None


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
            lease_s=spec.lease_s,
        )
        self.tracker = RemoteKVTracker(self.manager, self.connector, spec.policy)
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
        self.requests: dict[str, EngineRequest] = {}  # finished ones too, for ``status``
        self.progress: dict[str, Progress] = {}
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
        self.requests[request_id] = EngineRequest(
            request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            self.hasher, time.monotonic(), parse_kv_transfer_params(params))
        self.progress[request_id] = Progress(paused)

    def resume(self, request_id: str) -> None:
        self.progress[request_id].paused = False

    def abort(self, request_id: str) -> None:
        """As the engine's scheduler aborts: a loading request leaves the tracker first."""
        req = self.requests[request_id]
        if req.is_finished:
            return
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.tracker.forget_loading(req)
        req.finish(FinishReason.ABORT)
        self._release(req)

    def busy(self) -> bool:
        active = any(not r.is_finished and not self.progress[r.request_id].paused
                     for r in self.requests.values())
        return active or self.tracker.num_held_blocks() > 0 or self.tracker.has_pending_work()

    # ---------------------------------------------------------------- one step
    def step(self) -> None:
        for req in list(self.requests.values()):
            if self.progress[req.request_id].paused:
                continue
            if req.status is RequestStatus.WAITING:
                if self.tracker.is_loaded(req):
                    self._start_loaded(req)
                else:
                    self._schedule_new(req)
            elif req.status is RequestStatus.RUNNING:  # decoding: a slot for the new token
                num_new = req.num_tokens - req.num_computed_tokens
                if self.manager.allocate_slots(req, num_new) is not None:
                    self._run(req)
        meta = self.connector.build_connector_meta()
        for worker in self.workers:
            worker.start_load_kv(meta)
        for worker in self.workers:
            worker.wait_for_save()
        out = self.aggregator.aggregate([w.get_output() for w in self.workers])
        assert out is not None
        loaded: deque[EngineRequest] = deque()  # the tracker puts requests whose load ended
        failed = self.tracker.update(out, loaded)
        for req in loaded:
            self._check_loaded(req)
        for req, message in failed:  # load_failure_policy "fail"
            self.errors.append(message)
            req.finish(FinishReason.ERROR, message)
            self._release(req)

    def _schedule_new(self, req: EngineRequest) -> None:
        """Admit ``req`` as the engine's scheduler does: a remote load, or a local prefill."""
        progress = self.progress[req.request_id]
        hits, num_local = self.manager.get_computed_blocks(req)
        num_ext, load_async = self.tracker.num_matched_tokens(req, num_local)
        if load_async:
            if self.tracker.start_loading(req, hits, num_local, num_ext):
                progress.num_local, progress.num_external = num_local, num_ext
            return
        if self.manager.allocate_slots(req, req.num_tokens - num_local - num_ext, num_local,
                                       hits, num_external_computed_tokens=num_ext) is None:
            return
        req.num_cached_tokens = num_local
        req.num_computed_tokens = num_local + num_ext
        self.tracker.after_alloc(req, num_ext)
        progress.num_local, progress.num_external = num_local, num_ext
        req.status = RequestStatus.RUNNING
        self._run(req)

    def _check_loaded(self, req: EngineRequest) -> None:
        """A load ended: the KV the request will run on must be the prompt's."""
        end = req.num_computed_tokens  # after any rollback to the first bad block
        got = self.logical(req.request_id, 0, end)
        self.progress[req.request_id].ready_ok = torch.equal(
            got, expected_kv(list(req.all_token_ids), 0, end))

    def _start_loaded(self, req: EngineRequest) -> None:
        if self.manager.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is None:
            return
        self.tracker.forget_loaded(req)
        req.status = RequestStatus.RUNNING
        self._run(req)

    def _run(self, req: EngineRequest) -> None:
        """Compute every uncomputed token (slots allocated), sample one token, maybe finish."""
        self._compute(req, req.num_computed_tokens, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(OUTPUT_TOKEN)
        if req.num_output_tokens >= req.sampling_params.max_tokens:
            end = req.num_tokens - 1  # the last sampled token has no KV yet
            got = self.logical(req.request_id, 0, end)
            self.progress[req.request_id].final_ok = torch.equal(
                got, expected_kv(list(req.all_token_ids), 0, end))
            req.finish(FinishReason.LENGTH)
            self._release(req)

    def _release(self, req: EngineRequest) -> None:
        """The tracker frees the blocks or holds them for the connector."""
        params = self.tracker.release(req)
        self.progress[req.request_id].output_params = (
            params.to_json_dict() if params is not None else None)
        self.handed_out |= params is not None

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
        self.progress[req.request_id].num_computed_here += end - start

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
        req, progress = self.requests[request_id], self.progress[request_id]
        return {
            "status": self._status_name(req), "num_local": progress.num_local,
            "num_external": progress.num_external,
            "num_computed_here": progress.num_computed_here, "ready_ok": progress.ready_ok,
            "final_ok": progress.final_ok, "params": progress.output_params,
            "delayed": self.tracker.is_held(request_id),
        }

    def _status_name(self, req: EngineRequest) -> str:
        """waiting, loading, ready (loaded, waiting to run), running, finished, aborted, failed."""
        if req.status is RequestStatus.WAITING:
            return "ready" if self.tracker.is_loaded(req) else "waiting"
        return _STATUS_NAMES[req.status]

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
