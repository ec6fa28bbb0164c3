"""``kvbridge bench``: hand the words after ``bench`` to :mod:`kvbridge.bench.cli`.

The benchmarks are part of the package (``kvbridge/bench/``), so an installed
kvbridge runs them as a source checkout does. Their modules are imported when
the command runs, not when the ``kvbridge`` parser is built.
"""

from __future__ import annotations

import argparse

from kvbridge.cli.lifecycle import Subparsers

__all__ = ["add_bench_parser", "run_bench"]


def add_bench_parser(subparsers: Subparsers[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``bench`` (sets ``func``); every word after it, options and ``--help``
    too, goes to ``kvbridge/bench/cli.py``."""
    bench = subparsers.add_parser("bench", add_help=False, prefix_chars="\0",
                                  help="transfer | kernels | paged | e2e | vllm | serve | all "
                                  "(see docs/benchmarks.md)")
    bench.add_argument("bench_args", nargs="*")
    bench.set_defaults(func=_cmd_bench)
    return bench


def _cmd_bench(args: argparse.Namespace) -> int:
    return run_bench(args.bench_args)


def run_bench(bench_args: list[str]) -> int:
    """Run ``kvbridge bench`` with ``bench_args`` (the words after ``bench``); the exit code."""
    from kvbridge.bench.cli import main

    return main(bench_args)
