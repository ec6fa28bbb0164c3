"""``kvbridge bench``: hand the words after ``bench`` to the checkout's ``benchmarks/``.

The benchmarks are not part of the package (an installed wheel has none): they
live in ``benchmarks/`` next to the ``kvbridge/`` folder of a source checkout,
where :func:`run_bench` finds them. Elsewhere the command explains that and
exits with 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import kvbridge
from kvbridge.cli.lifecycle import Subparsers

__all__ = ["add_bench_parser", "run_bench", "source_root"]


def source_root() -> Path:
    """The folder holding the ``kvbridge`` package (a checkout's root, or site-packages)."""
    return Path(kvbridge.__file__).resolve().parents[1]


def add_bench_parser(subparsers: Subparsers[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``bench`` (sets ``func``); every word after it, options and ``--help``
    too, goes to ``benchmarks/bench_cli.py``."""
    bench = subparsers.add_parser("bench", add_help=False, prefix_chars="\0",
                                  help="transfer | kernels | paged | e2e | vllm | serve | all "
                                  "(see docs/benchmarks.md)")
    bench.add_argument("bench_args", nargs="*")
    bench.set_defaults(func=_cmd_bench)
    return bench


def _cmd_bench(args: argparse.Namespace) -> int:
    return run_bench(args.bench_args)


def run_bench(bench_args: list[str], root: Path | None = None) -> int:
    """Run ``benchmarks/bench_cli.py``'s ``main(bench_args)`` from the checkout at ``root``.

    Args:
        bench_args: The words after ``bench``.
        root: The checkout (default: :func:`source_root`).

    Returns:
        The benchmark's exit code; 2 (with a message on stderr) when ``root``
        has no ``benchmarks/bench_cli.py``.

    Side effect: puts ``root`` first on ``sys.path`` (spawned benchmark
    processes inherit it) so that ``benchmarks`` imports as a package.
    """
    root = source_root() if root is None else root
    if not (root / "benchmarks" / "bench_cli.py").is_file():
        print(f"kvbridge bench: no benchmarks/ next to {root / 'kvbridge'}; run it from a "
              f"kvbridge source checkout", file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # also inherited by spawned benchmark processes
    bench_cli = importlib.import_module("benchmarks.bench_cli")
    code: int = bench_cli.main(bench_args)
    return code
