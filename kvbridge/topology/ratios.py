"""Size ratios between two engines, and the check that two engines can pair at all.

Both directions are supported for TP, PP and block size: the reading side may
be larger or smaller than the serving side. Sizes that do not divide one
another cannot be mapped block to block or rank to rank and raise
:class:`IncompatibleTopologyError` (a ``ValueError``) naming both numbers.

Sign convention of :func:`signed_ratio` (used for TP and PP)::

    local 4, remote 2  ->  +2   (2 local ranks per remote rank)
    local 2, remote 4  ->  -2   (2 remote ranks per local rank)
    local 2, remote 2  ->  +1

Callers: :class:`kvbridge.topology.tp_topology.TpKVTopology`,
:mod:`kvbridge.topology.read_plan`, and the transfer handshake (to reject a
peer before any read).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.topology.engine_topology import EngineTopology


class IncompatibleTopologyError(ConfigError):
    """Two engines cannot exchange KV: a size ratio or a model-wide count disagrees."""


def signed_ratio(what: str, local_size: int, remote_size: int) -> int:
    """Ratio of two sizes where one divides the other, signed by which is larger.

    Args:
        what: Name of the size for the error message (e.g. "tensor parallel size").
        local_size: This side's size (>= 1).
        remote_size: The peer's size (>= 1).

    Returns:
        ``local_size // remote_size`` (>= 1) when ``local_size >= remote_size``,
        else ``-(remote_size // local_size)`` (<= -2).

    Raises:
        IncompatibleTopologyError: a size is not positive, or neither divides the other.
    """
    if local_size < 1 or remote_size < 1:
        raise IncompatibleTopologyError(
            f"{what} must be >= 1, got local {local_size} and remote {remote_size}"
        )
    if local_size >= remote_size:
        if local_size % remote_size:
            raise IncompatibleTopologyError(
                f"local {what} {local_size} is not divisible by remote {what} {remote_size}"
            )
        return local_size // remote_size
    if remote_size % local_size:
        raise IncompatibleTopologyError(
            f"remote {what} {remote_size} is not divisible by local {what} {local_size}"
        )
    return -(remote_size // local_size)


@dataclass(frozen=True, slots=True)
class BlockSizeRatio:
    """How local and remote blocks tile the same tokens.

    ::

        local 64, remote 16:  one local block  = remote blocks [4i, 4i+4)
        local 16, remote 64:  one remote block = local blocks  [4i, 4i+4)

    Attributes:
        local_block_size: Tokens per local block.
        remote_block_size: Tokens per remote block; one of the two divides the other.
    """

    local_block_size: int
    remote_block_size: int

    @property
    def num_remote_per_local(self) -> int:
        """Remote blocks filling one local block (1 unless remote blocks are smaller)."""
        return max(1, self.local_block_size // self.remote_block_size)

    @property
    def num_local_per_remote(self) -> int:
        """Local blocks filling one remote block (1 unless remote blocks are larger)."""
        return max(1, self.remote_block_size // self.local_block_size)

    @property
    def is_identity(self) -> bool:
        """True when both sides use the same block size."""
        return self.local_block_size == self.remote_block_size


def block_size_ratio(local_block_size: int, remote_block_size: int) -> BlockSizeRatio:
    """Pair two block sizes, in either direction.

    Args:
        local_block_size: Tokens per local block.
        remote_block_size: Tokens per remote block.

    Returns:
        The validated :class:`BlockSizeRatio`.

    Raises:
        IncompatibleTopologyError: a size is not positive, or neither divides the other.
    """
    signed_ratio("block size", local_block_size, remote_block_size)
    return BlockSizeRatio(local_block_size, remote_block_size)


def check_compatible(local: EngineTopology, remote: EngineTopology) -> None:
    """Check that two engines serve the same model shape with mappable sizes.

    Layout may differ (the unpack kernels convert it); everything else must
    either match (head and layer counts, MLA, fused K/V, split K/V) or divide
    (TP, PP, block size). Fused K/V caches (vLLM CPU, K transposed in each block) are
    never converted: their block sizes must be equal too (their layouts are,
    since ``EngineTopology`` admits them only as HND).

    Raises:
        IncompatibleTopologyError: the first mismatch found, with both numbers.
    """
    for name in ("num_kv_heads", "num_layers", "is_mla"):
        local_value, remote_value = getattr(local, name), getattr(remote, name)
        if local_value != remote_value:
            raise IncompatibleTopologyError(
                f"{name} differs: local {local_value}, remote {remote_value}"
            )
    if local.fused_kv != remote.fused_kv:
        raise IncompatibleTopologyError(
            f"fused_kv differs: local {local.fused_kv}, remote {remote.fused_kv}; a vLLM CPU "
            f"cache (K and V fused per head, K transposed) pairs only with another: run P "
            f"and D on the same attention backend"
        )
    if local.split_kv != remote.split_kv:
        raise IncompatibleTopologyError(
            f"split_kv differs: local {local.split_kv}, remote {remote.split_kv}; a split K/V "
            f"cache (one tensor per K and per V, SGLang) pairs only with another: run P and D "
            f"on the same engine"
        )
    if local.fused_kv and local.block_size != remote.block_size:
        raise IncompatibleTopologyError(
            f"vLLM CPU caches (K transposed in each block) move only between equal block "
            f"sizes: local {local.block_size}, remote {remote.block_size}; start P and D with "
            f"the same --block-size"
        )
    signed_ratio("tensor parallel size", local.tp_size, remote.tp_size)
    signed_ratio("pipeline parallel size", local.pp_size, remote.pp_size)
    signed_ratio("block size", local.block_size, remote.block_size)
