"""Where a same-host read's time goes: the whole read against its floor.

``python -m benchmarks.read_floor [--layers 16,32] [--blocks 1] [--iters 1000] [--rounds 3]``

One serving agent process (``transfer_agents``: pattern-filled caches, a grant per
request) and a reading agent in this process. Per round and layer count it times,
over ``iters`` requests with a fresh grant each (as ``kvbridge bench transfer``):

- ``read``: ``start_read`` until ``get_finished`` names it (the whole agent);
- ``bare``: only what a grant-checked read cannot do without: the token's digest,
  its slot on the server's (mapped) board, the seq row set, one ``process_vm_readv``
  of the blocks then the slot's seq and the server's probe, the seq and probe check;
- ``copy``: that ``process_vm_readv`` alone.

``bare`` and ``copy`` reuse the rows the agent's inline reader prepared for the
same blocks (this reaches into the reader for them: a profiling tool, not an
API); their grants are released with ``notify_done``. After each part the
blocks are checked against the pattern (``transfer_agents._num_wrong``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.bench.transfer_agents import BLOCK_SIZE, _ChildAgent, _num_wrong, _serve_main

_POOL_BLOCKS = 64
_HOST = "127.0.0.1"
_REPLY_S = 120.0  # longest wait for the serving process (it starts torch and UCX)


class FloorError(RuntimeError):
    """A read failed, the board did not list a grant, or bytes did not verify."""


class _Pair:
    """The serving process and the reading agent of one layer count."""

    def __init__(self, num_layers: int, num_blocks: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_main,
                                 args=(child, num_layers, _POOL_BLOCKS, True), daemon=True)
        self._proc.start()
        self.port = self._reply()
        reader = _ChildAgent("bench-d", num_layers, _POOL_BLOCKS, True, "cpu", None)
        self.agent, self.caches = reader.agent, reader.caches
        self.agent.start()
        rng = np.random.default_rng([7, num_layers, num_blocks])
        self.remote_ids = [int(b) for b in rng.choice(_POOL_BLOCKS, num_blocks, False)]
        self.local_ids = [int(b) for b in rng.choice(_POOL_BLOCKS, num_blocks, False)]
        self._num_grants = 0

    def grant(self) -> tuple[str, str]:
        self._num_grants += 1
        request_id = f"floor-{self._num_grants}"
        self._conn.send(("grant", request_id, self.remote_ids))
        return request_id, self._reply()

    def _reply(self) -> Any:
        """The serving process's next message, within ``_REPLY_S``."""
        if not self._conn.poll(_REPLY_S):
            raise FloorError(f"no reply from the serving process in {_REPLY_S:.0f} s "
                             f"(exit code {self._proc.exitcode})")
        return self._conn.recv()

    def release(self, request_id: str, token: str) -> None:
        self.agent.notify_done(request_id, engine_id="bench-p", host=_HOST, port=self.port,
                               grant=token)

    def read(self) -> float:
        request_id, token = self.grant()
        started = time.perf_counter()
        self.agent.start_read(request_id, engine_id="bench-p", host=_HOST, port=self.port,
                              remote_block_ids=self.remote_ids, local_block_ids=self.local_ids,
                              grant=token, num_tokens=len(self.remote_ids) * BLOCK_SIZE)
        while request_id not in self.agent.get_finished()[1]:
            self.agent.wait_finished(1.0)
        elapsed = time.perf_counter() - started
        if self.agent.get_failed_block_ids():
            raise FloorError(f"read {request_id} failed: {self.agent.get_stats()}")
        self.agent.get_stats()
        return elapsed

    def parts(self) -> tuple[Callable[[], float], Callable[[], float]]:
        """``bare`` and ``copy`` on the inline reader's prepared copy of these blocks."""
        from kvbridge.transfer.protocol.grant_board import (
            SLOT_NBYTES,
            find_grant,
            grant_digest,
            home_slot,
        )
        from kvbridge.transfer.reading import libc

        prepared: Any = next(iter(self.agent._running.reads._inline._prepared.values()))
        source = prepared.link.same_host.source
        if not prepared.whole or source._board is None or libc.process_vm_readv is None:
            raise FloorError("the read is not one mapped-board process_vm_readv here")
        board, slots, board_address = source._board, source.board_slots, source.board_address
        readv, pid, probe = libc.process_vm_readv, source.pid, source.probe
        place = prepared.go.place
        block_ids, remote, tail = prepared.block_ids, prepared.remote, prepared.tail
        local_rows, remote_rows, want = prepared.rows
        num_rows = len(prepared.local)

        def bare() -> float:
            request_id, token = self.grant()
            started = time.perf_counter()
            digest = grant_digest(token)
            spot = find_grant(board, home_slot(digest, slots) * SLOT_NBYTES, board_address,
                              digest, block_ids, b"", time.monotonic(), place)
            if spot is None:
                raise FloorError(f"grant of {request_id} not on the board")
            remote[-2, 0] = spot.seq_address
            got = readv(pid, local_rows, num_rows, remote_rows, num_rows, 0)
            landed = tail.tobytes()
            kept = (got == want and landed[8:] == probe
                    and int.from_bytes(landed[:8], "little") == spot.seq)
            elapsed = time.perf_counter() - started
            self.release(request_id, token)
            if not kept:
                raise FloorError(f"bare read of {request_id} not kept")
            return elapsed

        def copy() -> float:
            request_id, token = self.grant()
            started = time.perf_counter()
            got = readv(pid, local_rows, num_rows - 2, remote_rows, num_rows - 2, 0)
            elapsed = time.perf_counter() - started
            self.release(request_id, token)
            if got != prepared.nbytes:
                raise FloorError(f"copy moved {got} of {prepared.nbytes} bytes")
            return elapsed

        return bare, copy

    def timed(self, part: Callable[[], float], iters: int) -> float:
        """Median seconds of ``iters`` runs of ``part``, its bytes verified."""
        for cache in self.caches:
            cache.zero_()
        seconds = float(np.median([part() for _ in range(iters)]))
        wrong = _num_wrong(self.caches, np.array(self.remote_ids), np.array(self.local_ids))
        if wrong:
            raise FloorError(f"{wrong} blocks wrong")
        return seconds

    def close(self) -> None:
        self.agent.close()
        try:
            self._conn.send(("close",))
            self._reply()
        finally:
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.kill()


