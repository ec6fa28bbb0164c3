"""``kvbridge serve`` and ``kvbridge proxy``: flags, and the processes behind them.

``kvbridge/cli.py`` registers both subcommands with :func:`add_serve_parser` and
:func:`add_proxy_parser`; ``python -m kvbridge.serve_cli serve|proxy ...`` works
too. Each process binds its port first (fail fast), starts its work (``serve``:
the engine and its TP workers), then prints one line that scripts wait for::

    kvbridge serve ready on http://127.0.0.1:8100
    kvbridge proxy ready on http://127.0.0.1:8000

(``--port 0`` picks a free port; the line names it.) SIGINT or SIGTERM stops
the HTTP server gracefully, then the engine and its worker processes; the exit
code is then 0. Bad flags exit with 2 and a message on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvbridge.errors import ConfigError

if TYPE_CHECKING:
    from kvbridge.engine.engine_config import EngineConfig
    from kvbridge.transfer.config import AgentConfig

__all__ = [
    "add_proxy_parser",
    "add_serve_parser",
    "build_engine_config",
    "main",
    "parse_agent_options",
    "parse_nbytes",
    "run_proxy",
    "run_serve",
]

logger = logging.getLogger("kvbridge.serve")

Subparsers = argparse._SubParsersAction  # argparse has no public name for it
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: Seconds uvicorn waits for open connections (streams) on shutdown.
_GRACEFUL_SHUTDOWN_S = 5
_STARTUP_TIMEOUT_S = 60.0


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

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
                   help="address the transfer agents listen on and advertise (default: --host)")
    p.add_argument("--engine-id", default=None, help="unique engine id (default: random)")
    p.add_argument("--secret-file", type=Path, default=None,
                   help="file holding the cluster secret for handshake HMACs")
    p.add_argument("--lease", type=float, default=None, metavar="SECONDS",
                   help="how long P keeps a finished prefill's blocks for D")
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


def add_proxy_parser(subparsers: Subparsers[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``proxy`` (sets ``func=run_proxy``); returns its parser."""
    p = subparsers.add_parser("proxy", help="route completions: prefill on P, decode on D",
                              description="OpenAI-style P/D proxy with round robin over "
                              "each pool.")
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
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_proxy)
    return p


def _read_secret(path: Path) -> bytes:
    secret = path.read_bytes().strip()
    if not secret:
        raise ConfigError(f"secret file {path} is empty")
    if path.stat().st_mode & 0o077:
        logger.warning("secret file %s is readable by other users", path)
    return secret


