"""The life of a ``kvbridge serve`` or ``kvbridge proxy`` process, shared by both.

``serve.py`` and ``proxy.py`` bind their port first (:func:`bind`: fail fast,
before the slow start-up), then run their app with :func:`serve_app`, which
prints the one line scripts wait for once the server listens::

    kvbridge serve ready on http://127.0.0.1:8100
    kvbridge proxy ready on http://127.0.0.1:8000

(``--port 0`` picks a free port; the line names it.) Within
:func:`shutdown_signals`, SIGINT or SIGTERM stops the HTTP server gracefully
(uvicorn handles them while it serves) and then raises :class:`StopSignal`, so
the command can stop what it started and exit with 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = [
    "StopSignal",
    "Subparsers",
    "bind",
    "ignore_signals",
    "serve_app",
    "setup_logging",
    "shutdown_signals",
]

logger = logging.getLogger("kvbridge.serve")

Subparsers = argparse._SubParsersAction  # argparse has no public name for it
#: Seconds uvicorn waits for open connections (streams) on shutdown.
_GRACEFUL_SHUTDOWN_S = 5
_STARTUP_TIMEOUT_S = 60.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignal(BaseException):
    """SIGINT or SIGTERM arrived outside the HTTP server's own handling."""


def _raise_stop_signal(signum: int, _frame: FrameType | None) -> None:
    raise StopSignal(signal.Signals(signum).name)


@contextlib.contextmanager
def shutdown_signals() -> Iterator[None]:
    """Within: SIGINT/SIGTERM raise :class:`StopSignal`; the old handlers come back after.

    uvicorn handles both signals while it serves (graceful stop) and re-raises
    the signal once stopped, which lands here.
    """
    previous = {sig: signal.signal(sig, _raise_stop_signal) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_signals() -> None:
    """Let clean-up finish (it is bounded by time limits) despite repeated Ctrl-C."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (IPv4 or IPv6), before the slow start-up.

    Raises:
        OSError: the address is taken or not local.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def serve_app(app: Any, sock: socket.socket, host: str, what: str, log_level: str) -> bool:
    """Serve ``app`` on ``sock`` until a signal; print the ready line once listening.

    Args:
        app: The ASGI app.
        sock: From :func:`bind`; the caller closes it.
        host: The address shown in the ready line.
        what: ``serve`` or ``proxy``, for the ready line.
        log_level: uvicorn's log level (``debug`` also logs every access).

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


def setup_logging(level: str) -> None:
    """Log to stderr at ``level`` (``debug``, ``info``, ...)."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