def run(layers: list[int], num_blocks: int, iters: int, rounds: int) -> list[dict[str, Any]]:
    """``{"layers", "nbytes", "round", "read_us", "bare_us", "copy_us"}`` per round and count."""
    rows = []
    for num_layers in layers:
        pair = _Pair(num_layers, num_blocks)
        try:
            for _ in range(3):
                pair.read()  # handshake, go, prepared copy
            bare, copy = pair.parts()
            nbytes = num_layers * num_blocks * 2 * pair.caches[0][0, 0].nbytes
            for round_ in range(rounds):
                rows.append({"layers": num_layers, "nbytes": nbytes, "round": round_,
                             "read_us": pair.timed(pair.read, iters) * 1e6,
                             "bare_us": pair.timed(bare, iters) * 1e6,
                             "copy_us": pair.timed(copy, iters) * 1e6})
        finally:
            pair.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="16,32", help="comma list of layer counts")
    parser.add_argument("--blocks", type=int, default=1, help="blocks per read")
    parser.add_argument("--iters", type=int, default=1000, help="reads per part and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    layers = [int(n) for n in args.layers.split(",") if n]
    print("| layers | KiB | round | read p50 us | bare p50 us | copy p50 us |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in run(layers, args.blocks, args.iters, args.rounds):
        print(f"| {row['layers']} | {row['nbytes'] >> 10} | {row['round']} | "
              f"{row['read_us']:.1f} | {row['bare_us']:.1f} | {row['copy_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
