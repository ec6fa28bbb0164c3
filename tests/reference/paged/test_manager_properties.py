"""Property test: random scheduler-like sequences keep every manager invariant.

A Hypothesis state machine plays scheduler over one ``KVCacheManager``: new
requests (local prefill, chunked prefill, remote KV with delayed caching),
decode steps with lookahead, frees, cache lookups and prefix-cache resets.
After every operation the manager's ``check_integrity`` (pool, free queue,
hash map, per-request lists, ref counts == holders) must pass and free + held
must equal the usable blocks; freeing everything must leave no leak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvbridge.reference.paged.hashing import BlockHasher
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvbridge.reference.paged.manager import CacheTooSmallError, KVCacheManager
from kvbridge.reference.paged.request import Request
from kvbridge.reference.paged.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

MAX_MODEL_LEN = 48
DT = torch.float16
# A few shared prefixes so that requests hit each other's blocks.
PREFIXES = [[1] * 40, list(range(40)), [2, 3] * 20]


def specs_for(kind: str, block_size: int) -> list[KVCacheSpec]:
    full = FullAttentionSpec(block_size, 1, 4, DT)
    window = SlidingWindowSpec(block_size, 1, 4, DT, sliding_window=2 * block_size + 1)
    chunk = ChunkedLocalAttentionSpec(block_size, 1, 4, DT, attention_chunk_size=3 * block_size)
    return {"full": [full], "window": [window], "full+window": [full, window],
            "full+chunk": [full, chunk]}[kind]


@dataclass
class Sim:
    """Scheduler-side state of one request."""

    request: Request
    waiting_remote: bool = False


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sims: dict[str, Sim] = {}
        self.next_id = 0

    @initialize(
        kind=st.sampled_from(["full", "window", "full+window", "full+chunk"]),
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(4, 64),
        hash_fn=st.sampled_from(["sha256", "blake2b"]),
    )
    def setup(self, kind: str, block_size: int, num_blocks: int, hash_fn: str) -> None:
        groups = tuple(KVCacheGroupSpec((f"l{i}",), spec)
                       for i, spec in enumerate(specs_for(kind, block_size)))
        self.hasher = BlockHasher(hash_fn, b"prop", block_size)
        self.block_size = block_size
        self.m = KVCacheManager(KVCacheConfig(num_blocks, (), groups), MAX_MODEL_LEN,
                                self.hasher, enable_kv_cache_events=True, log_stats=True)

    # ----------------------------------------------------------------- helpers

    def snapshot(self) -> tuple[object, ...]:
        return (self.m.num_free_blocks,
                {rid: self.m.get_block_ids(rid) for rid in self.sims})

    def make_request(self, prefix: int, prefix_len: int, tail: list[int]) -> Request:
        self.next_id += 1
        tokens = PREFIXES[prefix][:prefix_len] + tail
        return Request(f"r{self.next_id}", tokens or [0], self.hasher)

    def check_hits(self, request: Request) -> int:
        hits, num_hit = self.m.get_computed_blocks(request)
        assert num_hit % self.block_size == 0 and 0 <= num_hit < request.num_tokens
        for group_hits in hits.blocks:
            assert len(group_hits) in (0, num_hit // self.block_size)
            for i, block in enumerate(group_hits):
                if not block.is_null:  # a hit must hold exactly this prefix block
                    assert block.block_hash is not None
                    assert block.block_hash.startswith(request.block_hashes[i])
        return num_hit

    def check_needed_blocks(self, request: Request, num_computed: int, num_slots: int) -> None:
        """Every block a token from ``num_computed`` on may read is real, not null."""
        bs = self.block_size
        num_slots = min(num_slots, MAX_MODEL_LEN)
        for group, ids in zip(self.m.kv_cache_config.kv_cache_groups,
                              self.m.get_block_ids(request.request_id), strict=True):
            spec = group.kv_cache_spec
            first_needed = 0
            if isinstance(spec, SlidingWindowSpec):
                first_needed = max(num_computed - spec.sliding_window + 1, 0)
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                first_needed = num_computed // spec.attention_chunk_size * spec.attention_chunk_size
            assert len(ids) >= -(-num_slots // bs)
            assert 0 not in ids[first_needed // bs:], (first_needed, ids)

    # ------------------------------------------------------------------- rules

    @rule(prefix=st.integers(0, 2), prefix_len=st.integers(0, 40),
          tail=st.lists(st.integers(0, 5), max_size=8), chunk=st.integers(1, 48),
          lookahead=st.integers(0, 3), remote=st.booleans())
    def add_request(self, prefix: int, prefix_len: int, tail: list[int], chunk: int,
                    lookahead: int, remote: bool) -> None:
        r = self.make_request(prefix, prefix_len, tail)
        hits, num_hit = self.m.get_computed_blocks(r)
        before = self.snapshot()
        try:
            if remote:  # a remote prefill sends everything else; cache once it arrived
                out = self.m.allocate_slots(r, 0, num_hit, hits, delay_cache_blocks=True,
                                            num_external_computed_tokens=r.num_tokens - num_hit)
            else:
                num_new = min(chunk, r.num_tokens - num_hit)
                out = self.m.allocate_slots(r, num_new, num_hit, hits, lookahead)
        except CacheTooSmallError:
            assert self.snapshot() == before
            return
        if out is None:
            assert self.snapshot() == before
            return
        self.sims[r.request_id] = Sim(r, waiting_remote=remote)
        if remote:
            self.check_needed_blocks(r, num_hit, r.num_tokens)
        else:
            num_new = min(chunk, r.num_tokens - num_hit)
            self.check_needed_blocks(r, num_hit, num_hit + num_new + lookahead)
            r.num_computed_tokens = num_hit + num_new

    @precondition(lambda self: bool(self.sims))
    @rule(data=st.data(), token=st.integers(0, 5), lookahead=st.integers(0, 3))
    def step(self, data: st.DataObject, token: int, lookahead: int) -> None:
        sim = self.sims[data.draw(st.sampled_from(sorted(self.sims)))]
        r = sim.request
        if sim.waiting_remote:
            # KV arrived: cache it; the last token is recomputed locally.
            self.m.cache_blocks(r, r.num_tokens - 1)
            r.num_computed_tokens = r.num_tokens - 1
            sim.waiting_remote = False
            return
        if r.num_computed_tokens == r.num_tokens:  # decode: sample a token first
            if r.num_tokens >= MAX_MODEL_LEN:
                return
            r.append_output_token_ids(token)
        num_new = r.num_tokens - r.num_computed_tokens
        before = self.snapshot()
        try:
            out = self.m.allocate_slots(r, num_new, num_lookahead_tokens=lookahead)
        except CacheTooSmallError:
            assert self.snapshot() == before
            self.free_request(r.request_id)
            return
        if out is None:
            assert self.snapshot() == before
            # Preempt the request like a scheduler would: free, start again later.
            self.free_request(r.request_id)
            return
        self.check_needed_blocks(r, r.num_computed_tokens, r.num_tokens + lookahead)
        r.num_computed_tokens = r.num_tokens

    @precondition(lambda self: bool(self.sims))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_request(data.draw(st.sampled_from(sorted(self.sims))))

    def free_request(self, request_id: str) -> None:
        self.m.free(self.sims.pop(request_id).request)
        self.m.free(request_id)  # second free is a no-op

    @rule(prefix=st.integers(0, 2), prefix_len=st.integers(0, 40),
          tail=st.lists(st.integers(0, 5), max_size=4))
    def lookup(self, prefix: int, prefix_len: int, tail: list[int]) -> None:
        before = self.snapshot()
        self.check_hits(self.make_request(prefix, prefix_len, tail))
        assert self.snapshot() == before

    @rule()
    def reset(self) -> None:
        held = any(any(ids) for rid in self.sims for ids in self.m.get_block_ids(rid))
        assert self.m.reset_prefix_cache() == (not held)
        self.m.take_events()
        self.m.make_prefix_cache_stats()

    # -------------------------------------------------------------- invariants

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        held = {i for rid in self.sims for ids in self.m.get_block_ids(rid) for i in ids if i}
        assert self.m.num_free_blocks + len(held) == self.m.num_usable_blocks

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for request_id in list(self.sims):
            self.free_request(request_id)
        self.m.check_integrity()
        assert self.m.num_free_blocks == self.m.num_usable_blocks
        assert self.m.reset_prefix_cache()
        self.m.check_integrity()


ManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerMachine = ManagerMachine.TestCase
