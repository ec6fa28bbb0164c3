"""Command line entry point: ``kvbridge demo | serve | proxy | bench``.

``demo`` is the README's first command. ``bench`` runs the benchmarks that live
in the repository's ``benchmarks/`` folder (found next to the package in a
source checkout; they are not part of an installed wheel).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbridge.serve_cli import add_proxy_parser, add_serve_parser


def _cmd_bench(args: argparse.Namespace) -> int:
    """Hand the words after ``bench`` to ``benchmarks/bench_cli.py`` of the source checkout."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "bench_cli.py").is_file():
        print(f"kvbridge bench: no benchmarks/ next to {root / 'kvbridge'}; run it from a "
              f"kvbridge source checkout", file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # also inherited by spawned benchmark processes
    bench_cli = importlib.import_module("benchmarks.bench_cli")
    code: int = bench_cli.main(args.bench_args)
    return code


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvbridge.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``kvbridge`` command."""
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_proxy_parser(sub)

    demo = sub.add_parser("demo", help="run the P/D demo on loopback and check every byte")
    demo.add_argument("--p-tp", type=int, default=2, help="prefill tensor-parallel size")
    demo.add_argument("--d-tp", type=int, default=1, help="decode tensor-parallel size")
    demo.add_argument("--p-block-size", type=int, default=16)
    demo.add_argument("--d-block-size", type=int, default=16)
    demo.add_argument("--p-layout", default="HND", choices=["NHD", "HND"])
    demo.add_argument("--d-layout", default="HND", choices=["NHD", "HND"])
    demo.add_argument("--quick", action="store_true", help="fewer, shorter prompts")
    demo.add_argument("--model", default="tiny", choices=["tiny", "small"], help="model preset")
    demo.add_argument("--num-prompts", type=int, default=None,
                      help="prompts to send (default 12, --quick 6)")
    demo.add_argument("--max-tokens", type=int, default=None,
                      help="tokens per answer (default 16, --quick 8)")
    demo.set_defaults(func=_cmd_demo)

    # Every word after ``bench`` (options and --help too) goes to benchmarks/bench_cli.py.
    bench = sub.add_parser("bench", add_help=False, prefix_chars="\0",
                           help="transfer | kernels | paged | e2e | vllm | all "
                                "(see docs/benchmarks.md)")
    bench.add_argument("bench_args", nargs="*")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvbridge`` command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
