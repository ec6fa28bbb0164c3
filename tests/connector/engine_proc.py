"""Run ``MiniEngine``s in a child process, each stepped by its own loop thread.

A test starts one :class:`EngineHost` (a ``tests/child_host.py`` child) for the
prefill side and one for the decode side, so P and D talk over real UCX between
processes. Every call has a timeout: a wedged engine fails the test instead of
hanging it.
"""

from __future__ import annotations

import contextlib
from multiprocessing.connection import Connection
from typing import Any

from tests.child_host import ChildHost, serve_commands
from tests.waiting import wait_until

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
                engine.resume(args)
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
        """The request's status once its state is one of ``statuses``."""
        return wait_until(lambda: self.status(request_id), timeout_s, interval_s=0.01,
                          until=lambda status: status["status"] in statuses,
                          message=f"{self.name}: {request_id} to be {'/'.join(sorted(statuses))}",
                          describe=lambda status: f"{status} (errors {self.call('errors')})")

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until nothing runs and every block is back in the free pool."""

        def idle() -> bool:
            if not self.call("idle"):
                return False
            free, usable = self.call("free_blocks")
            return bool(free == usable)

        wait_until(idle, timeout_s, message=f"{self.name} to be idle with every block free",
                   describe=lambda _: f"free blocks {self.call('free_blocks')}, stats "
                                      f"{self.call('stats')}, errors {self.call('errors')}")

    def close(self) -> None:
        with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
            self.call("close")
