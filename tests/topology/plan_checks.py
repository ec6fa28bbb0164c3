"""Independent checks of read plans, shared by the grid and the property tests.

The expected values are derived here from first principles (lists of heads per
rank, element-by-element block offsets), not from the formulas in
``kvbridge.topology``, so a wrong formula there shows up as a mismatch.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter

from kvbridge.topology import EngineTopology, KVLayout, ReadPlan, RemoteRead, TpKVTopology
from kvbridge.topology import num_expected_readers as expected_readers_fn

ELEM_SIZE = 2
HEAD_DIM = 3  # odd, so a wrong stride cannot line up by accident


def heads_by_rank(num_heads: int, tp_size: int) -> list[list[int]]:
    """Heads each TP rank holds: equal chunks, or each head repeated on tp/H ranks."""
    if tp_size <= num_heads:
        chunk = num_heads // tp_size
        return [list(range(num_heads))[r * chunk : (r + 1) * chunk] for r in range(tp_size)]
    return [[h] for h in range(num_heads) for _ in range(tp_size // num_heads)]


def layers_by_rank(num_layers: int, pp_size: int) -> list[list[int]]:
    """Layers each PP rank holds: deal sizes out one by one, then cut a contiguous list."""
    sizes = [0] * pp_size
    for i in range(num_layers):
        sizes[i % pp_size] += 1
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [list(range(bounds[p], bounds[p + 1])) for p in range(pp_size)]


@functools.cache
def _expected_block_bytes(
    layout: KVLayout, is_mla: bool, block_size: int, num_heads: int, heads: range
) -> frozenset[int]:
    """Bytes of one plane-block holding ``heads``, by walking elements in memory order."""
    if is_mla:
        dims: tuple[int, ...] = (block_size, HEAD_DIM)
        head_axis = None
    elif layout is KVLayout.NHD:
        dims, head_axis = (block_size, num_heads, HEAD_DIM), 1
    else:
        dims, head_axis = (num_heads, block_size, HEAD_DIM), 0
    wanted: set[int] = set()
    for position, index in enumerate(itertools.product(*(range(d) for d in dims))):
        if head_axis is None or index[head_axis] in heads:
            wanted.update(range(position * ELEM_SIZE, (position + 1) * ELEM_SIZE))
    return frozenset(wanted)


def _check_item_bytes(item: RemoteRead) -> None:
    ranges = item.block_byte_ranges(ELEM_SIZE, HEAD_DIM)
    if not item.read:
        assert ranges == []
        return
    _check_ranges(
        item.remote_layout,
        item.is_mla,
        item.remote_block_size,
        item.remote_num_heads,
        item.remote_heads,
        tuple(ranges),
    )


@functools.cache
def _check_ranges(
    layout: KVLayout,
    is_mla: bool,
    block_size: int,
    num_heads: int,
    heads: range,
    ranges: tuple[tuple[int, int], ...],
) -> None:
    """Ranges cover exactly the bytes of ``heads``, each once (cached: many items repeat)."""
    covered = [byte for offset, nbytes in ranges for byte in range(offset, offset + nbytes)]
    assert len(covered) == len(set(covered)), f"overlapping byte ranges {ranges}"
    assert list(ranges) == sorted(ranges)
    expected = _expected_block_bytes(layout, is_mla, block_size, num_heads, heads)
    assert set(covered) == expected, f"{layout} heads {heads} of {num_heads}: bytes {ranges}"


def _check_plan(plan: ReadPlan, reader: EngineTopology, server: EngineTopology) -> None:
    my_heads = heads_by_rank(reader.num_kv_heads, reader.tp_size)[plan.local_tp_rank]
    my_layers = layers_by_rank(reader.num_layers, reader.pp_size)[plan.local_pp_rank]
    server_heads = heads_by_rank(server.num_kv_heads, server.tp_size)
    server_layers = layers_by_rank(server.num_layers, server.pp_size)
    assert list(plan.local_heads) == my_heads
    assert list(plan.local_layers) == my_layers
    # (layer, local head index) -> number of reads landing there
    landed: Counter[tuple[int, int]] = Counter()
    for item in plan.items:
        held, layers = server_heads[item.remote_tp_rank], server_layers[item.remote_pp_rank]
        assert item.remote_rank == item.remote_pp_rank * server.tp_size + item.remote_tp_rank
        assert item.global_layers, "a contacted rank must share layers"
        for i, layer in enumerate(item.global_layers):
            assert my_layers[item.local_layers[i]] == layer
            assert layers[item.remote_layers[i]] == layer
        assert item.remote_num_heads == len(held)
        assert item.remote_block_size == server.block_size
        if item.read:
            for i, head in enumerate(item.global_heads):
                assert held[item.remote_heads[i]] == head
                assert my_heads[item.local_head_offset + i] == head
                for layer in item.global_layers:
                    landed[layer, item.local_head_offset + i] += 1
        else:
            # Notify-only: everything this remote rank could give is read from another.
            assert not item.global_heads and not item.remote_heads
            assert any(
                other.read
                and other.remote_pp_rank == item.remote_pp_rank
                and set(held) & set(my_heads) == set(other.global_heads)
                for other in plan.items
            )
        _check_item_bytes(item)
    expected = {(layer, i): 1 for layer in my_layers for i in range(len(my_heads))}
    assert dict(landed) == expected, "every local head of every layer read exactly once"
    # Replicas (contacted ranks of one PP rank holding the same wanted heads) share
    # the layers: each reads a run, evenly; only those left without one notify.
    groups: dict[tuple[int, tuple[int, ...]], list[RemoteRead]] = {}
    for item in plan.items:
        wanted = tuple(sorted(set(server_heads[item.remote_tp_rank]) & set(my_heads)))
        groups.setdefault((item.remote_pp_rank, wanted), []).append(item)
    for (pp_rank, _), group in groups.items():
        shared = set(my_layers) & set(server_layers[pp_rank])
        readers = [item for item in group if item.read]
        assert len(readers) == min(len(group), len(shared)), group
        lengths = sorted(len(item.global_layers) for item in readers)
        assert lengths[-1] - lengths[0] <= 1, "replicas share the layers evenly"
        assert all(set(item.global_layers) == shared for item in group if not item.read)


def check_pair(reader: EngineTopology, server: EngineTopology) -> None:
    """Check every reader rank's plan and the server-side reader counts."""
    contacts: Counter[int] = Counter()
    for pp_rank, tp_rank in itertools.product(range(reader.pp_size), range(reader.tp_size)):
        topo = TpKVTopology(reader, tp_rank, pp_rank, {"server": server})
        plan = topo.plan_reads("server")
        assert plan.local_rank == pp_rank * reader.tp_size + tp_rank
        _check_plan(plan, reader, server)
        ranks = [item.remote for item in plan.items]
        assert ranks == topo.get_target_remote_ranks_from_engine_id("server")
        assert len(set(ranks)) == len(ranks), "each remote rank contacted once per reader"
        contacts.update(rank.global_rank for rank in ranks)
    for pp_rank, tp_rank in itertools.product(range(server.pp_size), range(server.tp_size)):
        expected = expected_readers_fn(reader, server, tp_rank, pp_rank)
        assert contacts[pp_rank * server.tp_size + tp_rank] == expected
        as_server = TpKVTopology(server, tp_rank, pp_rank, {"reader": reader})
        assert as_server.expected_readers("reader") == expected
