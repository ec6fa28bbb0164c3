"""Throughput of the paged KV cache manager on the host.

Measures, in one process:

- allocate + free: a fresh request's prompt allocated (and cached) then freed;
- prefix-hit lookup: ``get_computed_blocks`` on a fully cached 4k-token prompt;
- block hashing: ``BlockHasher.hash_request_blocks`` in tokens/s, per hash function;
- scheduler step: one decode token for each of 256 running 4k-token requests,
  i.e. ``allocate_slots`` for every request, in microseconds per step (full
  attention, and full + sliding window).

Usage::

    python -m kvbridge.bench.paged_bench [--quick] [--json out.json]

``run(quick)`` returns the figures as a dict for the CLI.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from kvbridge.reference.paged.hashing import HASH_FN_NAMES, BlockHasher
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvbridge.reference.paged.manager import KVCacheManager
from kvbridge.reference.paged.request import Request
from kvbridge.reference.paged.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

BLOCK_SIZE = 16
SEED = b"paged-bench"
VOCAB = 32_000


def _manager(specs: list[KVCacheSpec], num_blocks: int, max_model_len: int,
             hasher: BlockHasher) -> KVCacheManager:
    groups = tuple(KVCacheGroupSpec((f"layer{i}",), s) for i, s in enumerate(specs))
    return KVCacheManager(KVCacheConfig(num_blocks, (), groups), max_model_len, hasher)


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(BLOCK_SIZE, 8, 128, torch.bfloat16)


def _window(size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(BLOCK_SIZE, 8, 128, torch.bfloat16, sliding_window=size)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _best_seconds(fn: Callable[[], None], repeats: int) -> float:
    """Fastest of ``repeats`` timed calls (least disturbed by the machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_allocate_free(quick: bool) -> dict[str, float]:
    """Allocate a 512-token prompt (32 blocks, cached) and free it again."""
    rng = random.Random(0)
    hasher = BlockHasher("blake2b", SEED, BLOCK_SIZE)
    m = _manager([_full()], 4096, 8192, hasher)
    num_ops = 200 if quick else 2000
    requests = [Request(f"r{i}", _tokens(rng, 512), hasher) for i in range(64)]

    def loop() -> None:
        for i in range(num_ops):
            r = requests[i % len(requests)]
            m.allocate_slots(r, r.num_tokens)
            m.free(r)

    seconds = _best_seconds(loop, 3)
    m.check_integrity()
    return {"ops_per_s": num_ops / seconds, "blocks_per_s": num_ops * 32 / seconds}


def bench_prefix_hit(quick: bool) -> dict[str, float]:
    """Look up a fully cached 4096-token prompt (255 block hits per lookup)."""
    rng = random.Random(1)
    hasher = BlockHasher("blake2b", SEED, BLOCK_SIZE)
    m = _manager([_full()], 1024, 8192, hasher)
    prompt = _tokens(rng, 4096)
    owner = Request("owner", prompt, hasher)
    m.allocate_slots(owner, owner.num_tokens)
    probe = Request("probe", prompt, hasher)
    num_lookups = 50 if quick else 500
    num_hit = m.get_computed_blocks(probe)[1]
    assert num_hit == 4096 - BLOCK_SIZE, num_hit

    def loop() -> None:
        for _ in range(num_lookups):
            m.get_computed_blocks(probe)

    seconds = _best_seconds(loop, 3)
    return {"lookups_per_s": num_lookups / seconds,
            "blocks_per_s": num_lookups * num_hit / BLOCK_SIZE / seconds}


def bench_hashing(quick: bool) -> dict[str, float]:
    """Hash every full block of a long token sequence from scratch."""
    rng = random.Random(2)
    tokens = _tokens(rng, 16_384 if quick else 131_072)
    out: dict[str, float] = {}
    for name in HASH_FN_NAMES:
        try:
            hasher = BlockHasher(name, SEED, BLOCK_SIZE)
        except ValueError:  # optional dependency (e.g. xxhash) not installed
            continue

        def hash_all(hasher: BlockHasher = hasher) -> None:
            hasher.hash_request_blocks(tokens, 0, [], None)

        seconds = _best_seconds(hash_all, 3)
        out[f"{name}_tokens_per_s"] = len(tokens) / seconds
    return out


def bench_scheduler_step(quick: bool, specs: list[KVCacheSpec]) -> dict[str, float]:
    """256 running requests of ~4k tokens; per step one decode token each.

    One untimed warm-up step first: right after prefill, a sliding-window group
    releases every block before the window once, which is not the steady state.
    """
    rng = random.Random(3)
    num_requests, num_steps, max_len = 256, (16 if quick else 64), 4096
    prompt_len = max_len - num_steps - 1
    hasher = BlockHasher("blake2b", SEED, BLOCK_SIZE)
    num_blocks = len(specs) * num_requests * (max_len // BLOCK_SIZE + 1) + 1
    m = _manager(specs, num_blocks, max_len, hasher)
    running = [Request(f"r{i}", _tokens(rng, prompt_len), hasher) for i in range(num_requests)]
    for r in running:
        assert m.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
    alloc_seconds: list[float] = []
    append_seconds: list[float] = []
    for _ in range(num_steps + 1):
        start = time.perf_counter()
        for r in running:  # sampling appended one token (hashing a block when full)
            r.append_output_token_ids(rng.randrange(VOCAB))
        mid = time.perf_counter()
        for r in running:  # the scheduler's allocation pass
            if m.allocate_slots(r, 1) is None:
                raise RuntimeError("benchmark cache too small")
            r.num_computed_tokens += 1
        end = time.perf_counter()
        append_seconds.append(mid - start)
        alloc_seconds.append(end - mid)
    m.check_integrity()
    del alloc_seconds[0], append_seconds[0]  # warm-up step
    mean_alloc = sum(alloc_seconds) / num_steps
    return {
        "allocate_us_per_step_mean": mean_alloc * 1e6,
        "allocate_us_per_step_best": min(alloc_seconds) * 1e6,
        "allocate_us_per_request_mean": mean_alloc / num_requests * 1e6,
        "append_and_hash_us_per_step_mean": sum(append_seconds) / num_steps * 1e6,
    }


def run(quick: bool = False,
        progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run every measurement.

    Args:
        quick: Fewer iterations (seconds instead of tens of seconds).
        progress: called as ``progress(benchmark done, benchmarks done, total)``.

    Returns:
        ``{benchmark name: {metric: value}}`` plus the settings used.
    """
    benches: list[tuple[str, Callable[[], dict[str, float]]]] = [
        ("allocate_free_512_tokens", lambda: bench_allocate_free(quick)),
        ("prefix_hit_4096_tokens", lambda: bench_prefix_hit(quick)),
        ("block_hashing", lambda: bench_hashing(quick)),
        ("scheduler_step_256x4k_full", lambda: bench_scheduler_step(quick, [_full()])),
        ("scheduler_step_256x4k_full_sliding1024",
         lambda: bench_scheduler_step(quick, [_full(), _window(1024)])),
    ]
    results: dict[str, Any] = {"settings": {"block_size": BLOCK_SIZE, "quick": quick}}
    for done, (name, bench) in enumerate(benches, 1):
        results[name] = bench()
        if progress is not None:
            progress(name, done, len(benches))
    return results


def format_table(results: dict[str, Any]) -> str:
    """Render ``run()``'s result as an aligned text table."""
    rows = [(bench, metric, value) for bench, metrics in results.items()
            if bench != "settings" for metric, value in metrics.items()]
    width_b = max(len(r[0]) for r in rows)
    width_m = max(len(r[1]) for r in rows)
    lines = [f"{'benchmark':<{width_b}}  {'metric':<{width_m}}  {'value':>14}"]
    lines += [f"{b:<{width_b}}  {m:<{width_m}}  {v:>14,.1f}" for b, m, v in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    results = run(quick=args.quick)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
