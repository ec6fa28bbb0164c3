"""Command line entry point: ``kvbridge demo | serve | proxy | bench``.

``demo`` is the README's first command. ``bench`` runs the benchmarks of
``kvbridge/bench/`` (transfer, kernels, paged manager, end to end, vLLM P/D,
serving under load), from a source checkout or an installed kvbridge.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvbridge.cli.bench import add_bench_parser
from kvbridge.cli.demo import add_demo_parser
from kvbridge.cli.proxy import add_proxy_parser
from kvbridge.cli.serve import add_serve_parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``kvbridge`` command."""
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_proxy_parser(sub)
    add_demo_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvbridge`` command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
