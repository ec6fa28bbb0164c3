"""NIXL as a transfer peer: UCX backend, DRAM segments, READ of scattered blocks.

Called by ``benchmarks/transfer_bench.py`` through :func:`run_peer`; also a
script (``python -m benchmarks.peers.nixl_peer --blocks 1,16,1024``).

The target registers its source pool with a NIXL agent and hands its agent
metadata (``get_agent_metadata``) and pool address to the parent, which passes
them to the initiator in-band (see ``harness``). The initiator registers its
destination pool, loads the target's metadata, prepares one descriptor per
block on both sides once, and per request does what a KV connector does:
``make_prepped_xfer("READ", local ids, remote ids)``, ``transfer``, poll until
done, release. That whole sequence is what is timed.

Needs PyPI ``nixl-cu12`` installed with ``--no-deps`` (it lists torch, which
must stay as it is); it bundles its own UCX.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import os
import sys
import time
from collections.abc import Generator
from typing import Any

import numpy as np
import numpy.typing as npt

from benchmarks.peers.harness import (
    Payload,
    PeerRunError,
    Request,
    child_main,
    run_pair,
    time_requests,
    workload_from_spec,
    workload_spec,
)
from benchmarks.peers.results import PeerOutcome, PeerResult, Unavailable
from benchmarks.peers.workload import (
    DEFAULT_BLOCK_COUNTS,
    IdArray,
    KVWorkload,
    sizes_for_blocks,
)

PEER = "nixl"
_MODULE = "benchmarks.peers.nixl_peer"
_DEFAULT_WARMUP = 2


class NixlTransferError(RuntimeError):
    """A NIXL transfer ended in ERR or missed its deadline."""


def run_peer(sizes: list[int], iters: int, workload: KVWorkload | None = None,
             warmup: int = _DEFAULT_WARMUP, timeout_s: float | None = None) -> PeerOutcome:
    """Read ``sizes`` bytes of scattered blocks through NIXL between two processes.

    Args:
        sizes: Request sizes in bytes, multiples of the workload's block size.
        iters: Timed requests per size (after ``warmup`` untimed ones).
        workload: Pool geometry and content; default fits ``sizes``.
        warmup: Untimed requests per size (the first also connects).
        timeout_s: Deadline per step; default scales with the bytes moved.

    Returns:
        One verified-or-not ``PeerResult`` per size, or ``Unavailable`` when
        ``nixl-cu12`` is missing or the run failed (the reason says which).

    Raises:
        WorkloadError: a size does not fit the workload.
        ValueError: ``iters`` < 1 or ``warmup`` < 0.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters} warmup={warmup}")
    workload = workload or KVWorkload.for_sizes(sizes)
    for nbytes in sizes:
        workload.num_blocks_for(nbytes)
    if importlib.util.find_spec("nixl_cu12") is None:
        return Unavailable(PEER, "nixl-cu12 is not installed (pip install --no-deps nixl-cu12)")
    if timeout_s is None:
        timeout_s = 60.0 + sum(sizes) * (iters + warmup) / 50e6
    spec = workload_spec(workload, sizes, iters, warmup, timeout_s)
    try:
        rows = run_pair(_MODULE, spec, timeout_s)
    except PeerRunError as exc:
        return Unavailable(PEER, str(exc))
    return [PeerResult(**row) for row in rows]


def _block_descs(base_addr: int, workload: KVWorkload) -> npt.NDArray[np.uint64]:
    """One ``(address, nbytes, device 0)`` row per pool block."""
    descs = np.zeros((workload.num_pool_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_addr + np.arange(workload.num_pool_blocks, dtype=np.uint64) * np.uint64(
        workload.block_nbytes
    )
    descs[:, 1] = workload.block_nbytes
    return descs


def _new_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend (untyped third-party object)."""
    from nixl_cu12 import nixl_agent, nixl_agent_config

    return nixl_agent(f"kvb-{role}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))


def _serve(spec: Payload) -> Generator[Payload, None, None]:
    """Target: fill and register the source pool, publish metadata."""
    workload = workload_from_spec(spec)
    pool = workload.new_pool()
    workload.fill_source(pool)
    agent = _new_agent("target")
    reg = agent.register_memory(
        [(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM"
    )
    try:
        metadata: bytes = agent.get_agent_metadata()
        yield {"metadata": base64.b64encode(metadata).decode(), "base_addr": pool.ctypes.data}
    finally:
        agent.deregister_memory(reg)


def _read(spec: Payload, target: Payload) -> list[Payload]:
    """Initiator: load the target's metadata, time READs, verify."""
    workload = workload_from_spec(spec)
    deadline_s = float(spec["timeout_s"])
    pool = workload.new_pool()
    agent = _new_agent("initiator")
    reg = agent.register_memory(
        [(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM"
    )
    remote = agent.add_remote_agent(
        base64.b64decode(target["metadata"])
    )
    local_side = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", _block_descs(pool.ctypes.data, workload), "DRAM"
    )
    remote_side = agent.prep_xfer_dlist(
        remote, _block_descs(int(target["base_addr"]), workload), "DRAM"
    )

    def prepare(remote_ids: IdArray, local_ids: IdArray) -> Request:
        local_idx = local_ids.astype(np.int32)
        remote_idx = remote_ids.astype(np.int32)

        def request() -> None:
            handle = agent.make_prepped_xfer(
                "READ", local_side, local_idx, remote_side, remote_idx
            )
            try:
                state = agent.transfer(handle)
                give_up = time.monotonic() + deadline_s
                while state == "PROC":
                    if time.monotonic() > give_up:
                        raise NixlTransferError(f"READ not done after {deadline_s:.0f} s")
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise NixlTransferError(f"READ of {local_idx.size} blocks ended in {state}")
            finally:
                agent.release_xfer_handle(handle)

        return request

    try:
        return time_requests(PEER, spec, pool, prepare)
    finally:
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)


def main(argv: list[str] | None = None) -> int:
    """CLI: child roles (used by the harness) or a stand-alone run."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("target", "initiator"):
        return child_main(args[0], _serve, _read)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default=",".join(map(str, DEFAULT_BLOCK_COUNTS)))
    parser.add_argument("--iters", type=int, default=20)
    opts = parser.parse_args(args)
    sizes = sizes_for_blocks([int(n) for n in opts.blocks.split(",")])
    outcome = run_peer(sizes, opts.iters)
    if isinstance(outcome, Unavailable):
        print(outcome)
        return 1
    for row in outcome:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
