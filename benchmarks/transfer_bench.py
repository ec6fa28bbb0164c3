"""Transfer benchmark: KV-shaped reads between two agent processes vs ``ucx_perftest``.

Each request reads ``n`` scattered blocks (32 layers, 8 KV heads, head dim 128,
bf16, block 16: 2 MiB per block) from a serving agent into scattered local
blocks of a reading agent, through the full path (grant, handshake-cached link,
pack, UCX, unpack, done report). Reported per size: GB/s and p50/p99 latency
from ``start_read`` to the read appearing in ``get_finished``; and
``ucx_perftest -t tag_bw`` at the same message size, run on the same host.

Usage::

    python benchmarks/transfer_bench.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NUM_LAYERS, NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BLOCK_NBYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_HEADS * HEAD_DIM * 2


def _agent(engine_id: str, num_blocks: int, port: int, seed: int) -> Any:
    import torch

    from kvbridge.layout import KVLayout
    from kvbridge.topology import EngineTopology
    from kvbridge.transfer.agent import TransferAgent
    from kvbridge.transfer.security import CompatInfo

    topo = EngineTopology(1, 1, BLOCK_SIZE, NUM_HEADS, False, KVLayout.NHD, NUM_LAYERS)
    compat = CompatInfo("bench", "bfloat16", NUM_HEADS, HEAD_DIM, NUM_LAYERS, KVLayout.NHD,
                        BLOCK_SIZE, False)
    agent = TransferAgent(engine_id, topo, 0, 0, compat, port=port)
    shape = (2, num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(seed)
    caches = [
        torch.randint(-1000, 1000, shape, generator=gen, dtype=torch.int16).view(torch.bfloat16)
        if seed else torch.zeros(shape, dtype=torch.bfloat16)
        for _ in range(NUM_LAYERS)
    ]
    agent.register_kv_caches(caches)
    agent.start()
    return agent


def _server(conn: Any, num_blocks: int) -> None:
    agent = _agent("bench-p", num_blocks, 0, seed=1)
    conn.send(agent.port)
    while True:
        cmd, args = conn.recv()
        if cmd == "issue":
            request_id, blocks = args
            conn.send(agent.issue_grant(request_id, blocks, 1, lease_s=60.0).token)
            agent.get_finished()  # drain releases
        else:
            agent.close()
            conn.send(None)
            return


def _reader(conn: Any, num_blocks: int, port: int) -> None:
    import random

    agent = _agent("bench-d", num_blocks, 0, seed=0)
    conn.send(None)
    rng = random.Random(0)
    while True:
        cmd, args = conn.recv()
        if cmd != "read":
            agent.close()
            conn.send(None)
            return
        request_id, remote_blocks, token = args
        local_blocks = rng.sample(range(num_blocks), len(remote_blocks))
        started = time.perf_counter()
        agent.start_read(
            request_id, engine_id="bench-p", host="127.0.0.1", port=port,
            remote_block_ids=remote_blocks, local_block_ids=local_blocks, grant=token,
            num_tokens=len(remote_blocks) * BLOCK_SIZE,
        )
        while request_id not in agent.get_finished()[1]:
            time.sleep(0.00005)
        elapsed = time.perf_counter() - started
        failed = agent.get_failed_block_ids()
        conn.send((elapsed, bool(failed), [s.error for s in agent.get_stats() if not s.ok]))


def _kv_runs(sizes: list[int], num_iters: dict[int, int]) -> dict[int, dict[str, float]]:
    import random

    ctx = mp.get_context("spawn")
    num_blocks = max(sizes) + 8
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(p_child, num_blocks), daemon=True)
    server.start()
    port = p_conn.recv()
    reader = ctx.Process(target=_reader, args=(d_child, num_blocks, port), daemon=True)
    reader.start()
    d_conn.recv()
    rng = random.Random(1)
    results: dict[int, dict[str, float]] = {}
    try:
        for size in sizes:
            times = []
            for i in range(num_iters[size] + 2):  # 2 warm-up reads (first one handshakes)
                request_id = f"r{size}-{i}"
                blocks = rng.sample(range(num_blocks), size)
                p_conn.send(("issue", (request_id, blocks)))
                token = p_conn.recv()
                d_conn.send(("read", (request_id, blocks, token)))
                elapsed, failed, errors = d_conn.recv()
                if failed:
                    raise RuntimeError(f"read of {size} blocks failed: {errors}")
                if i >= 2:
                    times.append(elapsed)
            times.sort()
            p50 = times[len(times) // 2]
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            nbytes = size * BLOCK_NBYTES
            results[size] = {
                "nbytes": nbytes, "gb_per_s": nbytes / p50 / 1e9,
                "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "num_iters": len(times),
            }
    finally:
        for conn in (p_conn, d_conn):
            conn.send(("close", None))
            conn.recv()
        server.join(10)
        reader.join(10)
    return results


def _perftest_bin() -> tuple[Path, dict[str, str]]:
    import libucx  # type: ignore[import-untyped]

    root = Path(libucx.__file__).parent
    env = dict(os.environ, LD_LIBRARY_PATH=str(root / "lib"), UCX_WARN_UNUSED_ENV_VARS="n")
    return root / "bin" / "ucx_perftest", env


def _perftest(nbytes: int, num_iters: int) -> float:
    """ucx_perftest tag_bw GB/s for ``nbytes`` messages (server and client on this host)."""
    binary, env = _perftest_bin()
    port = 20000 + secrets.randbelow(20000)
    args = ["-t", "tag_bw", "-s", str(nbytes), "-n", str(num_iters), "-w", "2", "-p", str(port)]
    server = subprocess.Popen([str(binary), *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run([str(binary), "127.0.0.1", *args], env=env, capture_output=True,
                             text=True, timeout=300).stdout
    finally:
        server.wait(timeout=60)
    final = [line for line in out.splitlines() if line.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest printed no result: {out[-500:]}")
    fields = re.split(r"\s+", final[0].strip())
    return float(fields[6]) * (1 << 20) / 1e9  # overall bandwidth, MB/s (2**20)


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; return ``{"sizes": {num_blocks: {...}}}`` with both engines."""
    sizes = [1, 16, 64, 256] if quick else [1, 16, 64, 256, 1024]
    num_iters = {1: 200, 16: 30, 64: 10, 256: 5, 1024: 3}
    kv = _kv_runs(sizes, num_iters)
    for size, row in kv.items():
        if size >= 16:
            perf = _perftest(int(row["nbytes"]), max(5, num_iters[size]))
            row["perftest_gb_per_s"] = perf
            row["ratio"] = row["gb_per_s"] / perf
    return {"block_nbytes": BLOCK_NBYTES, "sizes": kv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 1024-block size")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    result = run(args.quick)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"{'blocks':>6} {'MiB':>7} {'GB/s':>6} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'perftest GB/s':>13} {'ratio':>6}")
    for size, row in result["sizes"].items():
        print(f"{size:>6} {row['nbytes'] / 2**20:>7.0f} {row['gb_per_s']:>6.2f} "
              f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
              f"{row.get('perftest_gb_per_s', float('nan')):>13.2f} "
              f"{row.get('ratio', float('nan')):>6.2f}")


if __name__ == "__main__":
    main()
