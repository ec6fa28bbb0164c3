"""One TP rank's worker: builds the rank's runner and extension, answers the group.

The child side of ``workers.py``: a :class:`WorkerGroup
<kvbridge.reference.engine.workers.WorkerGroup>` spawns one process per rank running
:func:`worker_main`, or, with ``in_process=True``, keeps one :class:`RankWorker`
in its own process. Either way the rank's :class:`RankWorker` builds a
:class:`ModelRunner` and the *worker extension* (``"package.module:factory"``,
called with a :class:`WorkerContext`) and answers the group's requests
(``worker_ipc.py``) one at a time: a failure becomes a ``Failed`` reply with
its traceback, never a dead pipe.

A spawned worker ignores SIGINT (the group decides when workers stop), exits
when asked (``Exit``) or when its pipe closes, and exits by itself when its
parent process dies.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvbridge.errors import ConfigError
from kvbridge.reference.engine.parallel import (
    TensorParallel,
    default_backend,
    destroy_tp_group,
    init_tp_group,
)
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
)

__all__ = [
    "RankWorker",
    "WorkerContext",
    "load_extension",
    "no_wakeup",
    "public_methods",
    "worker_main",
]


def no_wakeup() -> None:
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
    notify: Callable[[], None] = no_wakeup

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Per-layer KV cache tensors of this rank."""
        return self.runner.kv_caches

    @property
    def extension_config(self) -> Any:
        """``config.extension_config``."""
        return self.config.extension_config


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


def public_methods(extension: object) -> tuple[str, ...]:
    """Names ``WorkerGroup.call`` may invoke: the public callables of ``extension``'s class.

    Looked up on the class, so properties are not run and private or dunder
    names (``_x``, ``__class__``) are never reachable through a call.
    """
    cls = type(extension)
    return tuple(sorted(
        name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))
    ))


class RankWorker:
    """One rank's state and message handling (in a worker process or in-process)."""

    def __init__(
        self, config: WorkerGroupConfig, tp: TensorParallel,
        notify: Callable[[], None] = no_wakeup,
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
        self.extension_methods: tuple[str, ...] = ()
        if config.worker_extension is not None:
            factory = load_extension(config.worker_extension)
            self.extension = factory(WorkerContext(tp.rank, tp.size, self.runner, config, notify))
            self.extension_methods = public_methods(self.extension)

    def handle(self, request: object) -> object:
        """Serve one request (not ``Exit``) and return the value to reply ``Done`` with.

        Raises:
            WorkerProtocolError: ``request`` is not a well-formed request.
            UnknownMethodError: a call names no public method of the extension.
            Exception: whatever the step or the extension method raised.
        """
        match request:
            case Execute(batch=StepBatch() as batch):
                return self.runner.execute(batch)
            case CallExtension(method=str() as method, args=tuple() as args,
                               kwargs=dict() as kwargs):
                return self.call_extension(method, args, kwargs)
            case Describe():
                return self.info()
        raise WorkerProtocolError(
            f"rank {self.tp.rank}: not a well-formed worker request: {type(request).__name__}"
        )

    def call_extension(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
        """``method(*args, **kwargs)`` on the extension, if it is one of its public methods.

        Raises:
            WorkerError: no extension configured.
            UnknownMethodError: ``method`` is not in ``extension_methods``.
        """
        if self.extension is None:
            raise WorkerError(f"call({method!r}): no worker extension configured")
        if method not in self.extension_methods:
            raise UnknownMethodError(
                f"call({method!r}): the worker extension {type(self.extension).__name__} has "
                f"no public method {method!r} (it has {', '.join(self.extension_methods)})"
            )
        return getattr(self.extension, method)(*args, **kwargs)

    def info(self) -> RankInfo:
        """This rank's facts for the group (``Describe``, and once at startup)."""
        return RankInfo(
            tp_rank=self.tp.rank,
            pid=os.getpid(),
            kv_heads=(self.runner.kv_heads.start, self.runner.kv_heads.stop),
            kv_cache_shape=tuple(self.runner.kv_caches[0].shape),
            device=str(self.runner.device),
            extension_methods=self.extension_methods,
        )

    def reply(self, request: object) -> WorkerReply:
        """``Done`` with the result of :meth:`handle`, or ``Failed`` with its traceback."""
        try:
            return Done(self.handle(request))
        except Exception:
            return Failed(traceback.format_exc())

    def close(self) -> None:
        """Close the extension (its ``close()``, if it has one)."""
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


def worker_main(
    config: WorkerGroupConfig, rank: int, host: str, port: int, conn: Connection,
    notify: Callable[[], None],
) -> None:
    """Entry point of a spawned worker: init, report ready, serve until told to stop.

    Args:
        config: The group's configuration.
        rank: This worker's TP rank.
        host: Rendezvous host of the TP group (TCP).
        port: Rendezvous port on ``host``.
        conn: This worker's end of its pipe to the group; closed on return.
        notify: ``WorkerContext.notify`` for the extension.
    """
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned(os.getppid())
    tp = TensorParallel()
    worker: RankWorker | None = None
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this rank may run on
        torch.set_num_threads(config.num_threads or max(1, cores // config.tp_size))
        tp = init_tp_group(
            rank,
            config.tp_size,
            host=host,
            port=port,
            backend=default_backend(config.device),
            timeout_s=config.step_timeout_s,
        )
        worker = RankWorker(config, tp, notify)
        conn.send(Done(worker.info()))
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):  # parent closed the pipe or died
                return
            except Exception:  # did not unpickle; the pipe is still in step
                conn.send(Failed(f"rank {rank}: undecodable request:\n{traceback.format_exc()}"))
                continue
            if isinstance(request, Exit):
                return
            reply = worker.reply(request)
            try:
                conn.send(reply)
            except Exception:  # the result does not pickle; nothing was written
                conn.send(Failed(traceback.format_exc()))
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(Failed(traceback.format_exc()))
    finally:
        if worker is not None:
            worker.close()
        destroy_tp_group(tp)
        conn.close()
