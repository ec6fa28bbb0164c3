"""describe_cache: K/V-first vs blocks-first, cross-layer stacks, physical block-size
position and layout, from shapes and strides built for a known memory order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ConfigError
from kvbridge.topology import KVLayout, describe_cache

N, B, H, D, L = 5, 16, 4, 8, 3  # blocks, block size, heads, head dim, layers


def strides_for(shape: Sequence[int], order: Sequence[int], pad: int = 0) -> tuple[int, ...]:
    """Strides placing logical dims in memory ``order`` (outermost first).

    ``pad`` extra elements follow every run of the outermost dim's inner part.
    """
    strides = [0] * len(shape)
    step = 1
    for position, dim in enumerate(reversed(order)):
        if position == len(order) - 1:
            step += pad
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def test_kv_first_nhd_contiguous() -> None:
    shape = (2, N, B, H, D)
    facts = describe_cache(shape, strides_for(shape, range(5)), KVLayout.NHD, False)
    assert (facts.kv_dim, facts.blocks_dim, facts.block_size_dim, facts.heads_dim) == (0, 1, 2, 3)
    assert not facts.blocks_first and not facts.cross_layers and facts.split_k_and_v
    assert facts.physical_layout is KVLayout.NHD and facts.block_size_position == 2
    assert facts.block_stride == B * H * D
    assert facts.is_dense and facts.plane_block_contiguous


def test_blocks_first_hnd_contiguous() -> None:
    shape = (N, 2, H, B, D)
    facts = describe_cache(shape, strides_for(shape, range(5)), KVLayout.HND, False)
    assert (facts.blocks_dim, facts.kv_dim, facts.heads_dim, facts.block_size_dim) == (0, 1, 2, 3)
    assert facts.blocks_first and not facts.split_k_and_v
    assert facts.physical_layout is KVLayout.HND and facts.block_size_position == 3
    assert facts.block_stride == 2 * H * B * D


def test_logical_nhd_stored_as_hnd() -> None:
    shape = (2, N, B, H, D)
    order = (0, 1, 3, 2, 4)  # heads outside tokens in memory
    facts = describe_cache(shape, strides_for(shape, order), KVLayout.NHD, False, block_size=B)
    assert facts.physical_order == order
    assert facts.physical_layout is KVLayout.HND
    assert facts.block_size_dim == 2 and facts.block_size_position == 3
    assert facts.plane_block_contiguous


def test_kv_first_shape_stored_blocks_first() -> None:
    shape = (2, N, H, B, D)
    facts = describe_cache(shape, strides_for(shape, (1, 0, 2, 3, 4)), KVLayout.HND, False)
    assert facts.kv_dim == 0 and facts.blocks_first and not facts.split_k_and_v


def test_cross_layer_blocks_outermost() -> None:
    shape = (L, 2, N, B, H, D)
    order = (2, 0, 1, 3, 4, 5)  # one block holds every layer's K and V
    facts = describe_cache(shape, strides_for(shape, order), KVLayout.NHD, False, num_layers=L)
    assert facts.cross_layers and facts.layers_dim == 0
    assert (facts.kv_dim, facts.blocks_dim, facts.block_size_dim) == (1, 2, 3)
    assert facts.blocks_first and not facts.split_k_and_v
    assert facts.block_size_position == 3
    assert facts.block_stride == L * 2 * B * H * D


@pytest.mark.parametrize("cross", [False, True])
def test_mla(cross: bool) -> None:
    shape = ((L,) if cross else ()) + (N, B, D)
    facts = describe_cache(shape, strides_for(shape, range(len(shape))), KVLayout.NHD, True)
    first = 1 if cross else 0
    assert facts.kv_dim is None and facts.heads_dim is None
    assert (facts.blocks_dim, facts.block_size_dim, facts.feature_dim) == (
        first,
        first + 1,
        first + 2,
    )
    assert facts.blocks_first and not facts.split_k_and_v
    assert facts.cross_layers is cross


def test_padded_blocks() -> None:
    shape = (N, 2, H, B, D)
    facts = describe_cache(shape, strides_for(shape, range(5), pad=64), KVLayout.HND, False)
    assert not facts.is_dense and facts.plane_block_contiguous
    assert facts.block_stride == 2 * H * B * D + 64


def test_strided_plane_block_is_not_contiguous() -> None:
    shape = (2, N, B, H, D)
    strides = strides_for(shape, range(5))
    strides = strides[:3] + (2 * D,) + strides[4:]  # gap between heads
    facts = describe_cache(shape, strides, KVLayout.NHD, False)
    assert not facts.plane_block_contiguous and not facts.is_dense


@pytest.mark.parametrize(
    ("shape", "kwargs", "match"),
    [
        ((2, N, B, H), {}, "needs 5 or 6 dims"),
        ((N, B, D, 1, 1), {"is_mla": True}, "needs 3 or 4 dims"),
        ((2, 2, B, H, D), {}, "cannot tell"),
        ((2, 2, B, H, D), {"num_blocks": 2}, "cannot tell"),
        ((3, N, B, H, D), {}, "do not fit either order"),
        ((2, N, B, H, D), {"block_size": 32}, "not 32"),
        ((2, N, B, H, D), {"num_blocks": 7}, "do not fit"),
        ((4, 2, N, B, H, D), {"num_layers": L}, "not num_layers"),
    ],
)
def test_bad_shapes_raise(shape: tuple[int, ...], kwargs: dict[str, Any], match: str) -> None:
    options = dict(kwargs)  # parametrize values are shared: do not mutate them
    is_mla = bool(options.pop("is_mla", False))
    with pytest.raises(ConfigError, match=match):
        strides = strides_for(shape, range(len(shape)))
        describe_cache(shape, strides, KVLayout.NHD, is_mla, **options)


@pytest.mark.parametrize("kv_first", [True, False])
def test_kv_first_hint_settles_two_blocks(kv_first: bool) -> None:
    shape = (2, 2, B, H, D)
    facts = describe_cache(
        shape, strides_for(shape, range(5)), KVLayout.NHD, False, kv_first=kv_first
    )
    assert facts.kv_dim == (0 if kv_first else 1)
    assert facts.blocks_first is not kv_first


def test_kv_first_hint_must_fit() -> None:
    shape = (N, 2, B, H, D)
    with pytest.raises(ConfigError, match="do not fit K/V-first"):
        describe_cache(shape, strides_for(shape, range(5)), KVLayout.NHD, False, kv_first=True)
    facts = describe_cache(shape, strides_for(shape, range(5)), KVLayout.NHD, False, kv_first=False)
    assert facts.blocks_dim == 0


def test_bad_strides_raise() -> None:
    shape = (2, N, B, H, D)
    with pytest.raises(ConfigError, match="4 strides"):
        describe_cache(shape, (1, 2, 3, 4), KVLayout.NHD, False)
    with pytest.raises(ConfigError, match="bad shape"):
        describe_cache(shape, (1, 2, 3, 4, -1), KVLayout.NHD, False)


@settings(max_examples=200, deadline=None)
@given(
    st.booleans(),
    st.booleans(),
    st.sampled_from(KVLayout),
    st.permutations(range(6)),
    st.integers(3, 9),
)
def test_random_memory_orders(
    cross: bool, kv_first: bool, layout: KVLayout, perm: list[int], num_blocks: int
) -> None:
    outer = (2, num_blocks) if kv_first else (num_blocks, 2)
    inner = (B, H, D) if layout is KVLayout.NHD else (H, B, D)
    shape = ((L,) if cross else ()) + outer + inner
    order = [dim for dim in perm if dim < len(shape)]
    facts = describe_cache(shape, strides_for(shape, order), layout, False, block_size=B)
    first = 1 if cross else 0
    kv_dim = first if kv_first else first + 1
    blocks_dim = first + 1 if kv_first else first
    token_dim = first + (2 if layout is KVLayout.NHD else 3)
    heads_dim = first + (3 if layout is KVLayout.NHD else 2)
    assert facts.physical_order == tuple(order)
    assert facts.block_size_position == order.index(token_dim)
    assert facts.blocks_first == (order.index(blocks_dim) < order.index(kv_dim))
    assert (facts.physical_layout is KVLayout.NHD) == (
        order.index(token_dim) < order.index(heads_dim)
    )
    assert facts.block_stride == strides_for(shape, order)[blocks_dim]
    in_block = {token_dim, heads_dim, len(shape) - 1}
    assert facts.plane_block_contiguous == (set(order[-3:]) == in_block)
    assert facts.is_dense
