"""Transfer engines measured beside kvbridge on the same KV-shaped workload.

``kvbridge/bench/transfer_bench.py`` (``kvbridge bench transfer --peers ...``)
builds the request sizes with :func:`sizes_for_blocks`, runs kvbridge's agent,
and calls :func:`run_named_peer` for each requested peer in the same run.

Map of this package:
    workload.py       KV-shaped blocks, scattered ids, deterministic fill, verify
    results.py        PeerResult / Unavailable and the statistics behind them
    harness.py        two-process runner: target + initiator, metadata in-band
    placement.py      where the two sides run: loopback, or two netns hosts over TCP
    child_env.py      children's environment without what ``import ucxx`` added
    cli.py            the stand-alone ``python -m kvbridge.bench.peers.<peer>`` command
    ucx_perftest.py   tag_bw / ucp_get of the libucx wheel's binary (UCX ceiling)
    nixl_peer.py      NIXL, UCX backend, DRAM, READ of scattered blocks
    mooncake_peer.py  Mooncake Transfer Engine, tcp, P2PHANDSHAKE, batch READ

Peer modules are imported on first use, so ``python -m
kvbridge.bench.peers.<peer>`` does not import itself twice. ``child_env`` is
imported here, as early as possible: it notes the UCX_* variables before any
later ``import ucxx`` changes them.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

from kvbridge.bench.peers import child_env as _child_env  # noqa: F401  (snapshot, see above)
from kvbridge.bench.peers.placement import LOOPBACK, Placement
from kvbridge.bench.peers.results import PeerOutcome, PeerResult, Unavailable
from kvbridge.bench.peers.workload import (
    DEFAULT_BLOCK_COUNTS,
    KVShape,
    KVWorkload,
    WorkloadError,
    sizes_for_blocks,
)

PEER_NAMES: tuple[str, ...] = ("ucx_perftest", "ucx_perftest_get", "nixl", "mooncake")
_PEER_MODULES = MappingProxyType({
    "ucx_perftest": "kvbridge.bench.peers.ucx_perftest",
    "ucx_perftest_get": "kvbridge.bench.peers.ucx_perftest",
    "nixl": "kvbridge.bench.peers.nixl_peer",
    "mooncake": "kvbridge.bench.peers.mooncake_peer",
})


def run_named_peer(name: str, sizes: list[int], iters: int,
                   workload: KVWorkload | None = None,
                   placement: Placement = LOOPBACK) -> PeerOutcome:
    """Run one peer by name on ``sizes`` (bytes) for ``iters`` requests each.

    Args:
        name: One of :data:`PEER_NAMES`.
        sizes: Request sizes in bytes, multiples of the block size.
        iters: Timed requests per size.
        workload: Shared pool geometry; default fits ``sizes``.
        placement: Where its serving and reading sides run (default: loopback).

    Returns:
        One ``PeerResult`` per size, or ``Unavailable`` with the reason.

    Raises:
        ValueError: unknown ``name`` or bad sizes/iters.
    """
    if name not in _PEER_MODULES:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")
    module = importlib.import_module(_PEER_MODULES[name])
    extra = {"test": "ucp_get"} if name == "ucx_perftest_get" else {}
    outcome: PeerOutcome = module.run_peer(sizes, iters, workload=workload,
                                           placement=placement, **extra)
    return outcome


__all__ = [
    "DEFAULT_BLOCK_COUNTS",
    "PEER_NAMES",
    "KVShape",
    "KVWorkload",
    "LOOPBACK",
    "PeerOutcome",
    "PeerResult",
    "Placement",
    "Unavailable",
    "WorkloadError",
    "run_named_peer",
    "sizes_for_blocks",
]
