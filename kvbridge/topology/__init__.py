"""Who reads which KV bytes from whom: pure rank, head, layer and byte arithmetic.

Nothing here does I/O or touches tensors; shapes and strides are plain int
tuples. The transfer agent (one per worker) builds a :class:`TpKVTopology`,
registers each peer engine after its handshake, and asks:

- on the reading side (D): :meth:`TpKVTopology.plan_reads` -> :class:`ReadPlan`,
  one :class:`RemoteRead` per remote worker to contact;
- on the serving side (P): :meth:`TpKVTopology.expected_readers` (or the pure
  :func:`num_expected_readers`), the number of reader workers that must report
  before a request's blocks may be freed.

Modules:

- :mod:`.engine_topology`: engine description, head and layer split rules;
- :mod:`.ratios`: TP/PP/block-size ratios, the pairing check;
- :mod:`.targets`: remote workers to contact, reader counts;
- :mod:`.read_plan`: the per-rank read plan and its byte ranges;
- :mod:`.tp_topology`: the per-worker object tying these together;
- :mod:`.layout_facts`: cache tensor facts from shapes and strides;
- :mod:`.groups`: KV cache groups (sliding window, recurrent state): which
  blocks of each group P holds and D reads;
- :mod:`.layout`: :class:`KVLayout`, the order of tokens and heads in a block
  (shared with kernels and transfer).

Example: D has TP 2, P has TP 4, 8 KV heads, HND on both sides::

    >>> from kvbridge.topology import (
    ...     EngineTopology, KVLayout, TpKVTopology, num_expected_readers)
    >>> d = EngineTopology(tp_size=2, pp_size=1, block_size=16, num_kv_heads=8,
    ...                    is_mla=False, layout=KVLayout.HND, num_layers=4)
    >>> p = EngineTopology(tp_size=4, pp_size=1, block_size=16, num_kv_heads=8,
    ...                    is_mla=False, layout=KVLayout.HND, num_layers=4)
    >>> topo = TpKVTopology(d, tp_rank=1, pp_rank=0, remotes={"prefill-0": p})
    >>> topo.tp_ratio(4)
    -2
    >>> plan = topo.plan_reads("prefill-0")
    >>> [(it.remote_tp_rank, it.read, it.global_heads, it.local_head_offset)
    ...  for it in plan.items]
    [(2, True, range(4, 6), 0), (3, True, range(6, 8), 2)]
    >>> plan.items[0].block_byte_ranges(elem_size=2, head_dim=64)  # per K/V plane
    [(0, 4096)]
    >>> num_expected_readers(d, p, server_tp_rank=3, server_pp_rank=0)
    1
"""

from __future__ import annotations

from kvbridge.topology.engine_topology import (
    EngineTopology,
    heads_for_tp_rank,
    layers_for_pp_rank,
)
from kvbridge.topology.groups import (
    CacheGroup,
    GroupRead,
    HeldGroups,
    hold_groups,
    load_problem,
    plan_group_read,
)
from kvbridge.topology.layout import KVLayout, planes_per_block
from kvbridge.topology.layout_facts import CacheLayoutFacts, describe_cache
from kvbridge.topology.ratios import (
    BlockSizeRatio,
    IncompatibleTopologyError,
    block_size_ratio,
    check_compatible,
    signed_ratio,
)
from kvbridge.topology.read_plan import ReadPlan, RemoteRead, build_read_plan
from kvbridge.topology.targets import RemoteRank, num_expected_readers, target_remote_ranks
from kvbridge.topology.tp_topology import TpKVTopology, UnknownEngineError

__all__ = [
    "BlockSizeRatio",
    "CacheGroup",
    "CacheLayoutFacts",
    "EngineTopology",
    "GroupRead",
    "HeldGroups",
    "IncompatibleTopologyError",
    "KVLayout",
    "ReadPlan",
    "RemoteRank",
    "RemoteRead",
    "TpKVTopology",
    "UnknownEngineError",
    "block_size_ratio",
    "build_read_plan",
    "check_compatible",
    "describe_cache",
    "heads_for_tp_rank",
    "hold_groups",
    "layers_for_pp_rank",
    "load_problem",
    "num_expected_readers",
    "planes_per_block",
    "plan_group_read",
    "signed_ratio",
    "target_remote_ranks",
]
