"""pack -> unpack -> pack -> unpack over every layout and block-size pair restores the source."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvbridge.kernels import Impl, pack, packed_format, unpack
from kvbridge.topology import KVLayout
from tests.kernels.helpers import CacheSpec, random_caches
from tests.kernels.reference import as_layers, raw

LAYOUTS = [KVLayout.NHD, KVLayout.HND]
SIZES = [4, 8, 16]


def tokens(
    caches: list[torch.Tensor] | torch.Tensor, spec: CacheSpec, ids: list[int], heads: slice
) -> torch.Tensor:
    """``[L, 2, num_tokens, heads, dim]`` raw view of the tokens held by ``ids``, in order."""
    per_layer = []
    for layer in as_layers(caches):
        blocks = raw(layer)[:, ids]
        if spec.layout == KVLayout.HND:
            blocks = blocks.transpose(2, 3)
        per_layer.append(blocks[:, :, :, heads].flatten(1, 2))
    return torch.stack(per_layer)


# torch covers every pair; the interpreter one pair per block-size ratio
CASES = [
    (impl, p, d, pb, db)
    for p, d in itertools.product(LAYOUTS, LAYOUTS)
    for pb, db in itertools.product(SIZES, SIZES)
    for impl in ("torch", "triton")
    if impl == "torch" or (pb, db) in ((4, 16), (16, 4), (8, 8))
]


@pytest.mark.parametrize(("impl", "p_layout", "d_layout", "p_bs", "d_bs"), CASES)
def test_round_trip(
    impl: Impl, p_layout: KVLayout, d_layout: KVLayout, p_bs: int, d_bs: int
) -> None:
    num_tokens = 48
    p_spec = CacheSpec(p_layout, p_bs, num_heads=2, head_dim=8, num_blocks=16)
    d_spec = CacheSpec(d_layout, d_bs, num_heads=6, head_dim=8, num_blocks=16)
    source = random_caches(p_spec, 11)
    p_ids = list(range(num_tokens // p_bs))[::-1]
    d_ids = [5, 2, 9, 0, 14, 7, 3, 11, 1, 12, 6, 15][: num_tokens // d_bs]

    # P -> D: P's 2 heads become D's heads [3, 5)
    buf = pack(source, p_ids, 0, 2, p_layout, impl=impl)
    decode = random_caches(d_spec, 12)
    unpack(
        buf, packed_format(source, p_layout, 0, 2), len(p_ids), decode, d_ids, d_layout, 3,
        impl=impl,
    )
    assert torch.equal(
        tokens(decode, d_spec, d_ids, slice(3, 5)), tokens(source, p_spec, p_ids, slice(0, 2))
    )

    # D -> P': back through the opposite conversion
    back = pack(decode, d_ids, 3, 5, d_layout, impl=impl)
    restored = random_caches(p_spec, 13)
    fmt = packed_format(decode, d_layout, 3, 5)
    unpack(back, fmt, len(d_ids), restored, p_ids, p_layout, 0, impl=impl)
    for got, want in zip(as_layers(restored), as_layers(source), strict=True):
        assert torch.equal(raw(got)[:, p_ids], raw(want)[:, p_ids])
