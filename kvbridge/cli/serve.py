"""``kvbridge serve``: flags, the ``EngineConfig`` they describe, and the serving process.

``kvbridge/cli/main.py`` registers the subcommand with :func:`add_serve_parser`.
The process binds its port first (fail fast), starts the engine and its TP
workers, then serves ``kvbridge/reference/server.py``'s app and prints its ready
line (``lifecycle.py``). SIGINT or SIGTERM stops the HTTP server gracefully,
then the engine and its worker processes; the exit code is then 0. Bad flags
exit with 2 and a message on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.cli.lifecycle import (
    StopSignal,
    Subparsers,
    bind,
    ignore_signals,
    serve_app,
    setup_logging,
    shutdown_signals,
)
from kvbridge.errors import ConfigError

if TYPE_CHECKING:
    from kvbridge.reference.engine.engine_config import EngineConfig
    from kvbridge.transfer.agent_config import AgentConfig

__all__ = [
    "add_serve_parser",
    "build_engine_config",
    "parse_agent_options",
    "parse_nbytes",
    "run_serve",
]

logger = logging.getLogger("kvbridge.serve")

_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_SECRET_FIX = "pass --secret-file (or set $KVBRIDGE_SECRET), or --insecure"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: Words ``--transfer-option`` takes for a bool besides msgspec's true/false/1/0.
_YES_NO = {"yes": "true", "no": "false"}


def parse_nbytes(text: str) -> int:
    """``"268435456"``, ``"256M"``, ``"256MiB"`` or ``"1g"`` -> bytes (binary units).

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1:] if value[-1:] in _UNITS else ""
    try:
        nbytes = int(float(value.removesuffix(unit)) * _UNITS[unit]) if value else 0
    except ValueError:
        nbytes = 0
    if nbytes < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or 512M, 2G, ...")
    return nbytes


