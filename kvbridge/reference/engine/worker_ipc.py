"""What a ``WorkerGroup`` and its TP worker processes share: config, messages, errors.

Two sides use this module: the group in the engine's process (``workers.py``)
and each rank's worker (``rank_worker.py``, in a spawned process or in the
caller's). The group spawns every worker with the same :class:`WorkerGroupConfig`,
then sends a :data:`WorkerRequest` to every rank and reads one
:data:`WorkerReply` back from each, in lock step. Conversation on one rank's
pipe (group G, worker W)::

    W -> G  Done(RankInfo)                 once, when the rank is built (or Failed)
    G -> W  Execute(StepBatch)             W -> G  Done(sampled tokens; G keeps rank 0's)
    G -> W  CallExtension(method, args)    W -> G  Done(the method's return value)
    G -> W  Describe()                     W -> G  Done(RankInfo)
                                  any of these may be answered Failed(traceback)
    G -> W  Exit()                         no reply; W exits

The pipes are ``multiprocessing`` connections, so the messages travel pickled:
a call's arguments and results are whatever the extension takes and returns
(tensors, connector metadata), which msgpack cannot carry. Both ends are this
package and the pipe is private to the two processes. Each side still checks
what it unpickled: anything but one of these classes, with fields of the
declared types, is a :class:`WorkerProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.reference.engine.model_config import ModelConfig
from kvbridge.reference.engine.runner import StepBatch, StepLimits
from kvbridge.topology import KVLayout

__all__ = [
    "CallExtension",
    "Describe",
    "Done",
    "Execute",
    "Exit",
    "Failed",
    "RankInfo",
    "UnknownMethodError",
    "WorkerError",
    "WorkerGroupConfig",
    "WorkerProtocolError",
    "WorkerReply",
    "WorkerRequest",
    "WorkerTimeoutError",
]


class WorkerError(KVBridgeError):
    """A worker failed to start, raised while handling a request, or died."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A worker did not answer within the configured timeout."""


class WorkerProtocolError(WorkerError):
    """A pipe carried something other than a well-formed message of this module."""


class UnknownMethodError(WorkerError):
    """``WorkerGroup.call`` named a method the worker extension does not have."""


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
            a ``rank_worker.WorkerContext``, or ``None``.
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


class RankInfo(msgspec.Struct, frozen=True):
    """Facts about one running rank.

    Attributes:
        tp_rank: The rank.
        pid: Its process id (the caller's own pid for an in-process rank).
        kv_heads: Global KV heads ``[start, stop)`` its caches hold.
        kv_cache_shape: Shape of one layer's KV cache tensor.
        device: Torch device of the rank.
        extension_methods: Methods ``WorkerGroup.call`` may invoke on the
            rank's worker extension (its class's public callables; empty
            without an extension).
    """

    tp_rank: int
    pid: int
    kv_heads: tuple[int, int]
    kv_cache_shape: tuple[int, ...]
    device: str
    extension_methods: tuple[str, ...] = ()


class _Request(msgspec.Struct, frozen=True, tag_field="kind"):
    pass


class Execute(_Request, frozen=True, tag="execute"):
    """Run one step; each rank replies with its sampled tokens (the group uses rank 0's)."""

    batch: StepBatch


class CallExtension(_Request, frozen=True, tag="call"):
    """Call ``method(*args, **kwargs)`` on the rank's worker extension.

    ``method`` must be one of the rank's ``RankInfo.extension_methods``.
    """

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class Describe(_Request, frozen=True, tag="describe"):
    """Ask the rank for its :class:`RankInfo`."""


class Exit(_Request, frozen=True, tag="exit"):
    """Stop serving and exit (no reply)."""


WorkerRequest: TypeAlias = Execute | CallExtension | Describe | Exit
"""What the group sends a rank."""


class _Reply(msgspec.Struct, frozen=True, tag_field="kind"):
    pass


class Done(_Reply, frozen=True, tag="done"):
    """The request succeeded; ``value`` is its result."""

    value: Any = None


class Failed(_Reply, frozen=True, tag="failed"):
    """The request raised on the rank; ``traceback`` is the formatted exception."""

    traceback: str


WorkerReply: TypeAlias = Done | Failed
"""What a rank answers (exactly one per request other than ``Exit``)."""
