"""Transfer benchmark: kvbridge's ``TransferAgent`` beside NIXL, Mooncake and ``ucx_perftest``.

Called by ``kvbridge bench transfer`` (``kvbridge/bench/cli.py``); also a
script (``python -m kvbridge.bench.transfer_bench --quick --peers nixl``).

Every system moves the same bytes at the same scatter granularity. The unit is
a *piece*: one layer's K and V of one 16-token block (8 KV heads, head dim 128,
bf16) = 64 KiB, the peers' "block" (``kvbridge/bench/peers/workload.py``). A
kvbridge block spans all the layers of its cache, so a request of ``n`` blocks
over ``L`` layers is ``n * L`` pieces. Each size is mapped so that the piece
counts agree::

    pieces  1     16     32     64     256     1024    4096
    bytes   64KiB 1MiB   2MiB   4MiB   16MiB   64MiB   256MiB
    kvb L   1     16     32     32     32      32      32        L = min(32, pieces)
    kvb n   1     1      1      2      8       32      128       n = pieces / L

Inside one kvbridge layer a block's K and V are two 32 KiB runs (the cache is
``[2, num_blocks, ...]``), as in vLLM's layout; the peers' 64 KiB pieces are
one run each. The 2 MiB point (32 layers, one block) is the model's real
one-block request; its p50/p99 are the "1-block latency".

kvbridge runs as two processes on loopback per layer count: a serving
agent (fills its cache with a pattern, issues a grant per request) and a
reading agent, timed from ``start_read`` to the read showing up in
``get_finished`` (grant, handshake reuse, chunked read, unpack, done report).
Both are on this host, so by default the reader copies the blocks out of the
server's process itself (``kvbridge.transfer.reading.same_host``); the pseudo-peer
``kvbridge_ucx`` runs the same with that off: every byte through UCX, as
between two hosts; ``kvbridge_copy`` times the kernel's part of a same-host read
alone (the same blocks by bare ``process_vm_readv`` calls on one thread, no grant,
board or outcome around them): the floor of a one-thread read (kvbridge shares
copies of 8 MiB and more out over threads, and passes it there).
Block ids are scattered over a pool twice the largest request (at least 32
blocks: 2 MiB per layer, so caches get huge pages as an engine's do). After the timed
requests of each size the reader checks every named block against the pattern
and every other block for zeros.

With ``netns=True`` (``--netns``) every system runs between two network
namespace hosts instead (``kvbridge/bench/peers/placement.py``): serving side in
host ``a`` (10.77.0.1), reading side in ``b`` (10.77.0.2), over their veth
links with ``UCX_TLS=tcp`` for every child, same-host copies off (so
``kvbridge_ucx`` is ``kvbridge`` again). The hosts are built before the first
system runs and removed after the last, whatever happens; the report says which
``network`` ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.bench.peers import PEER_NAMES, KVWorkload, run_named_peer
from kvbridge.bench.peers.placement import LOOPBACK, Placement, netns_placement
from kvbridge.bench.peers.results import PeerOutcome, PeerResult, Unavailable

PIECE_NBYTES = 64 << 10
#: kvbridge's pool per layer is at least 2 MiB (32 blocks of 64 KiB): a real engine's
#: caches are GiBs, on huge pages where the OS gives them (``kv_cache_zeros``); a 1 MiB
#: layer would not be, and would time 4 KiB page walks (2x slower copies) instead.
MIN_POOL_BLOCKS = 32
MAX_LAYERS = 32
FULL_PIECES = (1, 16, 32, 64, 256, 1024, 4096)
QUICK_PIECES = (1, 16, 32, 64, 256, 1024)
LATENCY_PIECES = MAX_LAYERS  # one block of the 32-layer model
_TIMEOUT_S = 300.0
#: Run kvbridge a second time with same-host copies off (every byte through UCX).
KVBRIDGE_UCX = "kvbridge_ucx"
#: The same blocks by bare ``process_vm_readv`` calls, nothing around them (one host only).
KVBRIDGE_COPY = "kvbridge_copy"
OWN_PSEUDO_PEERS = (KVBRIDGE_UCX, KVBRIDGE_COPY)

Progress = Callable[[str, int, int], None]
"""``progress(what just finished, steps done, total steps)``."""


@dataclass(frozen=True, slots=True)
class SizePoint:
    """One request size and how kvbridge expresses it.

    Attributes:
        num_pieces: 64 KiB pieces per request (the peers' block count).
        num_layers: Layers of kvbridge's caches at this size.
        num_blocks: kvbridge blocks per request.
    """

    num_pieces: int
    num_layers: int
    num_blocks: int

    @property
    def nbytes(self) -> int:
        return self.num_pieces * PIECE_NBYTES

    @classmethod
    def of(cls, num_pieces: int) -> SizePoint:
        """Map a piece count to kvbridge layers x blocks (see the module docstring).

        Raises:
            ValueError: ``num_pieces`` < 1, or > 32 and not a multiple of 32.
        """
        if num_pieces < 1 or (num_pieces > MAX_LAYERS and num_pieces % MAX_LAYERS):
            raise ValueError(f"num_pieces must be in [1, {MAX_LAYERS}] or a multiple of "
                             f"{MAX_LAYERS}, got {num_pieces}")
        num_layers = min(MAX_LAYERS, num_pieces)
        return cls(num_pieces, num_layers, num_pieces // num_layers)


def kvbridge_iters(nbytes: int, quick: bool) -> int:
    """Timed requests per size: many for small sizes (p99 latency), fewer for big ones."""
    if nbytes <= 2 << 20:
        return 50 if quick else 200
    return 10 if quick else (50 if nbytes <= 16 << 20 else 20)


def run_kvbridge(points: Sequence[SizePoint], quick: bool,
                 progress: Progress | None = None, name: str = "kvbridge",
                 placement: Placement = LOOPBACK) -> list[PeerResult]:
    """Time kvbridge at every point; one process pair per layer count.

    ``name`` ``kvbridge``: as configured by default (both agents on this host,
    so the reader copies out of the server's process); ``kvbridge_ucx``: with
    same-host copies off, every byte through UCX as between two hosts. On two
    namespace hosts (``placement``) both are the latter. ``kvbridge_copy``: the
    kernel's part alone (``transfer_agents.CopyYardstick``), one host only.

    Raises:
        RuntimeError: a read failed or the data did not verify.
    """
    from kvbridge.bench.transfer_agents import AgentPair

    results: list[PeerResult] = []
    for num_layers in sorted({p.num_layers for p in points}):
        group = [p for p in points if p.num_layers == num_layers]
        num_pool_blocks = max(2 * max(p.num_blocks for p in group), MIN_POOL_BLOCKS)
        with AgentPair(num_layers, num_pool_blocks, _TIMEOUT_S,
                       local_copy=name != KVBRIDGE_UCX, name=name, placement=placement) as pair:
            for point in group:
                measure = pair.measure_copy if name == KVBRIDGE_COPY else pair.measure
                results.append(measure(point.num_blocks, kvbridge_iters(point.nbytes, quick),
                                       point.nbytes))
                if progress is not None:
                    progress(f"{name} {point.nbytes >> 10} KiB", len(results), len(points))
    results.sort(key=lambda r: r.nbytes)
    return results


def _try_peer(name: str, sizes: list[int], iters: int, workload: KVWorkload,
              placement: Placement) -> PeerOutcome:
    try:
        return run_named_peer(name, sizes, iters, workload, placement)
    except Exception as exc:  # a peer must never end the run
        return Unavailable(name, f"{type(exc).__name__}: {exc}")


def run_peer_safely(name: str, sizes: list[int], iters: int,
                    placement: Placement = LOOPBACK) -> tuple[PeerOutcome, dict[int, str]]:
    """``run_named_peer`` on the shared workload, placed as ``placement``; never raises.

    A peer that fails the whole run is retried one size at a time (same pool,
    same block ids), so that one size it cannot do (e.g. a batch too large)
    does not hide the others; it is given up when the smallest size fails too.

    Returns:
        The results (or ``Unavailable``) and ``{nbytes: reason}`` of sizes that failed.
    """
    workload = KVWorkload.for_sizes(sizes)
    outcome = _try_peer(name, sizes, iters, workload, placement)
    if not isinstance(outcome, Unavailable) or len(sizes) == 1:
        return outcome, {}
    results: list[PeerResult] = []
    failures: dict[int, str] = {}
    for nbytes in sizes:
        one = _try_peer(name, [nbytes], iters, workload, placement)
        if isinstance(one, Unavailable):
            if not results:
                return outcome, {}
            failures[nbytes] = one.reason
        else:
            results += one
    return results, failures


def run(quick: bool = False, peers: Sequence[str] = (), pieces: Sequence[int] | None = None,
        peer_iters: int | None = None, progress: Progress | None = None,
        netns: bool = False) -> dict[str, Any]:
    """Run kvbridge and each of ``peers`` at the same sizes.

    Args:
        quick: Sizes up to 64 MiB and fewer requests per size.
        peers: Names from ``kvbridge.bench.peers.PEER_NAMES``.
        pieces: Request sizes in 64 KiB pieces (default by mode).
        peer_iters: Timed requests per size for the peers (default 10 / 20).
        progress: Called after each finished step.
        netns: Every system between two network-namespace hosts over TCP
            (``UCX_TLS=tcp``) instead of on loopback; needs root and ``ip``.

    Returns:
        ``{"network": "loopback" | "netns-tcp", "placement", "workload",
        "systems": {name: [result] | {"unavailable": why}},
        "ratios": {peer: {nbytes: kvbridge / peer}}, "latency_1_block",
        "peer_failures": {peer: {nbytes: why}}}`` (sizes a peer could not do).

    Raises:
        ValueError: unknown peer or a bad size.
        RuntimeError: kvbridge's own run failed (peers never raise).
        NetnsUnavailableError: ``netns`` and the hosts cannot be built (before
            anything runs).
    """
    unknown = [p for p in peers if p not in PEER_NAMES and p not in OWN_PSEUDO_PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: "
                         f"{', '.join((*PEER_NAMES, *OWN_PSEUDO_PEERS))}")
    points = [SizePoint.of(n) for n in (pieces or (QUICK_PIECES if quick else FULL_PIECES))]
    hosts = netns_placement() if netns else contextlib.nullcontext(LOOPBACK)
    with hosts as placement:  # namespaces (if any) are gone when this block is left
        report = _run_all(points, quick, peers, peer_iters, progress, placement)
        return {"network": placement.network, "placement": placement.describe(), **report}


def _run_all(points: Sequence[SizePoint], quick: bool, peers: Sequence[str],
             peer_iters: int | None, progress: Progress | None,
             placement: Placement) -> dict[str, Any]:
    """Every system at ``points``, placed as ``placement``: the report but its placement."""
    sizes = [p.nbytes for p in points]
    total = len(points) * (1 + len(peers))

    def step(label: str, done: int, _total: int) -> None:
        if progress is not None:
            progress(label, done + offset, total)

    offset = 0
    outcomes: dict[str, PeerOutcome] = {
        "kvbridge": run_kvbridge(points, quick, step, placement=placement)}
    failures: dict[str, dict[int, str]] = {}
    for name in peers:
        offset += len(points)
        failed: dict[int, str]
        if name == KVBRIDGE_COPY and not placement.same_host:
            outcomes[name], failed = Unavailable(name, "needs both processes on one host"), {}
        elif name in OWN_PSEUDO_PEERS:  # ours too: a failure is one
            outcomes[name], failed = run_kvbridge(points, quick, name=name,
                                                  placement=placement), {}
        else:
            outcomes[name], failed = run_peer_safely(name, sizes,
                                                     peer_iters or (10 if quick else 20),
                                                     placement)
        if failed:
            failures[name] = failed
        step(name, len(points), total)
    return {**_report(points, outcomes), "peer_failures": failures}


def _report(points: Sequence[SizePoint], outcomes: dict[str, PeerOutcome]) -> dict[str, Any]:
    ours = {r.nbytes: r for r in outcomes["kvbridge"]} if isinstance(
        outcomes["kvbridge"], list) else {}
    ratios: dict[str, dict[int, float]] = {}
    for name, outcome in outcomes.items():
        if name != "kvbridge" and isinstance(outcome, list):
            ratios[name] = {r.nbytes: ours[r.nbytes].gbps_median / r.gbps_median
                            for r in outcome if r.nbytes in ours and r.gbps_median > 0}
    one_block = ours.get(LATENCY_PIECES * PIECE_NBYTES)
    return {
        "workload": {
            "piece_nbytes": PIECE_NBYTES, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16",
            "block_size": 16,
            "mapping": [{"nbytes": p.nbytes, "num_pieces": p.num_pieces,
                         "kvbridge_num_layers": p.num_layers,
                         "kvbridge_num_blocks": p.num_blocks} for p in points],
        },
        "systems": {name: ([r.to_json() for r in o] if isinstance(o, list) else o.to_json())
                    for name, o in outcomes.items()},
        "ratios": ratios,
        "latency_1_block": None if one_block is None else {
            "num_layers": MAX_LAYERS, "nbytes": one_block.nbytes,
            "p50_us": one_block.latency_p50_us, "p99_us": one_block.latency_p99_us},
    }


def main(argv: list[str] | None = None) -> int:
    """Script entry: print the report as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 64 MiB, fewer iters")
    parser.add_argument("--peers", default="", help=f"comma list of {', '.join(PEER_NAMES)}")
    parser.add_argument("--netns", action="store_true",
                        help="between two network-namespace hosts over TCP (root)")
    args = parser.parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    json.dump(run(args.quick, peers, netns=args.netns), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