def add_serve_parser(subparsers: Subparsers[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``serve`` (sets ``func=run_serve``); returns its parser."""
    p = subparsers.add_parser("serve", help="run the reference engine behind an HTTP server",
                              description="Run one kvbridge engine instance with an "
                              "OpenAI-style /v1/completions server.")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                   help="deployment role (prefill/decode need --transfer-port)")
    p.add_argument("--model", choices=["tiny", "small"], default="tiny", help="model preset")
    p.add_argument("--weights-dir", default=None, help="Llama safetensors directory "
                   "(default: seeded random weights)")
    p.add_argument("--served-model-name", default=None, help="name clients send as 'model'")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel worker processes")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-layout", choices=["NHD", "HND"], default=None,
                   help="KV cache layout (default: HND with a connector, else NHD)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--kv-memory", type=parse_nbytes, default=None, metavar="BYTES",
                      help="KV cache bytes per TP rank (e.g. 256M)")
    size.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks per rank")
    p.add_argument("--max-model-len", type=int, default=None, help="longest request in tokens")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8100, help="HTTP port (0: any free port)")
    p.add_argument("--transfer-port", type=int, default=None, metavar="T",
                   help="base port of the transfer agents (rank r listens on T + r); "
                   "enables the connector")
    p.add_argument("--transfer-host", default=None,
                   help="address the transfer agents advertise and listen on (default: --host)")
    p.add_argument("--transfer-listen-host", default=None, metavar="ADDR",
                   help="address the transfer agents listen on instead of --transfer-host "
                   "(0.0.0.0: every interface, for an address translated by NAT)")
    p.add_argument("--engine-id", default=None, help="unique engine id (default: random)")
    p.add_argument("--secret-file", type=Path, default=None,
                   help="file holding the cluster secret for handshake HMACs (default: "
                   "$KVBRIDGE_SECRET, else on a loopback --transfer-host the secret this "
                   "user's instances on this host share, made on first use)")
    p.add_argument("--insecure", action="store_true",
                   help="with no secret configured, run without authentication (needed "
                   "for a non-loopback --transfer-host without a secret; logged)")
    p.add_argument("--lease", type=float, default=None, metavar="SECONDS",
                   help="how long P keeps a finished prefill's blocks for D")
    p.add_argument("--max-held-share", type=float, default=None, metavar="SHARE",
                   help="share of P's KV cache that prefills held for D may take (default "
                        "0.5; the oldest holds are revoked beyond it)")
    p.add_argument("--load-failure-policy", choices=["recompute", "fail"], default="recompute")
    p.add_argument("--transfer-option", action="append", default=[], metavar="NAME=VALUE",
                   help="transfer agent timeout or size (an AgentConfig field, e.g. "
                   "chunk_timeout_s=2); repeatable")
    p.add_argument("--host-buffer", action="store_true", help="stage transfers in host memory")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--in-process", action="store_true",
                   help="run the TP-1 worker inside the server process")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_serve)
    return p


def parse_agent_options(items: Sequence[str]) -> AgentConfig:
    """``["chunk_timeout_s=2", "chunk_nbytes=65536"]`` -> an ``AgentConfig`` (rest default).

    Values are converted from text by msgspec (``AgentConfig.from_options``,
    lax mode: ``"2"`` is a number, ``true``/``false``/``1``/``0``, also
    ``yes``/``no``, a bool).

    Raises:
        ConfigError: not ``NAME=VALUE``, an unknown field, or a value the field
            rejects (the message names the option, the field and the value).
    """
    from kvbridge.transfer.agent_config import AgentConfig

    names = AgentConfig.__struct_fields__
    values: dict[str, str] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise ConfigError(f"--transfer-option {item!r}: expected NAME=VALUE with NAME one "
                              f"of {sorted(names)}")
        text = text.strip()
        values[name] = _YES_NO.get(text.lower(), text)
        try:  # each option alone first, so that an error names the option as given
            AgentConfig.from_options({name: values[name]}, strict=False)
        except ConfigError as exc:
            raise ConfigError(f"--transfer-option {item!r}: {exc}") from None
    return AgentConfig.from_options(values, strict=False)


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` that ``serve``'s flags describe.

    Raises:
        ConfigError: inconsistent flags (e.g. ``--role prefill`` without
            ``--transfer-port``) or values the engine rejects.
        ConfigError: also the secret file cannot be read, or a non-loopback
            transfer host has no secret and no ``--insecure``.
    """
    from kvbridge.reference.engine.engine_config import ConnectorSettings, EngineConfig, EngineRole
    from kvbridge.topology import KVLayout
    from kvbridge.transfer.protocol.cluster_secret import cluster_secret, is_loopback
    from kvbridge.transfer.protocol.security import load_cluster_secret

    connector = None
    if args.transfer_port is not None:
        transfer_host = args.transfer_host or args.host
        if transfer_host in _WILDCARD_HOSTS:
            raise ConfigError(f"--host {args.host!r} is not an address peers can reach: "
                              f"pass --transfer-host")
        # A configured secret now; else the engine takes the host secret (one host) or
        # runs insecure, and a non-loopback address without either fails here.
        secret = load_cluster_secret(secret_file=args.secret_file)
        if secret is None and not args.insecure and not is_loopback(transfer_host):
            cluster_secret(transfer_host, fix=_SECRET_FIX)  # raises, naming the flags
        settings: dict[str, Any] = {"load_failure_policy": args.load_failure_policy,
                                    "host_buffer": args.host_buffer}
        if args.lease is not None:
            settings["lease_s"] = args.lease
        if args.max_held_share is not None:
            settings["max_held_share"] = args.max_held_share
        if args.transfer_option:
            settings["agent"] = parse_agent_options(args.transfer_option)
        connector = ConnectorSettings(
            engine_id=args.engine_id or f"{args.role}-{uuid.uuid4().hex[:8]}",
            transfer_base_port=args.transfer_port, host=transfer_host,
            secret=secret, insecure=args.insecure, listen_host=args.transfer_listen_host,
            **settings)
    elif args.role != "both":
        raise ConfigError(f"--role {args.role} needs --transfer-port (the connector)")
    elif args.transfer_option:
        raise ConfigError("--transfer-option needs --transfer-port (the connector)")
    optional = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "num_blocks": args.num_blocks, "kv_memory_nbytes": args.kv_memory}
    return EngineConfig(
        model=args.model, tp_size=args.tp, block_size=args.block_size,
        kv_layout=KVLayout.parse(args.kv_layout) if args.kv_layout else None,
        role=EngineRole(args.role), connector=connector, weights_dir=args.weights_dir,
        device=args.device, in_process=args.in_process,
        **{k: v for k, v in optional.items() if v is not None},
    )


def run_serve(args: argparse.Namespace) -> int:
    """Entry of ``kvbridge serve``: engine + HTTP server until SIGINT/SIGTERM.

    Returns:
        0 after a clean stop, 1 if the server failed, 2 for bad flags.
    """
    setup_logging(args.log_level)
    engine = None
    with shutdown_signals():
        try:
            config = build_engine_config(args)
            sock = bind(args.host, args.port)
        except (ConfigError, OSError) as exc:
            print(f"kvbridge serve: error: {exc}", file=sys.stderr)
            return 2
        try:
            from kvbridge.reference.engine.async_engine import AsyncEngine
            from kvbridge.reference.server import build_app

            try:
                engine = AsyncEngine(config)
            except ConfigError as exc:
                print(f"kvbridge serve: error: {exc}", file=sys.stderr)
                return 2
            connector = config.connector
            logger.info("engine up: model %s, role %s, TP %d, block size %d, layout %s, "
                        "%d blocks, connector %s", config.model_config().name, config.role,
                        config.tp_size, config.block_size, config.layout,
                        engine.engine.num_blocks,
                        f"{connector.engine_id} on {connector.host}:"
                        f"{connector.transfer_base_port}" if connector else "off")
            app = build_app(engine, args.served_model_name)
            return 0 if serve_app(app, sock, args.host, "serve", args.log_level) else 1
        except StopSignal as stop:
            logger.info("stopping on %s", stop)
            return 0
        finally:
            ignore_signals()
            sock.close()
            if engine is not None:
                engine.shutdown()
            logger.info("kvbridge serve stopped (pid %d)", os.getpid())
