"""Mooncake Transfer Engine as a transfer peer: TCP, P2P handshake, batch READ.

Called by ``kvbridge/bench/transfer_bench.py`` through :func:`run_peer`; also a
script (``python -m kvbridge.bench.peers.mooncake_peer --blocks 1,16,1024``).

Both sides start a ``TransferEngine`` with protocol ``tcp`` and metadata
``P2PHANDSHAKE`` (no metadata server: the engines exchange segment metadata
over their own RPC port). Each engine is named after its side's address
(``spec["host"]``: 127.0.0.1 on loopback, the namespace host's eth0 address
with ``--netns``). The target registers its source pool and hands its session
name (``<its address>:<rpc port>``) and pool address to the parent, which
passes them to the initiator in-band (see ``harness``). Per request the
initiator issues one ``batch_transfer_sync_read`` naming every scattered block
(one address pair per block); that call is what is timed.

Needs PyPI ``mooncake-transfer-engine-non-cuda`` and, from Debian,
``libibverbs1``, ``libnl-3-200`` and ``libnl-route-3-200`` (its engine library
links them even for TCP).
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import Any

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

PEER = "mooncake"
_PEER = PairPeer(PEER, "kvbridge.bench.peers.mooncake_peer", "mooncake",
                 missing="mooncake-transfer-engine-non-cuda is not installed "
                         "(pip install mooncake-transfer-engine-non-cuda)",
                 min_gbps=0.02)  # TCP on loopback runs well under 1 GB/s here


class MooncakeError(RuntimeError):
    """A Mooncake call returned a failure code."""


def run_peer(sizes: list[int], iters: int, workload: KVWorkload | None = None,
             warmup: int = 2, timeout_s: float | None = None,
             placement: Placement = LOOPBACK) -> PeerOutcome:
    """Read ``sizes`` bytes of scattered blocks through Mooncake; see :meth:`PairPeer.run`.

    ``Unavailable`` also when its system libraries are missing (the reason says which).
    """
    return _PEER.run(sizes, iters, workload, warmup, timeout_s, placement)


def _new_engine(host: str) -> Any:
    """A TCP engine with P2P handshake named after ``host`` (untyped third-party object).

    Raises:
        MooncakeError: ``initialize`` failed.
    """
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # e.g. libibverbs.so.1 missing: say which
        raise MooncakeError(f"cannot load mooncake.engine: {exc}") from exc
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise MooncakeError(f"TransferEngine.initialize(tcp, P2PHANDSHAKE) returned {rc}")
    return engine


def _register(engine: Any, addr: int, nbytes: int) -> None:
    rc = engine.register_memory(addr, nbytes)
    if rc != 0:
        raise MooncakeError(f"register_memory of {nbytes} B at {addr:#x} returned {rc}")


def _serve(spec: Payload) -> Generator[Payload, None, None]:
    """Target: fill and register the source pool, publish the session name."""
    workload = workload_from_spec(spec)
    pool = workload.new_pool()
    workload.fill_source(pool)
    host = str(spec["host"])
    engine = _new_engine(host)
    _register(engine, pool.ctypes.data, pool.nbytes)
    try:
        yield {"session": f"{host}:{engine.get_rpc_port()}", "base_addr": pool.ctypes.data}
    finally:
        engine.unregister_memory(pool.ctypes.data)


def _read(spec: Payload, target: Payload) -> list[Payload]:
    """Initiator: time batch READs of the scattered blocks, verify."""
    workload = workload_from_spec(spec)
    session = str(target["session"])
    remote_base = int(target["base_addr"])
    pool = workload.new_pool()
    engine = _new_engine(str(spec["host"]))
    _register(engine, pool.ctypes.data, pool.nbytes)
    block_nbytes = workload.block_nbytes

    def prepare(remote_ids: IdArray, local_ids: IdArray) -> Request:
        # Address lists are built once per size, as a connector would when it
        # plans a request; only the transfer call is timed.
        local_addrs = [pool.ctypes.data + int(i) * block_nbytes for i in local_ids]
        remote_addrs = [remote_base + int(i) * block_nbytes for i in remote_ids]
        lengths = [block_nbytes] * len(local_addrs)

        def request() -> None:
            rc = engine.batch_transfer_sync_read(session, local_addrs, remote_addrs, lengths)
            if rc != 0:
                raise MooncakeError(f"batch READ of {len(lengths)} blocks returned {rc}")

        return request

    try:
        return time_requests(PEER, spec, pool, prepare)
    finally:
        engine.unregister_memory(pool.ctypes.data)


def main(argv: list[str] | None = None) -> int:
    """CLI: child roles (used by the harness) or a stand-alone run."""
    return _PEER.main(argv, __doc__.splitlines()[0], _serve, _read)


if __name__ == "__main__":
    sys.exit(main())
