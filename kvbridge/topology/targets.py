"""Which remote workers a local worker contacts, and how many readers a server expects.

Which remote TP ranks a local TP rank contacts::

    local TP 4, remote TP 2 (ratio +2)        local TP 2, remote TP 4 (ratio -2)
      local   0 1 | 2 3                         local      0    |    1
      remote   0  |  1                          remote   0   1  |  2   3

Which remote PP ranks: every one whose layers overlap the local rank's layers
(both sides split layers with :func:`layers_for_pp_rank`).

Callers: :mod:`kvbridge.topology.read_plan` (reading side) and, through
:func:`num_expected_readers`, the serving side's transfer agent.
"""

from __future__ import annotations

from typing import NamedTuple

from kvbridge.topology.engine_topology import EngineTopology, layers_for_pp_rank
from kvbridge.topology.ratios import check_compatible, signed_ratio


class RemoteRank(NamedTuple):
    """One worker of a remote engine: ``global_rank = pp_rank * tp_size + tp_rank``."""

    global_rank: int
    pp_rank: int
    tp_rank: int


def intersect_ranges(a: range, b: range) -> range:
    """The overlap of two step-1 ranges (empty if they are disjoint)."""
    return range(max(a.start, b.start), min(a.stop, b.stop))


def target_remote_ranks(
    local: EngineTopology,
    tp_rank: int,
    pp_rank: int,
    remote_tp_size: int,
    remote_pp_size: int,
) -> list[RemoteRank]:
    """Remote workers one local rank contacts (reading or notify-only), by PP then TP rank.

    The remote engine splits the same ``local.num_layers`` layers over its PP ranks.

    Raises:
        ConfigError: a local rank is out of range, ``remote_pp_size`` exceeds
            the layer count, or TP/PP sizes do not divide one another
            (:class:`IncompatibleTopologyError`).
    """
    my_layers = local.layers_of(pp_rank)
    local.heads_of(tp_rank)  # validates tp_rank
    tp_ratio = signed_ratio("tensor parallel size", local.tp_size, remote_tp_size)
    signed_ratio("pipeline parallel size", local.pp_size, remote_pp_size)
    if tp_ratio > 0:
        tp_ranks = range(tp_rank // tp_ratio, tp_rank // tp_ratio + 1)
    else:
        tp_ranks = range(tp_rank * -tp_ratio, (tp_rank + 1) * -tp_ratio)
    return [
        RemoteRank(remote_pp * remote_tp_size + remote_tp, remote_pp, remote_tp)
        for remote_pp in range(remote_pp_size)
        if intersect_ranges(
            layers_for_pp_rank(local.num_layers, remote_pp_size, remote_pp), my_layers
        )
        for remote_tp in tp_ranks
    ]


def num_expected_readers(
    reader: EngineTopology,
    server: EngineTopology,
    server_tp_rank: int,
    server_pp_rank: int,
) -> int:
    """How many reader workers will contact one server worker (reading or notify-only).

    The server frees a request's blocks once this many readers have reported
    (or the lease expires). TP: ``reader.tp_size // server.tp_size`` readers
    when the reader has more ranks, else 1 (each server rank then belongs to
    exactly one reader's group). PP: every reader PP rank whose layers overlap.

    Args:
        reader: The reading engine (D).
        server: The serving engine (P).
        server_tp_rank: The server worker's TP rank.
        server_pp_rank: The server worker's PP rank.

    Returns:
        The number of distinct reader workers, >= 1.

    Raises:
        ConfigError: a server rank is out of range, or the engines cannot pair
            (:class:`IncompatibleTopologyError`).
    """
    check_compatible(reader, server)
    server.heads_of(server_tp_rank)  # validates server_tp_rank
    server_layers = server.layers_of(server_pp_rank)
    tp_ratio = signed_ratio("tensor parallel size", reader.tp_size, server.tp_size)
    num_tp_readers = tp_ratio if tp_ratio > 0 else 1
    num_pp_readers = sum(
        1 for pp in range(reader.pp_size) if intersect_ranges(reader.layers_of(pp), server_layers)
    )
    return num_tp_readers * num_pp_readers
