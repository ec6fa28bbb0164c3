"""The served hand-off: D's first token after P's, through two ``AsyncEngine``s.

``kvbridge bench e2e`` steps its engines by hand; a server (``kvbridge serve``)
runs each engine in an ``AsyncEngine`` thread that sleeps between steps while
only transfers are in flight, which is where waking up late costs TTFT. This
script measures that path: P (``AsyncEngine``, tiny model, HND, one TP worker)
prefills a fresh 64-token prompt with ``max_tokens=1`` and ``do_remote_decode``;
then D (the same) gets P's ``kv_transfer_params``; the clock runs from D's
submit to D's first token (D's step that starts the load, the load from P, the
steps that learn it ended, the first decode step). The first 3 requests warm up.

    python -m benchmarks.handoff_bench [--requests 30]

Prints the median and p90 in ms. Not a test: no assertion on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from kvbridge.cli.demo.procs import reserve_ports
from kvbridge.reference.engine.async_engine import AsyncEngine
from kvbridge.reference.engine.engine_config import ConnectorSettings, EngineConfig
from kvbridge.reference.engine.request import SamplingParams
from kvbridge.topology import KVLayout

_NUM_WARMUP = 3
_PROMPT_TOKENS = 64


def _config(name: str) -> EngineConfig:
    [port] = reserve_ports([1])
    return EngineConfig(model="tiny", num_blocks=256, kv_layout=KVLayout.HND,
                        connector=ConnectorSettings(engine_id=f"handoff-{name}",
                                                    transfer_base_port=port))


async def measure(num_requests: int) -> list[float]:
    """Milliseconds from D's submit to D's first token, one per request after warm-up."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as e2e_bench: no spinning OpenMP
    p, d = AsyncEngine(_config("p")), AsyncEngine(_config("d"))
    rng = random.Random(3)
    times: list[float] = []
    try:
        for i in range(num_requests + _NUM_WARMUP):
            prompt = [rng.randrange(1, 200) for _ in range(_PROMPT_TOKENS)]
            first = await p.generate(f"p{i}", prompt, SamplingParams(max_tokens=1,
                                     ignore_eos=True), {"do_remote_decode": True})
            started = time.perf_counter()
            async for out in d.generate_stream(f"d{i}", prompt, SamplingParams(
                    max_tokens=4, ignore_eos=True), first.kv_transfer_params):
                if out.new_token_ids:
                    times.append((time.perf_counter() - started) * 1e3)
                    break
            await asyncio.sleep(0.05)  # P frees the blocks; nothing overlaps
    finally:
        p.shutdown()
        d.shutdown()
    return times[_NUM_WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    times = sorted(asyncio.run(measure(args.requests)))
    print(f"D first token after hand-off: median {statistics.median(times):.2f} ms, "
          f"p90 {times[int(len(times) * 0.9)]:.2f} ms, {len(times)} requests")


if __name__ == "__main__":
    main()
