"""RMA prototype benchmark: "D asks, P puts" vs two-sided copies vs ucx_perftest and NIXL.

Two processes on loopback move the KV-shaped workload of ``benchmarks.peers``
(scattered 64 KiB blocks, 1 .. 1024 per request) three ways, in one run:

- ``rma_put``: D sends a request (its destination block ids) on the control
  channel; P checks the ids, puts each source block straight into D's
  registered pool (``kvbridge.transfer.rma``, zero-copy, no pack), flushes and
  answers ``Done``. Timed at D from request to ``Done``; ``put_us`` is P's
  put + flush alone.
- ``two_sided``: the current agent's data path without grants: D posts a
  receive, P gathers the blocks into staging and tag-sends it, D scatters the
  staging into its pool (3 copies).
- ``ucx_perftest`` ``ucp_put_bw`` and ``tag_bw`` at the same request sizes (one
  contiguous message per request, 32 in flight: the transport's ceiling), and
  NIXL READ of the same scattered blocks (``benchmarks.peers.nixl_peer``).

Every destination block is verified after each size. The machine is shared:
each configuration is repeated ``--repeats`` times and the table shows the
median of the per-run medians, with the load average at the start.

Usage::

    python -m benchmarks.rma_bench [--blocks 1,16,64,256,1024] [--iters 20]
        [--repeats 3] [--peers ucx_perftest,nixl] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.peers import run_named_peer
from benchmarks.peers.results import PeerResult, Unavailable, summarize
from benchmarks.peers.ucx_perftest import (
    PerftestError,
    _free_port,
    _is_listening,
    _parse_final_csv,
    _perftest_env,
    find_perftest,
)
from benchmarks.peers.workload import DEFAULT_BLOCK_COUNTS, KVWorkload, sizes_for_blocks

_HOST = "127.0.0.1"
_TIMEOUT_S = 30.0
_WARMUP = 3
_REQUEST = struct.Struct("<BII")  # mode, xfer id, number of blocks; then int64 local ids
_DONE = struct.Struct("<Id")  # xfer id, P's put + flush seconds
_WINDOW = struct.Struct("<QQ")  # D's pool address, nbytes; then its packed rkey
_MODE_BYE, _MODE_PUT, _MODE_TWO_SIDED = 0, 1, 2
_MAX_FRAME = 1 << 16


# ------------------------------------------------------------------------- P side
def _serve(workload: KVWorkload, port_queue: Any) -> None:
    asyncio.run(_serve_async(workload, port_queue))


async def _serve_async(workload: KVWorkload, port_queue: Any) -> None:
    from kvbridge.transfer.rma import Rma, new_rma_worker

    worker = new_rma_worker()
    rma = Rma(worker)
    src = workload.new_pool()
    workload.fill_source(src)
    staging = np.empty_like(src)
    src_reg = rma.register_tensor(src)
    finished = asyncio.Event()
    block = workload.block_nbytes

    async def on_connect(conn: Any) -> None:
        hello = await conn.recv_frame(max_nbytes=_MAX_FRAME, timeout_s=_TIMEOUT_S)
        base, nbytes = _WINDOW.unpack_from(hello)
        dst = rma.unpack_rkey(conn, hello[_WINDOW.size:], base, nbytes)
        while True:
            frame = await conn.recv_frame(max_nbytes=_MAX_FRAME, timeout_s=300.0)
            mode, xfer, num_blocks = _REQUEST.unpack_from(frame)
            if mode == _MODE_BYE:
                break
            local_ids = np.frombuffer(frame, np.int64, num_blocks, _REQUEST.size)
            # Stands in for the grant: P decides which of its blocks a request gets.
            remote_ids, _ = workload.block_ids(num_blocks)
            if mode == _MODE_PUT:
                started = time.perf_counter()
                await rma.put(src_reg, dst, remote_ids * block, local_ids * block, block,
                              timeout_s=_TIMEOUT_S)
                put_s = time.perf_counter() - started
                await conn.send_frame(_DONE.pack(xfer, put_s), timeout_s=_TIMEOUT_S)
            else:
                packed = staging[: num_blocks * block].reshape(num_blocks, block)
                np.take(src.reshape(-1, block), remote_ids, axis=0, out=packed)
                await conn.send(staging[: num_blocks * block], 1, timeout_s=_TIMEOUT_S)
        dst.close()
        conn.abort()
        finished.set()

    try:
        port_queue.put(worker.listen(0, on_connect, timeout_s=_TIMEOUT_S))
        await asyncio.wait_for(finished.wait(), 3600.0)
    finally:
        rma.close()
        await worker.close()


# ------------------------------------------------------------------------- D side
@dataclass
class _Series:
    seconds: list[float] = field(default_factory=list)
    put_seconds: list[float] = field(default_factory=list)


async def _drive(workload: KVWorkload, port: int, block_counts: list[int],
                 iters: int) -> dict[str, dict[int, Any]]:
    from kvbridge.transfer.rma import new_rma_worker

    worker = new_rma_worker()
    try:  # an unclosed UcxWorker hangs interpreter exit
        return await _drive_on(worker, workload, port, block_counts, iters)
    finally:
        await worker.close()


async def _drive_on(worker: Any, workload: KVWorkload, port: int, block_counts: list[int],
                    iters: int) -> dict[str, dict[int, Any]]:
    from kvbridge.transfer.rma import Rma

    rma = Rma(worker)
    pool = workload.new_pool()
    pool[:] = 0  # fault the pages in before timing
    staging = np.empty_like(pool)
    reg = rma.register_tensor(pool, remote_write=True)
    conn = await worker.connect(_HOST, port, timeout_s=_TIMEOUT_S)
    await conn.send_frame(_WINDOW.pack(reg.address, reg.nbytes) + reg.packed_rkey,
                          timeout_s=_TIMEOUT_S)
    block = workload.block_nbytes
    out: dict[str, dict[int, Any]] = {"rma_put": {}, "two_sided": {}}
    xfer = 0
    for num_blocks in block_counts:
        remote_ids, local_ids = workload.block_ids(num_blocks)
        for mode, name in ((_MODE_PUT, "rma_put"), (_MODE_TWO_SIDED, "two_sided")):
            series = _Series()
            pool[:] = 0
            for i in range(_WARMUP + iters):
                xfer += 1
                request = _REQUEST.pack(mode, xfer, num_blocks) + local_ids.tobytes()
                started = time.perf_counter()
                if mode == _MODE_PUT:
                    await conn.send_frame(request, timeout_s=_TIMEOUT_S)
                    done = await conn.recv_frame(max_nbytes=_MAX_FRAME, timeout_s=_TIMEOUT_S)
                    got, put_s = _DONE.unpack(done)
                    assert got == xfer, f"Done for {got}, expected {xfer}"
                else:
                    arrived = conn.post_recv(staging[: num_blocks * block], 1)
                    await conn.send_frame(request, timeout_s=_TIMEOUT_S)
                    await conn.wait(arrived, timeout_s=_TIMEOUT_S, what="data")
                    pool.reshape(-1, block)[local_ids] = staging[: num_blocks * block].reshape(
                        num_blocks, block
                    )
                    put_s = 0.0
                elapsed = time.perf_counter() - started
                if i >= _WARMUP:
                    series.seconds.append(elapsed)
                    series.put_seconds.append(put_s)
            num_wrong = workload.verify(pool, remote_ids, local_ids)
            out[name][num_blocks] = (series, num_wrong == 0)
    await conn.send_frame(_REQUEST.pack(_MODE_BYE, 0, 0), timeout_s=_TIMEOUT_S)
    await asyncio.sleep(0.1)
    conn.abort()
    rma.close()
    return out


def _kvbridge_runs(workload: KVWorkload, block_counts: list[int],
                   iters: int) -> list[PeerResult]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_serve, args=(workload, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        raw = asyncio.run(_drive(workload, port, block_counts, iters))
    finally:
        server.join(10)
        if server.is_alive():
            server.kill()
    results = []
    for name, by_size in raw.items():
        for num_blocks, (series, verified) in by_size.items():
            put_us = statistics.median(series.put_seconds) * 1e6 if name == "rma_put" else 0.0
            note = f"P put+flush p50 {put_us:.0f} us" if name == "rma_put" else "pack+tag+unpack"
            results.append(summarize(name, num_blocks * workload.block_nbytes, num_blocks,
                                     series.seconds, verified, note))
    return results


# ------------------------------------------------------------------- baselines
def _perftest(test: str, nbytes: int) -> PeerResult | Unavailable:
    """One ``ucx_perftest`` run (at least 64 messages and 256 MiB)."""
    num_iters = max(64, -(-(256 << 20) // nbytes))
    binary = find_perftest()
    env = _perftest_env(binary)
    port = _free_port()
    server = subprocess.Popen([str(binary), "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        give_up = time.monotonic() + 10.0
        while not _is_listening(port):
            if server.poll() is not None or time.monotonic() > give_up:
                return Unavailable(f"perftest_{test}", "server did not listen")
            time.sleep(0.02)
        client = subprocess.run(
            [str(binary), _HOST, "-p", str(port), "-t", test, "-s", str(nbytes),
             "-n", str(num_iters), "-w", str(max(2, num_iters // 10)), "-f", "-v"],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )
        server.wait(timeout=60)
        run = _parse_final_csv(client.stdout, nbytes)
    except (PerftestError, subprocess.TimeoutExpired) as exc:
        return Unavailable(f"perftest_{test}", str(exc))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return PeerResult(f"perftest_{test}", nbytes, 1, run.num_iters, run.gbps_overall,
                      None, None, False, "contiguous, 32 in flight")


def _one_repeat(block_counts: list[int], iters: int, peers: list[str],
                clean_env: dict[str, str]) -> list[PeerResult]:
    sizes = sizes_for_blocks(block_counts)
    workload = KVWorkload.for_sizes(sizes)
    rows = _kvbridge_runs(workload, block_counts, iters)
    # Importing ucxx sets UCX_* variables (MEMTYPE_CACHE=n, RNDV_THRESH, ...) in this
    # process; the baselines' own UCX must not inherit them (NIXL runs ~10x slower).
    os.environ.clear()
    os.environ.update(clean_env)
    if "ucx_perftest" in peers:
        for test in ("ucp_put_bw", "tag_bw"):
            for nbytes in sizes:
                outcome = _perftest(test, nbytes)
                if isinstance(outcome, PeerResult):
                    rows.append(outcome)
                else:
                    print(f"  {outcome.peer}: {outcome}", file=sys.stderr)
    if "nixl" in peers:
        nixl = run_named_peer("nixl", sizes, iters, workload)
        if isinstance(nixl, Unavailable):
            print(f"  nixl: {nixl}", file=sys.stderr)
        else:
            rows.extend(nixl)
    return rows


def _table(runs: list[list[PeerResult]]) -> list[dict[str, Any]]:
    """Median over repeats of each (peer, size)."""
    grouped: dict[tuple[str, int], list[PeerResult]] = {}
    for rows in runs:
        for row in rows:
            grouped.setdefault((row.peer, row.nbytes), []).append(row)
    table = []
    for (peer, nbytes), rows in sorted(grouped.items()):
        p50s = [r.latency_p50_us for r in rows if r.latency_p50_us is not None]
        table.append({
            "peer": peer, "nbytes": nbytes, "num_blocks": rows[0].num_blocks,
            "gbps_median": statistics.median(r.gbps_median for r in rows),
            "gbps_runs": [round(r.gbps_median, 3) for r in rows],
            "latency_p50_us": statistics.median(p50s) if p50s else None,
            "verified": all(r.verified for r in rows), "note": rows[0].note,
        })
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default=",".join(map(str, DEFAULT_BLOCK_COUNTS)))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", default="ucx_perftest,nixl",
                        help="comma list of ucx_perftest, nixl (empty: kvbridge only)")
    parser.add_argument("--json", help="write the table and raw runs to this file")
    opts = parser.parse_args(argv)
    block_counts = [int(n) for n in opts.blocks.split(",")]
    peers = [p for p in opts.peers.split(",") if p]
    runs, loads, clean_env = [], [], dict(os.environ)
    for repeat in range(opts.repeats):
        loads.append(os.getloadavg()[0])
        print(f"repeat {repeat + 1}/{opts.repeats}, load average {loads[-1]:.2f}", file=sys.stderr)
        runs.append(_one_repeat(block_counts, opts.iters, peers, clean_env))
    table = _table(runs)
    print(f"load average at the start of each repeat: {', '.join(f'{x:.2f}' for x in loads)}")
    print(f"{'peer':<22}{'blocks':>7}{'MiB':>8}{'GB/s':>8}  {'runs':<22}{'p50 us':>9}  note")
    for row in table:
        p50 = row["latency_p50_us"]
        print(f"{row['peer']:<22}{row['num_blocks']:>7}{row['nbytes'] / 2**20:>8.2f}"
              f"{row['gbps_median']:>8.2f}  {str(row['gbps_runs']):<22}"
              f"{'-' if p50 is None else f'{p50:.0f}':>9}  "
              f"{'' if row['verified'] or row['peer'].startswith('perftest') else 'NOT VERIFIED '}"
              f"{row['note']}")
    if opts.json:
        with open(opts.json, "w") as out:
            json.dump({"load_averages": loads, "table": table,
                       "runs": [[r.to_json() for r in rows] for rows in runs]}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
