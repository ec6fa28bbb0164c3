"""TP worker processes: one :class:`ModelRunner` per rank, driven by a ``WorkerGroup``.

The engine (its scheduler) owns one :class:`WorkerGroup`. It spawns ``tp_size``
processes (``multiprocessing`` spawn) that join one ``torch.distributed`` group
(gloo on CPU, NCCL on GPU; TCP rendezvous on a free loopback port). Each step
the group sends the same :class:`StepBatch` to every rank over its pipe and
returns rank 0's sampled tokens. With ``tp_size == 1`` and ``in_process=True``
the single rank runs in the caller's process instead (no spawn, no group).

Per-worker objects (the connector worker and its transfer agent) are built in
each worker by the *worker extension*: ``"package.module:factory"``, called with
a :class:`WorkerContext` (rank, runner, KV caches) once the runner exists.
:meth:`WorkerGroup.call` then invokes a method of every rank's extension.

Nothing is left behind: ``shutdown()`` (idempotent, also run on errors, on
garbage collection and at interpreter exit) stops every process, escalating to
SIGTERM then SIGKILL; a worker whose parent dies exits by itself. Every wait
has a timeout. Pipe messages are pickled: both ends are this package.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from kvbridge.engine.config import ModelConfig
from kvbridge.engine.parallel import (
    TensorParallel,
    default_backend,
    destroy_tp_group,
    find_free_port,
    init_tp_group,
)
from kvbridge.engine.runner import ModelRunner, StepBatch, StepLimits
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.layout import KVLayout

_HOST = "127.0.0.1"
_SHUTDOWN_GRACE_S = 10.0


class WorkerError(KVBridgeError):
    """A worker failed to start, raised while handling a request, or died."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A worker did not answer within the configured timeout."""


@dataclass(frozen=True, slots=True)
class WorkerGroupConfig:
    """Everything each worker needs to build its rank (picklable, sent to spawn).

    Attributes:
        model: Model to run.
        tp_size: Number of TP ranks.
        num_blocks: KV cache blocks per layer on each rank.
        block_size: Tokens per block.
        layout: KV cache layout.
        device: ``cpu`` or ``cuda`` (rank ``r`` then uses ``cuda:r``).
        weights_dir: Directory of Llama safetensors, or ``None`` for seeded weights.
        max_num_reqs: Most requests in one step.
        max_num_batched_tokens: Most tokens in one step (default ``max_model_len``).
        worker_extension: ``"module:factory"`` building a per-worker object from
            a :class:`WorkerContext`, or ``None``.
        extension_config: Picklable value handed to the factory as ``ctx.extension_config``.
        in_process: Run the only rank in the caller's process (``tp_size == 1`` only).
        num_threads: Torch CPU threads per worker (default: cores / tp_size).
        startup_timeout_s: Limit on spawning and initialising all ranks.
        step_timeout_s: Limit on one ``execute`` or ``call`` (and on collectives).

    Raises:
        ConfigError: bad sizes, ``in_process`` with ``tp_size > 1``, or a model
            that does not split over ``tp_size``.
    """

    model: ModelConfig
    tp_size: int
    num_blocks: int
    block_size: int
    layout: KVLayout = KVLayout.NHD
    device: str = "cpu"
    weights_dir: str | None = None
    max_num_reqs: int = 256
    max_num_batched_tokens: int | None = None
    worker_extension: str | None = None
    extension_config: Any = None
    in_process: bool = False
    num_threads: int | None = None
    startup_timeout_s: float = 120.0
    step_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", KVLayout.parse(self.layout))
        self.model.check_tp_size(self.tp_size)
        if self.num_blocks < 1 or self.block_size < 1:
            raise ConfigError(
                f"num_blocks {self.num_blocks} and block_size {self.block_size} must be >= 1"
            )
        if self.in_process and self.tp_size != 1:
            raise ConfigError(f"in_process needs tp_size 1, got {self.tp_size}")
        if min(self.startup_timeout_s, self.step_timeout_s) <= 0:
            raise ConfigError("timeouts must be > 0")

    def limits(self) -> StepLimits:
        """The step bounds every rank enforces."""
        return StepLimits(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.model.max_model_len,
            vocab_size=self.model.vocab_size,
            max_num_reqs=self.max_num_reqs,
            max_num_batched_tokens=self.max_num_batched_tokens or self.model.max_model_len,
        )


