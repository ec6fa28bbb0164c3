"""copy_blocks against the reference, both implementations."""

from __future__ import annotations

import pytest
import torch

from kvbridge.kernels import Impl, copy_blocks
from kvbridge.topology import KVLayout
from tests.kernels import reference
from tests.kernels.helpers import IMPLS, CacheSpec, clone, random_caches, same_bytes


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "spec",
    [
        CacheSpec(KVLayout.NHD, 4, num_heads=2),
        CacheSpec(KVLayout.HND, 8, num_heads=3, head_dim=80, dtype=torch.bfloat16),
        CacheSpec(KVLayout.NHD, 4, num_heads=1, head_dim=24, mla=True, dtype=torch.uint8),
        CacheSpec(KVLayout.HND, 4, num_heads=2, stacked=True, dtype=torch.float8_e4m3fn),
    ],
    ids=["nhd", "hnd-80", "mla", "stacked"],
)
@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [([3, 4, 5, 9], None), ([7, 1, 7, 20], [0, 1, 2, 3]), ([2, 3], [10, 11])],
    ids=["same-ids", "scattered-repeats", "run"],
)
def test_copy_blocks(
    impl: Impl, spec: CacheSpec, src_ids: list[int], dst_ids: list[int] | None
) -> None:
    src = random_caches(spec, 1)
    dst = random_caches(spec, 2)
    expected = clone(dst)
    copy_blocks(src, dst, src_ids, dst_ids, impl=impl)
    reference.copy_blocks(src, expected, src_ids, src_ids if dst_ids is None else dst_ids)
    assert same_bytes(dst, expected)


def test_many_scattered_blocks_take_the_gather_path() -> None:
    # more runs than the per-run copy loop allows: gather + scatter
    spec = CacheSpec(KVLayout.HND, 2, num_heads=1, head_dim=4, num_blocks=400, num_layers=2)
    src = random_caches(spec, 5)
    dst = random_caches(spec, 6)
    ids = torch.randperm(400, generator=torch.Generator().manual_seed(0))[:300]
    dst_ids = torch.randperm(400, generator=torch.Generator().manual_seed(1))[:300]
    expected = clone(dst)
    copy_blocks(src, dst, ids, dst_ids, impl="torch")
    reference.copy_blocks(src, expected, ids.tolist(), dst_ids.tolist())
    assert same_bytes(dst, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_between_differently_strided_caches(impl: Impl) -> None:
    """The host mirror may be contiguous while the device cache is a strided view."""
    spec = CacheSpec(KVLayout.NHD, 4, num_heads=2, num_blocks=8)
    wide = torch.randint(0, 100, (2, 2, 16, 4, 2, 16)).to(torch.float16)
    src = list(wide[:, :, ::2].unbind(0))  # every other block of a larger cache
    dst = random_caches(spec, 9)
    expected = clone(dst)
    copy_blocks(src, dst, [6, 1], [0, 7], impl=impl)
    reference.copy_blocks(src, expected, [6, 1], [0, 7])
    assert same_bytes(dst, expected)
