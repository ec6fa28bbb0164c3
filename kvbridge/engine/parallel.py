"""Tensor-parallel plumbing: the rank's view (``TensorParallel``), group setup, shards.

Each TP worker process calls :func:`init_tp_group` once (gloo on CPU, NCCL on
GPU, rendezvous over TCP on a free port the parent picked with
:func:`find_free_port`) and hands the resulting :class:`TensorParallel` to the
model, which calls :meth:`TensorParallel.all_reduce` after its row-parallel
projections. With ``tp_size == 1`` no process group exists and the reduction is
the identity, so the same model code runs in-process.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


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
        host: Rendezvous host (rank 0 listens there).
        port: Rendezvous TCP port.
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
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD)


def destroy_tp_group(tp: TensorParallel) -> None:
    """Leave the process group created by :func:`init_tp_group` (no-op for one rank)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
