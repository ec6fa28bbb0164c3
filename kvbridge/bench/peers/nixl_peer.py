"""NIXL as a transfer peer: UCX backend, DRAM segments, READ of scattered blocks.

Called by ``kvbridge/bench/transfer_bench.py`` through :func:`run_peer`; also a
script (``python -m kvbridge.bench.peers.nixl_peer --blocks 1,16,1024``).

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

import base64
import os
import sys
import time
from collections.abc import Generator
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.bench.peers.harness import (
    PairPeer,
    Payload,
    Request,
    time_requests,
    workload_from_spec,
)
from kvbridge.bench.peers.placement import LOOPBACK, Placement
from kvbridge.bench.peers.results import PeerOutcome
from kvbridge.bench.peers.workload import IdArray, KVWorkload

PEER = "nixl"
_PEER = PairPeer(PEER, "kvbridge.bench.peers.nixl_peer", "nixl_cu12",
                 missing="nixl-cu12 is not installed (pip install --no-deps nixl-cu12)",
                 min_gbps=0.05)


class NixlTransferError(RuntimeError):
    """A NIXL transfer ended in ERR or missed its deadline."""


def run_peer(sizes: list[int], iters: int, workload: KVWorkload | None = None,
             warmup: int = 2, timeout_s: float | None = None,
             placement: Placement = LOOPBACK) -> PeerOutcome:
    """Read ``sizes`` bytes of scattered blocks through NIXL; see :meth:`PairPeer.run`."""
    return _PEER.run(sizes, iters, workload, warmup, timeout_s, placement)


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
    return _PEER.main(argv, __doc__.splitlines()[0], _serve, _read)


if __name__ == "__main__":
    sys.exit(main())
