"""The read plan: what one local rank pulls from which remote ranks, and where it lands.

A transfer agent on the reading side (D) calls :func:`build_read_plan` (or
:meth:`TpKVTopology.plan_reads`) once per peer engine and executes the items
for every request. Which remote workers are contacted comes from
:func:`kvbridge.topology.targets.target_remote_ranks`; the serving side (P)
counts its readers with :func:`kvbridge.topology.targets.num_expected_readers`.

Replication: when the remote side holds each head on several ranks (remote TP
> KV heads, or MLA) and remote TP > local TP, several contacted remote ranks
hold the same heads. Each byte is still read once, and the replicas share the
work: the layers both sides hold are cut into contiguous runs, one per replica,
so every replica serves a part and none is read twice. A replica left without
a layer (more replicas than layers) gets a notify-only item (``read=False``),
so that it can count this reader and free::

    MLA, 6 layers, remote TP 2, local TP 1:
      remote 0 layers [0, 3) read   remote 1 layers [3, 6) read
    H=2, remote TP 8, local TP 2, 3 layers, local rank 0 needs [h0] (on remote 0..3):
      remote 0 [0, 1)   remote 1 [1, 2)   remote 2 [2, 3)   remote 3 notify
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.topology.engine_topology import EngineTopology
from kvbridge.topology.layout import KVLayout, planes_per_block
from kvbridge.topology.ratios import (
    BlockSizeRatio,
    block_size_ratio,
    check_compatible,
    signed_ratio,
)
from kvbridge.topology.targets import RemoteRank, intersect_ranges, target_remote_ranks

_EMPTY = range(0)


def _shift(r: range, by: int) -> range:
    return range(r.start - by, r.stop - by)


def _layer_run(layers: range, index: int, count: int) -> range:
    """Replica ``index`` of ``count``'s contiguous share of ``layers``; the last may be empty."""
    num = len(layers)
    return range(layers.start - (-index * num // count),
                 layers.start - (-(index + 1) * num // count))


def _coalesce(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for offset, nbytes in pieces:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + nbytes)
        else:
            merged.append((offset, nbytes))
    return merged


@dataclass(frozen=True, slots=True)
class RemoteRead:
    """One remote rank's part in a local rank's read plan.

    Head ranges are ``range`` objects. ``remote_heads`` indexes the remote
    rank's own cache tensor (0 = its first head); ``local_head_offset`` is the
    head index in the local rank's tensor where ``remote_heads[0]`` lands.
    Layer ranges: ``global_layers`` are model layer indices; ``local_layers`` and
    ``remote_layers`` index each side's own per-rank layer list (same length).
    A notify-only item (``read=False``) transfers nothing: its head ranges are
    empty and :meth:`block_byte_ranges` returns ``[]``; its layer ranges still
    say which layers the two ranks share.

    Attributes:
        remote_rank: Global rank of the remote worker.
        remote_pp_rank: Its PP rank.
        remote_tp_rank: Its TP rank.
        read: True to read; False to only notify (replicated heads read elsewhere).
        remote_heads: Heads to take, indexed within the remote rank's tensor.
        global_heads: The same heads as model-wide indices.
        local_head_offset: First local head index they land on.
        global_layers: Layers read from this rank (model-wide indices): those both
            ranks hold, or a replica's share of them; for a notify-only item,
            all those both hold.
        local_layers: Those layers as indices into the local rank's layers.
        remote_layers: Those layers as indices into the remote rank's layers.
        remote_num_heads: Heads in the remote rank's tensor (its slice length).
        remote_block_size: Tokens per remote block.
        remote_layout: Token/head order inside a remote block.
        is_mla: The block holds one MLA latent per token (``head_dim`` = latent dim).
        fused_kv: The block is one plane holding K and V of each head as one run
            (vLLM CPU; ``head_dim`` = the ``2 * head_size`` row, layout HND).
        split_kv: Each layer entry is one plane, K or V alone (SGLang; NHD), so
            ``global_layers`` count planes.
    """

    remote_rank: int
    remote_pp_rank: int
    remote_tp_rank: int
    read: bool
    remote_heads: range
    global_heads: range
    local_head_offset: int
    global_layers: range
    local_layers: range
    remote_layers: range
    remote_num_heads: int
    remote_block_size: int
    remote_layout: KVLayout
    is_mla: bool
    fused_kv: bool = False
    split_kv: bool = False

    @property
    def remote(self) -> RemoteRank:
        """The ``(global_rank, pp_rank, tp_rank)`` triple of the remote worker."""
        return RemoteRank(self.remote_rank, self.remote_pp_rank, self.remote_tp_rank)

    @property
    def num_planes(self) -> int:
        """Per-layer block planes: 2 (K and V), or 1 (MLA latent, fused K/V, or a
        split cache's K or V)."""
        return planes_per_block(self.is_mla, self.fused_kv, self.split_kv)

    def block_byte_ranges(self, elem_size: int, head_dim: int) -> list[tuple[int, int]]:
        """Byte ranges to read from one plane (K or V) of one remote block of one layer.

        Offsets are relative to the start of that plane's block; the same list
        applies to K and to V, to every layer and every block. Adjacent pieces
        are merged. Example, remote rank holding 4 heads, reading heads [1, 3)::

            HND [heads][tokens][dim]   |h0....|h1....|h2....|h3....|   -> 1 range
                                              ^^^^^^^^^^^^^^
            NHD [tokens][heads][dim]   |t0: h0 h1 h2 h3|t1: h0 h1 h2 h3|...
                                            ^^^^^           ^^^^^      -> block_size ranges

        A fused K/V block (one plane) is HND with rows of ``2 * head_size``: each
        head's ``[K^T | V]`` is one run, so a head slice is one range as above.

        Args:
            elem_size: Bytes per element of the cache dtype.
            head_dim: Elements per head per token (the latent dim for MLA, the
                ``2 * head_size`` row for fused K/V).

        Returns:
            Sorted, disjoint ``(offset, nbytes)`` pairs; ``[]`` for a notify-only item.

        Raises:
            ConfigError: ``elem_size`` or ``head_dim`` is not positive.
        """
        if elem_size < 1 or head_dim < 1:
            raise ConfigError(f"elem_size {elem_size} and head_dim {head_dim} must be >= 1")
        if not self.read:
            return []
        head_nbytes = head_dim * elem_size  # one head of one token
        first, num_heads = self.remote_heads.start, len(self.remote_heads)
        if self.remote_layout is KVLayout.HND:
            token_run = self.remote_block_size * head_nbytes
            return [(first * token_run, num_heads * token_run)]
        row_nbytes = self.remote_num_heads * head_nbytes  # all heads of one token
        return _coalesce(
            [
                (token * row_nbytes + first * head_nbytes, num_heads * head_nbytes)
                for token in range(self.remote_block_size)
            ]
        )


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Everything one local rank does to pull a request's KV from one remote engine.

    Attributes:
        engine_id: The remote engine.
        local_rank: Global rank of the local worker.
        local_tp_rank: Its TP rank.
        local_pp_rank: Its PP rank.
        local_heads: Model-wide heads the local rank holds.
        local_layers: Model-wide layers the local rank holds.
        tp_ratio: Signed TP ratio (see :func:`signed_ratio`).
        pp_ratio: Signed PP ratio.
        block_ratio: How local and remote blocks tile tokens.
        items: One :class:`RemoteRead` per remote rank to contact, by PP then TP rank.
    """

    engine_id: str
    local_rank: int
    local_tp_rank: int
    local_pp_rank: int
    local_heads: range
    local_layers: range
    tp_ratio: int
    pp_ratio: int
    block_ratio: BlockSizeRatio
    items: tuple[RemoteRead, ...]

    @property
    def reads(self) -> tuple[RemoteRead, ...]:
        """Items that transfer data."""
        return tuple(item for item in self.items if item.read)

    @property
    def notify_only(self) -> tuple[RemoteRead, ...]:
        """Items that only tell the remote rank this reader is done."""
        return tuple(item for item in self.items if not item.read)


def build_read_plan(
    local: EngineTopology,
    tp_rank: int,
    pp_rank: int,
    remote: EngineTopology,
    engine_id: str,
) -> ReadPlan:
    """Plan the reads of local rank ``(tp_rank, pp_rank)`` from engine ``remote``.

    Every head of every layer the local rank holds is read exactly once; replicas
    share the layers (see the module docstring).

    Args:
        local: The reading engine.
        tp_rank: Local TP rank.
        pp_rank: Local PP rank.
        remote: The serving engine.
        engine_id: The serving engine's id (recorded in the plan).

    Returns:
        The :class:`ReadPlan`.

    Raises:
        ConfigError: a rank is out of range, or the engines cannot pair
            (:class:`IncompatibleTopologyError`).
    """
    check_compatible(local, remote)
    my_heads, my_layers = local.heads_of(tp_rank), local.layers_of(pp_rank)
    items: list[RemoteRead] = []
    targets = target_remote_ranks(local, tp_rank, pp_rank, remote.tp_size, remote.pp_size)
    # Replicas: contacted ranks of one PP rank holding the same wanted heads (slices
    # are aligned, so wanted runs are equal or disjoint). Each reads a run of layers.
    replicas: dict[tuple[int, range], list[int]] = {}
    for target in targets:
        wanted = intersect_ranges(remote.heads_of(target.tp_rank), my_heads)
        assert wanted, f"remote {target} holds none of the local heads {my_heads}"
        replicas.setdefault((target.pp_rank, wanted), []).append(target.tp_rank)
    for target in targets:
        remote_layers = remote.layers_of(target.pp_rank)
        shared_layers = intersect_ranges(my_layers, remote_layers)
        held = remote.heads_of(target.tp_rank)
        wanted = intersect_ranges(held, my_heads)
        group = replicas[target.pp_rank, wanted]
        part = _layer_run(shared_layers, group.index(target.tp_rank), len(group))
        read = len(part) > 0
        layers = part if read else shared_layers
        items.append(
            RemoteRead(
                remote_rank=target.global_rank,
                remote_pp_rank=target.pp_rank,
                remote_tp_rank=target.tp_rank,
                read=read,
                remote_heads=_shift(wanted, held.start) if read else _EMPTY,
                global_heads=wanted if read else _EMPTY,
                local_head_offset=wanted.start - my_heads.start if read else 0,
                global_layers=layers,
                local_layers=_shift(layers, my_layers.start),
                remote_layers=_shift(layers, remote_layers.start),
                remote_num_heads=len(held),
                remote_block_size=remote.block_size,
                remote_layout=remote.layout,
                is_mla=remote.is_mla,
                fused_kv=remote.fused_kv,
                split_kv=remote.split_kv,
            )
        )
    return ReadPlan(
        engine_id=engine_id,
        local_rank=local.global_rank(tp_rank, pp_rank),
        local_tp_rank=tp_rank,
        local_pp_rank=pp_rank,
        local_heads=my_heads,
        local_layers=my_layers,
        tp_ratio=signed_ratio("tensor parallel size", local.tp_size, remote.tp_size),
        pp_ratio=signed_ratio("pipeline parallel size", local.pp_size, remote.pp_size),
        block_ratio=block_size_ratio(local.block_size, remote.block_size),
        items=tuple(items),
    )
