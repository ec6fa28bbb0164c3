"""``block_ranges``: where a direct read's bytes sit, checked against the caches' own views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.blocks.ranges import block_ranges, head_span
from kvbridge.transfer.local_kv import LocalKV

NUM_BLOCKS, BLOCK, HEADS, DIM, LAYERS = 6, 4, 4, 8, 3


def _local(layout: KVLayout, *, mla: bool = False) -> LocalKV:
    topo = EngineTopology(tp_size=1, pp_size=1, block_size=BLOCK, num_kv_heads=1 if mla else HEADS,
                          is_mla=mla, layout=layout, num_layers=LAYERS)
    if mla:
        shape: tuple[int, ...] = (NUM_BLOCKS, BLOCK, DIM)
    elif layout is KVLayout.NHD:
        shape = (2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    else:
        shape = (2, NUM_BLOCKS, HEADS, BLOCK, DIM)
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return LocalKV(topo, 0, 0, caches)


def _expected(local: LocalKV, ids: list[int], layers: range, heads: slice) -> list[tuple[int, int]]:
    """Each range from the tensors' views, in stream order: layer, plane, block."""
    out = []
    for layer in layers:
        cache = local.layers[layer]
        planes = [cache] if local.topology.is_mla else [cache[0], cache[1]]
        for plane in planes:
            for block in ids:
                view = plane[block]
                if not local.topology.is_mla and local.topology.layout is KVLayout.HND:
                    view = view[heads]
                out.append((view.data_ptr(), view.numel() * view.element_size()))
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for address, nbytes in ranges:
        if out and out[-1][0] + out[-1][1] == address:
            out[-1] = (out[-1][0], out[-1][1] + nbytes)
        else:
            out.append((address, nbytes))
    return out


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
@pytest.mark.parametrize("ids", [[4], [5, 1, 3], [2, 3, 4], [0, 1, 2, 3, 4, 5], [3, 2]])
def test_ranges_cover_exactly_the_blocks_in_stream_order(layout: KVLayout, ids: list[int]) -> None:
    local = _local(layout)
    heads = slice(1, 3) if layout is KVLayout.HND else slice(0, HEADS)
    span = head_span(local, heads.start, heads.stop)
    assert span is not None
    got = block_ranges(local, np.array(ids, dtype=np.int64), slice(1, 3), span)
    assert got.dtype == np.uint64 and got.shape[1] == 2
    expected = _expected(local, ids, range(1, 3), heads)
    # merging adjacent ranges is allowed (and done for runs of blocks); the bytes are not
    assert _merged([(int(a), int(n)) for a, n in got]) == _merged(expected)
    assert int(got[:, 1].sum()) == sum(n for _, n in expected)


def test_mla_ranges_are_the_latent_rows() -> None:
    local = _local(KVLayout.NHD, mla=True)
    span = head_span(local, 0, 1)
    assert span is not None
    got = block_ranges(local, np.array([5, 0], dtype=np.int64), slice(0, LAYERS), span)
    expected = _expected(local, [5, 0], range(LAYERS), slice(None))
    assert [(int(a), int(n)) for a, n in got] == expected


def test_ranges_follow_a_cache_whose_storage_moved() -> None:
    """share_memory_ moves a tensor's storage in place; cached addresses must not survive it."""
    local = _local(KVLayout.NHD)
    span = head_span(local, 0, HEADS)
    assert span is not None
    ids = np.array([2], dtype=np.int64)
    before = block_ranges(local, ids, slice(0, LAYERS), span).copy()
    local.layers[1].share_memory_()
    after = block_ranges(local, ids, slice(0, LAYERS), span)
    assert [(int(a), int(n)) for a, n in after] == _expected(local, [2], range(LAYERS), slice(None))
    assert (before[2:4] != after[2:4]).any() and (before[:2] == after[:2]).all()
