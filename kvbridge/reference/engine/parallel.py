"""Tensor-parallel plumbing: the rank's view (``TensorParallel``), group setup, shards.

Each TP worker process calls :func:`init_tp_group` once (gloo on CPU, NCCL on
GPU, rendezvous through the TCP store the parent serves, :func:`rendezvous_store`)
and hands the resulting :class:`TensorParallel` to the
model, which calls :meth:`TensorParallel.all_reduce` after its row-parallel
projections. With ``tp_size == 1`` no process group exists and the reduction is
the identity, so the same model code runs in-process.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from kvbridge.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """One rank's place in its tensor-parallel group.

    Attributes:
        rank: This rank, in ``[0, size)``.
        size: Number of TP ranks.
        group: The process group joining them; ``None`` only when ``size == 1``.

    Raises:
        ConfigError: a rank out of range, or ``size > 1`` without a group.
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"tp rank {self.rank} out of range for tp size {self.size}")
        if self.size > 1 and self.group is None:
            raise ConfigError(f"tp size {self.size} needs a process group")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it (identity for one rank)."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def shard(self, total: int, what: str) -> range:
        """This rank's contiguous slice of ``total`` items split evenly over the group.

        Raises:
            ConfigError: ``size`` does not divide ``total``.
        """
        return shard_range(total, self.size, self.rank, what)


def shard_range(total: int, num_shards: int, shard: int, what: str = "items") -> range:
    """Indices ``[shard * total / n, (shard + 1) * total / n)`` of an even split.

    Args:
        total: Items to split.
        num_shards: Number of equal parts; must divide ``total``.
        shard: Which part, in ``[0, num_shards)``.
        what: Name of the items for error messages.

    Raises:
        ConfigError: uneven split or ``shard`` out of range.
    """
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} out of range for {num_shards} shards of {what}")
    if total % num_shards:
        raise ConfigError(f"{what} {total} not divisible by {num_shards} shards")
    size = total // num_shards
    return range(shard * size, (shard + 1) * size)


def default_backend(device: torch.device | str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rendezvous_store(host: str, size: int, timeout_s: float) -> TCPStore:
    """The TP group's rendezvous, served by the parent: a TCP store listening on a port
    of ``host`` the OS picks (``.port``), already bound when the ranks start.

    (A port found free and handed to rank 0 to bind could be taken meanwhile, by any
    connection's ephemeral port: the other ranks then waited for a store that never
    came, ``timeout_s`` long.) Keep it until the group is gone.
    """
    return TCPStore(host, 0, size, is_master=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_tp_group(
    rank: int,
    size: int,
    *,
    host: str,
    port: int,
    backend: str,
    timeout_s: float,
) -> TensorParallel:
    """Join this process to its TP group (the process-wide default group).

    Call once per worker process; with ``size == 1`` nothing is initialised.

    Args:
        rank: This process's TP rank.
        size: TP size.
        host: Rendezvous host (the parent's store listens there).
        port: The store's port (``rendezvous_store``).
        backend: ``gloo`` or ``nccl``.
        timeout_s: Limit on the rendezvous and on every collective.

    Returns:
        The rank's :class:`TensorParallel`.

    Raises:
        ConfigError: bad rank/size; ``RuntimeError`` from torch when the
            rendezvous fails or times out.
    """
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"tp rank {rank} out of range for tp size {size}")
    if size == 1:
        return TensorParallel()
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, size, is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size,
                            timeout=timeout)
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD)


def destroy_tp_group(tp: TensorParallel) -> None:
    """Leave the process group created by :func:`init_tp_group` (no-op for one rank)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
