"""GB/s of kvbridge pack/unpack beside a memcpy yardstick and the reference's three-pass fix.

Workload: KV-shaped caches (default 32 layers, 8 heads, head dim 128, bf16, block
16), a shuffled list of blocks. For each case, in the same run:

- ``ours``: :func:`kvbridge.kernels.pack` / :func:`~kvbridge.kernels.unpack`
  (torch path on CPU, Triton on a GPU);
- ``memcpy``: ``torch`` copy of the same number of bytes between two caches;
- ``baseline``: what the reference does for the same fix. unpack: its receive-side
  post-processing on blocks that already sit in the cache (index_select ->
  permute/reshape -> index_copy_, three passes); pack: a naive advanced-index
  gather then a copy into the staging buffer. Cases the reference cannot do (a
  remote block larger than the local one) have no baseline.

GB/s counts payload bytes once; each number is the best of ``--reps`` runs, since
other processes share the machine. Run: ``python -m kvbridge.bench.kernel_bench --quick``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvbridge.kernels import pack, packed_format, unpack
from kvbridge.topology import KVLayout

NHD, HND = KVLayout.NHD, KVLayout.HND


@dataclass(frozen=True)
class Case:
    """One transfer: sender layout/block size -> receiver layout/block size."""

    name: str
    op: str  # "pack" or "unpack"
    remote: tuple[KVLayout, int]
    local: tuple[KVLayout, int]


CASES = [
    Case("pack", "pack", (NHD, 16), (NHD, 16)),
    Case("unpack same layout", "unpack", (NHD, 16), (NHD, 16)),
    Case("unpack HND->NHD", "unpack", (HND, 16), (NHD, 16)),
    Case("unpack bs 8->16 (HND)", "unpack", (HND, 8), (HND, 16)),
    Case("unpack HND bs 8 -> NHD bs 16", "unpack", (HND, 8), (NHD, 16)),
    Case("unpack bs 32->16 (NHD->HND)", "unpack", (NHD, 32), (HND, 16)),
]


@dataclass(frozen=True)
class Shape:
    num_layers: int = 32
    num_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16


def _caches(
    shape: Shape, layout: KVLayout, block_size: int, num_blocks: int, device: str
) -> list[torch.Tensor]:
    dims = (block_size, shape.num_heads) if layout == NHD else (shape.num_heads, block_size)
    # contents do not matter to a copy; full() is much cheaper than randn at GiB sizes
    return [
        torch.full(
            (2, num_blocks, *dims, shape.head_dim), float(i), dtype=shape.dtype, device=device
        )
        for i in range(shape.num_layers)
    ]


def _best_seconds(fn: Callable[[], object], reps: int, device: str, clock: str) -> float:
    """Best of ``reps`` timings of ``fn`` (after one warm-up call).

    ``clock="thread"`` measures this thread's CPU time: with one torch thread it
    ignores time lost to other processes, which the wall clock cannot.
    """
    now = time.thread_time if clock == "thread" else time.perf_counter
    fn()
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = now()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, now() - start)
    return best


def _three_pass(
    cache: torch.Tensor,
    ids: torch.Tensor,
    remote: tuple[KVLayout, int],
    local: tuple[KVLayout, int],
) -> None:
    """The reference's receive-side fix on one layer ``[2, nb, ...]`` (blocks already landed).

    Three passes per K/V half: gather the blocks, materialise the permuted copy,
    scatter it back. (The reference's reshape of a permuted view copies in the
    block-size cases; in the layout-only case it gathers twice instead.)
    """
    (r_layout, r_bs), (l_layout, l_bs) = remote, local
    ratio = l_bs // r_bs
    for half in cache:
        blocks = half.index_select(0, ids)  # pass 1
        n, a, b, d = blocks.shape
        if r_layout == l_layout:  # block size only, HND: ratio remote [H, r_bs] blocks per block
            permuted = blocks.reshape(n, ratio, a, r_bs, d).permute(0, 2, 1, 3, 4)
            fixed = permuted.reshape(n, a, l_bs, d)  # pass 2
        elif ratio == 1:  # layout only: remote HND bytes in a local NHD block
            fixed = blocks.reshape(n, b, a, d).permute(0, 2, 1, 3).contiguous()  # pass 2
        else:  # both: ratio remote HND blocks in one local NHD block
            permuted = blocks.reshape(n, ratio, b, r_bs, d).permute(0, 1, 3, 2, 4)
            fixed = permuted.reshape(n, l_bs, b, d)  # pass 2
        half.index_copy_(0, ids, fixed)  # pass 3


def _bench_case(
    case: Case, shape: Shape, num_blocks: int, reps: int, device: str, clock: str
) -> dict[str, object]:
    r_layout, r_bs = case.remote
    l_layout, l_bs = case.local
    num_tokens = num_blocks * 16
    p_blocks, d_blocks = num_tokens // r_bs, num_tokens // l_bs
    gen = torch.Generator().manual_seed(0)
    p_ids = torch.randperm(p_blocks, generator=gen).to(device)
    d_ids = torch.randperm(d_blocks, generator=gen).to(device)
    source = _caches(shape, r_layout, r_bs, p_blocks, device)
    buf = pack(source, p_ids, 0, shape.num_heads, r_layout)
    nbytes = buf.numel()
    result: dict[str, object] = {"case": case.name, "num_blocks": num_blocks, "nbytes": nbytes}

    if case.op == "pack":
        ours = _best_seconds(
            lambda: pack(source, p_ids, 0, shape.num_heads, r_layout, out=buf), reps, device, clock
        )
        per_layer = buf.view(shape.num_layers, -1)

        def naive() -> None:
            for layer, dst in zip(source, per_layer, strict=True):
                dst.view(shape.dtype).view(2, -1, *layer.shape[2:]).copy_(layer[:, p_ids])

        baseline: float | None = _best_seconds(naive, reps, device, clock)
        copy_dst = _caches(shape, r_layout, r_bs, p_blocks, device)
        memcpy_src = source
    else:
        fmt = packed_format(source, r_layout, 0, shape.num_heads)
        dest = _caches(shape, l_layout, l_bs, d_blocks, device)
        ours = _best_seconds(
            lambda: unpack(buf, fmt, p_blocks, dest, d_ids, l_layout, 0), reps, device, clock
        )
        needs_fix = case.remote != case.local
        supported = r_bs <= l_bs and r_layout in (l_layout, HND)

        def three_pass() -> None:
            for layer in dest:
                _three_pass(layer, d_ids, case.remote, case.local)

        baseline = (
            _best_seconds(three_pass, reps, device, clock) if needs_fix and supported else None
        )
        del source
        copy_dst, memcpy_src = dest, _caches(shape, l_layout, l_bs, d_blocks, device)

    def memcpy_all() -> None:
        for dst, src in zip(copy_dst, memcpy_src, strict=True):
            dst.copy_(src)

    memcpy = _best_seconds(memcpy_all, reps, device, clock)
    result["ours_gbps"] = nbytes / ours / 1e9
    result["memcpy_gbps"] = nbytes / memcpy / 1e9
    result["baseline_gbps"] = None if baseline is None else nbytes / baseline / 1e9
    result["vs_memcpy"] = memcpy / ours
    result["vs_baseline"] = None if baseline is None else baseline / ours
    return result


def run(
    quick: bool,
    blocks: list[int] | None = None,
    reps: int = 3,
    clock: str = "wall",
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, object]:
    """Run every case; ``quick`` uses 4 layers and fewer block counts.

    Args:
        quick: 4 layers and 64/256 blocks instead of 32 layers and 64/256/1024 blocks.
        blocks: block counts to run instead of the mode's.
        reps: timed runs per number (the best is kept).
        clock: ``"wall"``, or ``"thread"`` (CPU time of one torch thread; CPU only).
        progress: called as ``progress(case done, cases done, total cases)``.

    Returns:
        ``{"config": {...}, "results": [{case, num_blocks, nbytes, ours_gbps, ...}]}``.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if clock == "thread":
        if device == "cuda":
            raise ValueError("clock='thread' measures CPU work; use the wall clock on a GPU")
        torch.set_num_threads(1)
    shape = Shape(num_layers=4) if quick else Shape()
    counts = blocks or ([64, 256] if quick else [64, 256, 1024])
    work = [(case, count) for count in counts for case in CASES]
    results = []
    for done, (case, count) in enumerate(work, 1):
        results.append(_bench_case(case, shape, count, reps, device, clock))
        if progress is not None:
            progress(f"{case.name} x{count}", done, len(work))
    config = {**asdict(shape), "dtype": str(shape.dtype), "device": device, "clock": clock,
              "impl": "triton" if device == "cuda" else "torch", "threads": torch.get_num_threads(),
              "reps": reps}  # fmt: skip
    return {"config": config, "results": results}


def _table(report: dict[str, object]) -> str:
    lines = [
        f"{'case':32} {'blocks':>6} {'MiB':>7} {'ours':>7} {'memcpy':>7} {'3-pass':>7} "
        f"{'x memcpy':>8} {'x 3-pass':>8}"
    ]
    results = report["results"]
    assert isinstance(results, list)
    for r in results:
        base = "-" if r["baseline_gbps"] is None else f"{r['baseline_gbps']:.2f}"
        vs_base = "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}"
        lines.append(
            f"{r['case']:32} {r['num_blocks']:>6} {r['nbytes'] / 2**20:>7.0f} "
            f"{r['ours_gbps']:>7.2f} {r['memcpy_gbps']:>7.2f} {base:>7} "
            f"{r['vs_memcpy']:>8.2f} {vs_base:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, 64 and 256 blocks")
    parser.add_argument("--blocks", type=int, nargs="+", help="block counts (default by mode)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: CPU time of one thread, robust to other load on the machine",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.quick, args.blocks, args.reps, args.clock)
    print(json.dumps(report, indent=2) if args.json else _table(report))


if __name__ == "__main__":
    main()
