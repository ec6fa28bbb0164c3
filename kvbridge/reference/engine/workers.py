"""TP worker processes: the ``WorkerGroup`` that drives one :class:`ModelRunner` per rank.

The engine (its scheduler) owns one :class:`WorkerGroup`. It spawns ``tp_size``
processes (``multiprocessing`` spawn) that join one ``torch.distributed`` group
(gloo on CPU, NCCL on GPU; TCP rendezvous on a free loopback port). Each step
the group sends the same :class:`StepBatch` to every rank over its pipe and
returns rank 0's sampled tokens. With ``tp_size == 1`` and ``in_process=True``
the single rank runs in the caller's process instead (no spawn, no group).

This module is the parent side. What runs in each worker (building the rank,
its *worker extension*, answering requests) is ``rank_worker.py``; the config,
the pipe messages and the errors both sides share are ``worker_ipc.py``.
:meth:`WorkerGroup.call` invokes a public method of every rank's extension, by
name; a name the extension does not have is an ``UnknownMethodError``.

Nothing is left behind: ``shutdown()`` (idempotent, also run on errors, on
garbage collection and at interpreter exit) stops every process, escalating to
SIGTERM then SIGKILL; a worker whose parent dies exits by itself. Every wait
has a timeout. Replies are checked on arrival.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from kvbridge.reference.engine.parallel import TensorParallel, rendezvous_store
from kvbridge.reference.engine.rank_worker import RankWorker, no_wakeup, worker_main
from kvbridge.reference.engine.runner import ModelRunner, StepBatch
from kvbridge.reference.engine.worker_ipc import (
    CallExtension,
    Describe,
    Done,
    Execute,
    Exit,
    Failed,
    RankInfo,
    UnknownMethodError,
    WorkerError,
    WorkerGroupConfig,
    WorkerProtocolError,
    WorkerReply,
    WorkerRequest,
    WorkerTimeoutError,
)

__all__ = ["WorkerGroup"]

_HOST = "127.0.0.1"
_SHUTDOWN_GRACE_S = 10.0


class _LocalRank:
    """The only rank, run in the caller's process; replies are computed on send."""

    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker
        self._reply: WorkerReply | None = None

    def send(self, request: WorkerRequest) -> None:
        self._reply = self.worker.reply(request)

    def recv(self, timeout_s: float) -> WorkerReply:
        reply, self._reply = self._reply, None
        assert reply is not None, "recv without send"
        return reply


class _ProcessRank:
    """A spawned worker and the parent's end of its pipe."""

    def __init__(self, process: BaseProcess, conn: Connection, tp_rank: int) -> None:
        self.process = process
        self.conn = conn
        self.tp_rank = tp_rank

    def send(self, request: WorkerRequest) -> None:
        try:
            self.conn.send(request)
        except OSError as exc:
            raise WorkerError(f"worker rank {self.tp_rank} is gone: {exc}") from exc

    def recv(self, timeout_s: float) -> WorkerReply:
        """The rank's next reply.

        Raises:
            WorkerTimeoutError: nothing within ``timeout_s``.
            WorkerError: the rank died.
            WorkerProtocolError: the rank sent something that is not a reply.
        """
        try:
            if not self.conn.poll(max(0.0, timeout_s)):
                raise WorkerTimeoutError(
                    f"worker rank {self.tp_rank} (pid {self.process.pid}) sent nothing "
                    f"within {timeout_s:.1f} s"
                )
            reply = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.process.join(1.0)  # so the exit code is known
            raise WorkerError(
                f"worker rank {self.tp_rank} (pid {self.process.pid}) died, "
                f"exit code {self.process.exitcode}"
            ) from exc
        except WorkerError:
            raise
        except Exception as exc:  # did not unpickle (a class the parent cannot import...)
            raise WorkerProtocolError(
                f"worker rank {self.tp_rank}: undecodable reply: {exc!r}"
            ) from exc
        match reply:
            case Done() | Failed(traceback=str()):
                return reply
        raise WorkerProtocolError(
            f"worker rank {self.tp_rank} sent {type(reply).__name__}, not Done or Failed"
        )


