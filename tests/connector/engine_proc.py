"""Run ``MiniEngine``s in a child process, each stepped by its own loop thread.

A test starts one :class:`EngineHost` (a ``tests/child_host.py`` child) for the
prefill side and one for the decode side, so P and D talk over real UCX between
processes. Every call has a timeout: a wedged engine fails the test instead of
hanging it.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing.connection import Connection
from typing import Any

from tests.child_host import ChildHost, serve_commands

CALL_TIMEOUT_S = 60.0


def _child(conn: Connection) -> None:
    import logging

    from tests.connector.harness import EngineLoop, MiniEngine

    logging.basicConfig(level=logging.WARNING)
    loops: dict[str, EngineLoop] = {}

    def handle(cmd: str, name: str, args: Any) -> Any:
        if cmd == "create":
            loops[name] = EngineLoop(MiniEngine(args))
            return None
        loop = loops[name]
        engine = loop.engine
        with engine.lock:
            if cmd == "close":
                loop.frozen = True
            result: Any = None
            if cmd == "add":
                engine.add(**args)
            elif cmd == "abort":
                engine.abort(args)
            elif cmd == "resume":
                engine.requests[args].paused = False
            elif cmd == "freeze":
                loop.frozen = bool(args)
            elif cmd == "freeze_on_handout":
                engine.freeze_on_handout = bool(args)
            elif cmd == "status":
                result = engine.status(args)
            elif cmd == "idle":
                result = not engine.busy()
            elif cmd == "free_blocks":
                result = engine.free_blocks()
            elif cmd == "stats":
                result = engine.connector.get_stats()
            elif cmd == "errors":
                result = list(engine.errors)
            elif cmd != "close":
                raise ValueError(cmd)
        if cmd == "close":
            loop.stop()
            engine.close()
            del loops[name]
        return result

    def close_all() -> None:
        for loop in loops.values():
            loop.stop()
            loop.engine.close()

    serve_commands(conn, handle, close_all)


class EngineHost(ChildHost):
    """A child process hosting any number of engines."""

    what = "engine host"
    call_timeout_s = CALL_TIMEOUT_S

    def __init__(self) -> None:
        super().__init__(_child)


class EngineRef:
    """One engine inside an :class:`EngineHost`."""

    def __init__(self, host: EngineHost, spec: Any) -> None:
        self.host, self.spec, self.name = host, spec, spec.engine_id
        host.call("create", self.name, spec)

    def call(self, cmd: str, args: Any = None) -> Any:
        return self.host.call(cmd, self.name, args)

    def add(self, request_id: str, prompt: list[int], params: object = None,
            max_tokens: int = 1, paused: bool = False) -> None:
        self.call("add", {"request_id": request_id, "prompt": prompt, "params": params,
                          "max_tokens": max_tokens, "paused": paused})

    def status(self, request_id: str) -> dict[str, Any]:
        return dict(self.call("status", request_id))

    def wait_status(self, request_id: str, statuses: set[str],
                    timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status(request_id)
            if status["status"] in statuses:
                return status
            time.sleep(0.01)
        raise AssertionError(f"{self.name}: {request_id} still {status} after {timeout_s}s "
                             f"(errors {self.call('errors')})")

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until nothing runs and every block is back in the free pool."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.call("idle"):
                free, usable = self.call("free_blocks")
                if free == usable:
                    return
            time.sleep(0.02)
        raise AssertionError(f"{self.name} not idle after {timeout_s}s: free blocks "
                             f"{self.call('free_blocks')}, stats {self.call('stats')}, "
                             f"errors {self.call('errors')}")

    def close(self) -> None:
        with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
            self.call("close")