def parse_agent_options(items: Sequence[str]) -> AgentConfig:
    """``["chunk_timeout_s=2", "chunk_nbytes=65536"]`` -> an ``AgentConfig`` (rest default).

    Raises:
        ConfigError: not ``NAME=VALUE``, an unknown field, or a value the field rejects.
    """
    from kvbridge.transfer.config import AgentConfig

    defaults = {f.name: getattr(AgentConfig(), f.name) for f in dataclasses.fields(AgentConfig)}
    values: dict[str, int | float | bool] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in defaults:
            raise ConfigError(f"--transfer-option {item!r}: expected NAME=VALUE with NAME one "
                              f"of {sorted(defaults)}")
        kind = type(defaults[name])
        if kind is bool:
            word = text.strip().lower()
            if word not in _BOOL_WORDS:
                raise ConfigError(f"--transfer-option {item!r}: {text!r} is not one of "
                                  f"{sorted(_BOOL_WORDS)}")
            values[name] = _BOOL_WORDS[word]
            continue
        try:
            values[name] = kind(text.strip())
        except ValueError:
            raise ConfigError(f"--transfer-option {item!r}: {text!r} is not "
                              f"{'an integer' if kind is int else 'a number'}") from None
    return AgentConfig(**values)  # type: ignore[arg-type]


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` that ``serve``'s flags describe.

    Raises:
        ConfigError: inconsistent flags (e.g. ``--role prefill`` without
            ``--transfer-port``) or values the engine rejects.
        OSError: the secret file cannot be read.
    """
    from kvbridge.engine.engine_config import ConnectorSettings, EngineConfig, EngineRole
    from kvbridge.layout import KVLayout

    connector = None
    if args.transfer_port is not None:
        transfer_host = args.transfer_host or args.host
        if transfer_host in _WILDCARD_HOSTS:
            raise ConfigError(f"--host {args.host!r} is not an address peers can reach: "
                              f"pass --transfer-host")
        settings: dict[str, Any] = {"load_failure_policy": args.load_failure_policy,
                                    "host_buffer": args.host_buffer}
        if args.lease is not None:
            settings["lease_s"] = args.lease
        if args.transfer_option:
            settings["agent"] = parse_agent_options(args.transfer_option)
        connector = ConnectorSettings(
            engine_id=args.engine_id or f"{args.role}-{uuid.uuid4().hex[:8]}",
            transfer_base_port=args.transfer_port, host=transfer_host,
            secret=_read_secret(args.secret_file) if args.secret_file else None, **settings)
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


class _Shutdown(BaseException):
    """SIGINT or SIGTERM arrived outside the HTTP server's own handling."""


def _raise_shutdown(signum: int, _frame: FrameType | None) -> None:
    raise _Shutdown(signal.Signals(signum).name)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _shutdown_signals() -> Iterator[None]:
    """Within: SIGINT/SIGTERM raise :class:`_Shutdown`; the old handlers come back after.

    uvicorn handles both signals while it serves (graceful stop) and re-raises
    the signal once stopped, which lands here.
    """
    previous = {sig: signal.signal(sig, _raise_shutdown) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore_signals() -> None:
    """Let clean-up finish (it is bounded by time limits) despite repeated Ctrl-C."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (IPv4 or IPv6), before the slow start-up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def _serve(app: Any, sock: socket.socket, host: str, what: str, log_level: str) -> bool:
    """Serve ``app`` on ``sock`` until a signal; print the ready line once listening.

    Returns:
        Whether the server started.
    """
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S)
    server = uvicorn.Server(config)
    port = sock.getsockname()[1]

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            async with asyncio.timeout(_STARTUP_TIMEOUT_S):
                while not server.started and not task.done():
                    await asyncio.sleep(0.02)
        except TimeoutError:
            logger.error("HTTP server did not start within %s s", _STARTUP_TIMEOUT_S)
            server.should_exit = True
        if server.started:
            shown = f"[{host}]" if ":" in host else host
            print(f"kvbridge {what} ready on http://{shown}:{port}", flush=True)
        await task

    asyncio.run(run())
    return bool(server.started)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_serve(args: argparse.Namespace) -> int:
    """Entry of ``kvbridge serve``: engine + HTTP server until SIGINT/SIGTERM.

    Returns:
        0 after a clean stop, 1 if the server failed, 2 for bad flags.
    """
    _setup_logging(args.log_level)
    engine = None
    with _shutdown_signals():
        try:
            config = build_engine_config(args)
            sock = _bind(args.host, args.port)
        except (ConfigError, OSError) as exc:
            print(f"kvbridge serve: error: {exc}", file=sys.stderr)
            return 2
        try:
            from kvbridge.engine.async_engine import AsyncEngine
            from kvbridge.engine.server import build_app

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
            return 0 if _serve(app, sock, args.host, "serve", args.log_level) else 1
        except _Shutdown as stop:
            logger.info("stopping on %s", stop)
            return 0
        finally:
            _ignore_signals()
            sock.close()
            if engine is not None:
                engine.shutdown()
            logger.info("kvbridge serve stopped (pid %d)", os.getpid())


def run_proxy(args: argparse.Namespace) -> int:
    """Entry of ``kvbridge proxy``: serve until SIGINT/SIGTERM.

    Returns:
        0 after a clean stop, 1 if the server failed, 2 for bad flags.
    """
    from kvbridge.proxy import ProxyConfig, backend_urls, build_proxy_app

    _setup_logging(args.log_level)
    with _shutdown_signals():
        try:
            config = ProxyConfig(backend_urls(args.prefill), backend_urls(args.decode),
                                 prefill_timeout_s=args.timeout, decode_timeout_s=args.timeout,
                                 read_timeout_s=args.read_timeout)
            sock = _bind(args.host, args.port)
        except (ConfigError, OSError) as exc:
            print(f"kvbridge proxy: error: {exc}", file=sys.stderr)
            return 2
        try:
            logger.info("proxy: prefill %s, decode %s", list(config.prefill_urls),
                        list(config.decode_urls))
            app = build_proxy_app(config)
            return 0 if _serve(app, sock, args.host, "proxy", args.log_level) else 1
        except _Shutdown as stop:
            logger.info("stopping on %s", stop)
            return 0
        finally:
            sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbridge.serve_cli serve|proxy ...`` (same flags as ``kvbridge``)."""
    parser = argparse.ArgumentParser(prog="kvbridge")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_proxy_parser(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