def _no_wakeup() -> None:
    """``WorkerContext.notify`` of a group nobody waits on."""


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """What a worker extension factory gets: this rank and its runner.

    Attributes:
        tp_rank: This worker's TP rank.
        tp_size: TP size.
        runner: The rank's model runner (``runner.kv_caches`` are the caches to
            register; ``runner.kv_heads`` the global KV heads they hold).
        config: The group's configuration.
        notify: Wakes the engine between steps: call it (from any thread, it
            never blocks) when something the engine polls its workers for
            happened outside a step, e.g. a KV transfer finished.
    """

    tp_rank: int
    tp_size: int
    runner: ModelRunner
    config: WorkerGroupConfig
    notify: Callable[[], None] = _no_wakeup

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Per-layer KV cache tensors of this rank."""
        return self.runner.kv_caches

    @property
    def extension_config(self) -> Any:
        """``config.extension_config``."""
        return self.config.extension_config


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Facts about one running rank."""

    tp_rank: int
    pid: int
    kv_heads: tuple[int, int]  # global KV heads [start, stop)
    kv_cache_shape: tuple[int, ...]
    device: str


def load_extension(path: str) -> Callable[[WorkerContext], object]:
    """Resolve ``"package.module:factory"`` to the factory.

    Raises:
        ConfigError: malformed path, module not importable, or no such callable.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"worker extension {path!r} must look like 'package.module:factory'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load worker extension {path!r}: {exc}") from exc
    if not callable(factory):
        raise ConfigError(f"worker extension {path!r} is not callable")
    return factory  # type: ignore[no-any-return]


class _RankWorker:
    """One rank's state and message handling (in a worker process or in-process)."""

    def __init__(
        self, config: WorkerGroupConfig, tp: TensorParallel,
        notify: Callable[[], None] = _no_wakeup,
    ) -> None:
        device = torch.device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", tp.rank)
            torch.cuda.set_device(device)
        self.tp = tp
        self.runner = ModelRunner(
            config.model,
            tp.rank,
            tp.size,
            tp.group,
            config.num_blocks,
            config.block_size,
            config.layout,
            device,
            weights=config.weights_dir,
            max_num_reqs=config.max_num_reqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.extension: object | None = None
        if config.worker_extension is not None:
            factory = load_extension(config.worker_extension)
            self.extension = factory(WorkerContext(tp.rank, tp.size, self.runner, config, notify))

    def handle(self, msg: tuple[Any, ...]) -> object:
        kind = msg[0]
        if kind == "execute":
            return self.runner.execute(msg[1])
        if kind == "call":
            _, method, args, kwargs = msg
            if self.extension is None:
                raise WorkerError(f"call({method!r}): no worker extension configured")
            return getattr(self.extension, method)(*args, **kwargs)
        if kind == "info":
            return RankInfo(
                tp_rank=self.tp.rank,
                pid=os.getpid(),
                kv_heads=(self.runner.kv_heads.start, self.runner.kv_heads.stop),
                kv_cache_shape=tuple(self.runner.kv_caches[0].shape),
                device=str(self.runner.device),
            )
        raise WorkerError(f"unknown worker message {kind!r}")

    def close(self) -> None:
        close = getattr(self.extension, "close", None)
        if callable(close):
            close()


def _exit_when_orphaned(parent_pid: int) -> None:
    """Exit this worker if its parent dies (the pipe alone misses a stuck collective)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kvbridge-orphan-watch", daemon=True).start()


def _worker_main(
    config: WorkerGroupConfig, rank: int, port: int, conn: Connection,
    notify: Callable[[], None],
) -> None:
    """Entry point of a spawned worker: init, report ready, serve until told to stop."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned(os.getppid())
    tp = TensorParallel()
    worker: _RankWorker | None = None
    try:
        cores = os.cpu_count() or 1
        torch.set_num_threads(config.num_threads or max(1, cores // config.tp_size))
        tp = init_tp_group(
            rank,
            config.tp_size,
            host=_HOST,
            port=port,
            backend=default_backend(config.device),
            timeout_s=config.step_timeout_s,
        )
        worker = _RankWorker(config, tp, notify)
        conn.send(("ok", worker.handle(("info",))))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # parent closed the pipe or died
                return
            if msg[0] == "shutdown":
                return
            try:
                conn.send(("ok", worker.handle(msg)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        if worker is not None:
            worker.close()
        destroy_tp_group(tp)
        conn.close()


class _LocalRank:
    """The only rank, run in the caller's process; replies are computed on send."""

    def __init__(self, worker: _RankWorker) -> None:
        self.worker = worker
        self._reply: tuple[str, object] | None = None

    def send(self, msg: tuple[Any, ...]) -> None:
        try:
            self._reply = ("ok", self.worker.handle(msg))
        except Exception:
            self._reply = ("error", traceback.format_exc())

    def recv(self, timeout_s: float) -> tuple[str, object]:
        reply, self._reply = self._reply, None
        assert reply is not None, "recv without send"
        return reply


class _ProcessRank:
    """A spawned worker and the parent's end of its pipe."""

    def __init__(self, process: BaseProcess, conn: Connection, tp_rank: int) -> None:
        self.process = process
        self.conn = conn
        self.tp_rank = tp_rank

    def send(self, msg: tuple[Any, ...]) -> None:
        try:
            self.conn.send(msg)
        except OSError as exc:
            raise WorkerError(f"worker rank {self.tp_rank} is gone: {exc}") from exc

    def recv(self, timeout_s: float) -> tuple[str, object]:
        try:
            if not self.conn.poll(max(0.0, timeout_s)):
                raise WorkerTimeoutError(
                    f"worker rank {self.tp_rank} (pid {self.process.pid}) sent nothing "
                    f"within {timeout_s:.1f} s"
                )
            reply: tuple[str, object] = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.process.join(1.0)  # so the exit code is known
            raise WorkerError(
                f"worker rank {self.tp_rank} (pid {self.process.pid}) died, "
                f"exit code {self.process.exitcode}"
            ) from exc
        return reply


def _reap(ranks: Sequence[_ProcessRank]) -> None:
    """Stop every worker process: ask, then SIGTERM, then SIGKILL; close the pipes."""
    for rank in ranks:
        with contextlib.suppress(OSError):
            rank.conn.send(("shutdown",))
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


def _unwrap(replies: Sequence[tuple[str, object]], what: str) -> list[Any]:
    """The payloads of ``replies``, or a ``WorkerError`` quoting every failed rank."""
    errors = [
        f"rank {i}:\n{payload}" for i, (status, payload) in enumerate(replies) if status != "ok"
    ]
    if errors:
        raise WorkerError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
    return [payload for _, payload in replies]


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
        self, config: WorkerGroupConfig, notify: Callable[[], None] = _no_wakeup,
    ) -> None:
        self.config = config
        self._notify = notify
        self._limits = config.limits()
        self._closed = False
        self._local: _LocalRank | None = None
        self._procs: list[_ProcessRank] = []
        self._ranks: list[_LocalRank | _ProcessRank] = []
        if config.in_process:
            self._local = _LocalRank(_RankWorker(config, TensorParallel(), notify))
            self._ranks = [self._local]
            return
        # The finalizer holds the list, not self, so collection and exit reap too.
        self._finalizer = weakref.finalize(self, _reap, self._procs)
        try:
            self._spawn()
            _unwrap(self._gather(config.startup_timeout_s), "startup")
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        port = find_free_port(_HOST)
        for rank in range(self.config.tp_size):
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(
                target=_worker_main,
                args=(self.config, rank, port, child_conn, self._notify),
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
            results = self._broadcast(("execute", batch), "execute")
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
            WorkerError: no extension, or the method raised on some rank (the
                group stays usable); a rank died (the group is shut down).
            WorkerTimeoutError: a rank did not answer in time (shut down).
        """
        return self._broadcast(("call", method, args, kwargs), f"call({method!r})")

    def info(self) -> list[RankInfo]:
        """Per-rank facts (pid, KV heads, cache shape, device)."""
        infos: list[RankInfo] = self._broadcast(("info",), "info")
        return infos

    def _broadcast(self, msg: tuple[Any, ...], what: str) -> list[Any]:
        if self._closed:
            raise WorkerError(f"{what}: worker group is shut down")
        try:
            for rank in self._ranks:
                rank.send(msg)
            replies = self._gather(self.config.step_timeout_s)
        except WorkerError:
            # A rank died or hung; the others may wait in a collective forever.
            self.shutdown()
            raise
        return _unwrap(replies, what)

    def _gather(self, timeout_s: float) -> list[tuple[str, object]]:
        """One reply from every rank (all are read, so the pipes stay in step).

        Raises:
            WorkerError: a rank died. WorkerTimeoutError: the deadline passed.
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

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`shutdown` has run."""
        return self._closed

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
