"""``kvbridge proxy``: the P/D router's flags and process.

``kvbridge/cli/main.py`` registers the subcommand with :func:`add_proxy_parser`.
The process binds its port, serves ``kvbridge.proxy.app``'s app and prints its
ready line (``lifecycle.py``); SIGINT or SIGTERM stops it with exit code 0, bad
flags exit with 2 and a message on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvbridge.cli.lifecycle import (
    StopSignal,
    Subparsers,
    bind,
    serve_app,
    setup_logging,
    shutdown_signals,
)
from kvbridge.errors import ConfigError

__all__ = ["add_proxy_parser", "run_proxy"]

logger = logging.getLogger("kvbridge.serve")


def add_proxy_parser(subparsers: Subparsers[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``proxy`` (sets ``func=run_proxy``); returns its parser."""
    p = subparsers.add_parser("proxy", help="route completions and chat completions: "
                              "prefill on P, decode on D",
                              description="OpenAI-style P/D proxy with round robin over "
                              "each pool: /v1/completions, /v1/chat/completions, /v1/models "
                              "(a D's), /health, /metrics.")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (http://host:port or host:port)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances")
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="limit on a backend call (a stream: until its first byte)")
    p.add_argument("--read-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="longest silence within a streamed answer")
    p.add_argument("--classic", action="store_true",
                   help="D computes the answer's first token again (vLLM's toy-proxy flow); "
                        "default: P's token goes to the client at once and D continues after "
                        "it, for completions that allow it (chat always takes the classic "
                        "flow)")
    p.add_argument("--max-choices", type=int, default=64, metavar="N",
                   help="most choices (n times the prompts) one request may ask for; each is "
                        "prefilled and decoded on its own")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_proxy)
    return p


def run_proxy(args: argparse.Namespace) -> int:
    """Entry of ``kvbridge proxy``: serve until SIGINT/SIGTERM.

    Returns:
        0 after a clean stop, 1 if the server failed, 2 for bad flags.
    """
    from kvbridge.proxy.app import build_proxy_app
    from kvbridge.proxy.config import ProxyConfig, backend_urls

    setup_logging(args.log_level)
    with shutdown_signals():
        try:
            config = ProxyConfig(backend_urls(args.prefill), backend_urls(args.decode),
                                 prefill_timeout_s=args.timeout, decode_timeout_s=args.timeout,
                                 read_timeout_s=args.read_timeout, first_token=not args.classic,
                                 max_choices=args.max_choices)
            sock = bind(args.host, args.port)
        except (ConfigError, OSError) as exc:
            print(f"kvbridge proxy: error: {exc}", file=sys.stderr)
            return 2
        try:
            logger.info("proxy: prefill %s, decode %s", list(config.prefill_urls),
                        list(config.decode_urls))
            app = build_proxy_app(config)
            return 0 if serve_app(app, sock, args.host, "proxy", args.log_level) else 1
        except StopSignal as stop:
            logger.info("stopping on %s", stop)
            return 0
        finally:
            sock.close()
