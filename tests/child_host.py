"""A "spawn" child process driven over a pipe, with a timeout on every call (test helper).

``tests/transfer/agent_proc.py`` hosts transfer agents this way and
``tests/connector/engine_proc.py`` hosts mini engines. One protocol::

    parent --(cmd, name, args)--> child      handle(cmd, name, args)
    parent <--("ok", result)----- child      or ("error", repr(exc))
    parent --("exit", "", None)-> child      close_all(), ("ok", None), child ends

A wedged child fails the test with ``TimeoutError`` instead of hanging it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, ClassVar

Handler = Callable[[str, str, Any], Any]
"""``handle(cmd, name, args)`` in the child: the result to send back."""


def serve_commands(conn: Connection, handle: Handler, close_all: Callable[[], None]) -> None:
    """Child side: answer commands until ``exit`` (first says it is ready).

    Args:
        conn: The child's end of the pipe.
        handle: Runs one command; an exception goes back as ``("error", repr)``.
        close_all: Releases everything the child holds, on ``exit``.
    """
    conn.send(("ok", None))
    while True:
        cmd, name, args = conn.recv()
        try:
            if cmd == "exit":
                close_all()
                conn.send(("ok", None))
                return
            conn.send(("ok", handle(cmd, name, args)))
        except Exception as exc:
            conn.send(("error", repr(exc)))


class ChildHost:
    """Parent side: a "spawn" child running ``target(conn)``.

    Args:
        target: Picklable (module-level) function the child runs; it calls
            :func:`serve_commands`.
        start_timeout_s: Limit on the child's start-up (imports included).

    Raises:
        TimeoutError: the child was not ready in time.
    """

    #: How the child is named in error messages.
    what: ClassVar[str] = "child"
    #: Limit on one call.
    call_timeout_s: ClassVar[float] = 30.0

    def __init__(self, target: Callable[[Connection], None],
                 start_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child_conn,), daemon=True)
        self.process.start()
        self._wait("start", start_timeout_s)

    def _wait(self, what: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.what} did not answer {what} within {timeout_s}s")
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.what} {what} failed: {result}")
        return result

    def call(self, cmd: str, name: str = "", args: Any = None) -> Any:
        """Run ``cmd`` on object ``name`` in the child; its result.

        Raises:
            TimeoutError: no answer within :attr:`call_timeout_s`.
            RuntimeError: the command raised in the child (its repr is the message).
        """
        self._conn.send((cmd, name, args))
        return self._wait(cmd, self.call_timeout_s)

    def close(self) -> None:
        """Ask the child to close everything and exit; kill it if it does not."""
        if self.process.is_alive():
            with contextlib.suppress(TimeoutError, OSError, EOFError, RuntimeError):
                self.call("exit")
            self.process.join(10)
        self.kill()

    def kill(self) -> None:
        """End the child at once (no clean-up in it)."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