def _reap(ranks: Sequence[_ProcessRank]) -> None:
    """Stop every worker process: ask, then SIGTERM, then SIGKILL; close the pipes."""
    for rank in ranks:
        with contextlib.suppress(OSError):
            rank.conn.send(Exit())
    deadline = time.monotonic() + _SHUTDOWN_GRACE_S
    for rank in ranks:
        rank.process.join(max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        alive = [r for r in ranks if r.process.is_alive()]
        for rank in alive:
            getattr(rank.process, stop)()
        for rank in alive:
            rank.process.join(2.0)
    for rank in ranks:
        rank.conn.close()


def _unwrap(replies: Sequence[WorkerReply], what: str) -> list[Any]:
    """The values of ``replies``, or a ``WorkerError`` quoting every failed rank."""
    errors = [
        f"rank {i}:\n{reply.traceback}" for i, reply in enumerate(replies)
        if isinstance(reply, Failed)
    ]
    if errors:
        raise WorkerError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
    return [reply.value for reply in replies if isinstance(reply, Done)]


class WorkerGroup:
    """All TP ranks of one engine, driven in lock step.

    Starts every rank on construction and waits until each has built its runner
    (and extension). Use as a context manager or call :meth:`shutdown`.

    Args:
        config: What to run and how.
        notify: Handed to every rank's extension as ``WorkerContext.notify``
            (picklable: it goes to the worker processes), e.g. a
            ``Wakeup.sender()`` of the engine thread.

    Raises:
        WorkerError: a rank failed to start (its traceback is in the message);
            every process already started has been stopped.
        WorkerTimeoutError: startup exceeded ``config.startup_timeout_s``.
    """

    def __init__(
        self, config: WorkerGroupConfig, notify: Callable[[], None] = no_wakeup,
    ) -> None:
        self.config = config
        self._notify = notify
        self._limits = config.limits()
        self._closed = False
        self._local: _LocalRank | None = None
        self._procs: list[_ProcessRank] = []
        self._ranks: list[_LocalRank | _ProcessRank] = []
        self._store: Any = None  # the ranks' rendezvous (``rendezvous_store``), while they run
        if config.in_process:
            self._local = _LocalRank(RankWorker(config, TensorParallel(), notify))
            self._ranks = [self._local]
            self._extension_methods = frozenset(self._local.worker.extension_methods)
            return
        # The finalizer holds the list, not self, so collection and exit reap too.
        self._finalizer = weakref.finalize(self, _reap, self._procs)
        try:
            self._spawn()
            infos = _unwrap(self._gather(config.startup_timeout_s), "startup")
            if not all(isinstance(info, RankInfo) for info in infos):
                raise WorkerProtocolError(
                    f"startup: a rank reported {[type(i).__name__ for i in infos]}, not RankInfo"
                )
        except BaseException:
            self.shutdown()
            raise
        # Every rank runs the same factory; a method some rank lacks is unknown.
        self._extension_methods = frozenset.intersection(
            *(frozenset(info.extension_methods) for info in infos)
        )

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = rendezvous_store(_HOST, self.config.tp_size, self.config.step_timeout_s)
        port = self._store.port
        for rank in range(self.config.tp_size):
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(
                target=worker_main,
                args=(self.config, rank, _HOST, port, child_conn, self._notify),
                name=f"kvbridge-tp{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()  # so the parent sees EOF if the worker dies
            self._procs.append(_ProcessRank(process, parent_conn, rank))
        self._ranks = list(self._procs)

    @property
    def tp_size(self) -> int:
        """Number of ranks."""
        return self.config.tp_size

    @property
    def local_runner(self) -> ModelRunner | None:
        """The runner of the in-process rank, or ``None`` when ranks are processes."""
        return self._local.worker.runner if self._local is not None else None

    @property
    def local_extension(self) -> object | None:
        """The extension of the in-process rank, or ``None``."""
        return self._local.worker.extension if self._local is not None else None

    def execute(self, batch: StepBatch) -> list[int]:
        """Run one step on every rank.

        Returns:
            Rank 0's sampled tokens: one per request with ``sample=True``, in order.

        Raises:
            InvalidStepError: ``batch`` breaks the limits; nothing was sent.
            WorkerError: a rank failed or died; the group has been shut down.
            WorkerTimeoutError: a rank did not answer in time; shut down too.
        """
        self._limits.check(batch)
        try:
            results = self._broadcast(Execute(batch), "execute")
        except WorkerError:
            # Ranks may be stuck in a collective: the group cannot continue.
            self.shutdown()
            raise
        tokens: list[int] = results[0]
        return tokens

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every rank's extension.

        Returns:
            Each rank's return value, by rank.

        Raises:
            UnknownMethodError: ``method`` is not a public method of the
                extension (nothing was sent; the group stays usable).
            WorkerError: no extension, or the method raised on some rank (the
                group stays usable); a rank died (the group is shut down).
            WorkerTimeoutError: a rank did not answer in time (shut down).
        """
        if self.config.worker_extension is None:
            raise WorkerError(f"call({method!r}): no worker extension configured")
        if method not in self._extension_methods:
            raise UnknownMethodError(
                f"call({method!r}): the worker extension {self.config.worker_extension!r} has "
                f"no public method {method!r} (it has {', '.join(sorted(self._extension_methods))})"
            )
        return self._broadcast(CallExtension(method, args, kwargs), f"call({method!r})")

    def info(self) -> list[RankInfo]:
        """Per-rank facts (pid, KV heads, cache shape, device, extension methods)."""
        infos: list[RankInfo] = self._broadcast(Describe(), "info")
        return infos

    def _broadcast(self, request: WorkerRequest, what: str) -> list[Any]:
        if self._closed:
            raise WorkerError(f"{what}: worker group is shut down")
        try:
            for rank in self._ranks:
                rank.send(request)
            replies = self._gather(self.config.step_timeout_s)
        except WorkerError:
            # A rank died or hung; the others may wait in a collective forever.
            self.shutdown()
            raise
        return _unwrap(replies, what)

    def _gather(self, timeout_s: float) -> list[WorkerReply]:
        """One reply from every rank (all are read, so the pipes stay in step).

        Raises:
            WorkerError: a rank died. WorkerTimeoutError: the deadline passed.
            WorkerProtocolError: a rank sent something that is not a reply.
        """
        deadline = time.monotonic() + timeout_s
        return [rank.recv(deadline - time.monotonic()) for rank in self._ranks]

    def shutdown(self) -> None:
        """Stop every rank and release its resources. Idempotent; never raises for dead ranks."""
        if self._closed:
            return
        self._closed = True
        if self._local is not None:
            self._local.worker.close()
        if self._procs:
            self._finalizer()  # runs _reap once
        self._store = None  # its port closes with it

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`shutdown` has run."""
        return self._closed

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
