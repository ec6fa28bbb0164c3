"""``kvbridge demo``: the README's first command, a whole P/D deployment on loopback.

    run.py     the command: start P, D and the proxy, drive the prompts, compare
    procs.py   child processes: free ports, ready lines, stopping process groups
    report.py  the prompt mix, the per-request verdicts, the table and summary

:func:`add_demo_parser` registers the subcommand; ``run.py`` (httpx, the
engine) is imported only when the demo runs.
"""

from __future__ import annotations

import argparse

from kvbridge.cli.lifecycle import Subparsers

__all__ = ["add_demo_parser"]


def add_demo_parser(subparsers: Subparsers[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``demo`` (sets ``func``); returns its parser."""
    demo = subparsers.add_parser("demo", help="run the P/D demo on loopback and check every byte")
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
    return demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvbridge.cli.demo.run import run_demo

    return run_demo(args)
