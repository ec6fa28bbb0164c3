"""copy_blocks against the reference, both implementations."""

from __future__ import annotations

import pytest
import torch

from kvbridge.kernels import Impl, copy_blocks
from kvbridge.topology import KVLayout
from tests.kernels import reference
from tests.kernels.helpers import DEVICE, IMPLS, CacheSpec, clone, random_caches, same_bytes


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
    wide = torch.randint(0, 100, (2, 2, 16, 4, 2, 16)).to(DEVICE, torch.float16)
    src = list(wide[:, :, ::2].unbind(0))  # every other block of a larger cache
    dst = random_caches(spec, 9)
    expected = clone(dst)
    copy_blocks(src, dst, [6, 1], [0, 7], impl=impl)
    reference.copy_blocks(src, expected, [6, 1], [0, 7])
    assert same_bytes(dst, expected)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host staging of CUDA caches: GPU runs only")
@pytest.mark.parametrize("stacked", [False, True])
def test_cuda_cache_through_a_pinned_host_mirror(stacked: bool) -> None:
    """The connector's host-buffer path: device -> pinned mirror -> another device cache."""
    spec = CacheSpec(KVLayout.HND, 16, num_heads=4, head_dim=64, num_blocks=32, num_layers=3,
                     dtype=torch.bfloat16, stacked=stacked)
    device_cache = random_caches(spec, 21)
    layers = [device_cache] if stacked else device_cache
    mirror = [torch.zeros(t.shape, dtype=t.dtype, pin_memory=True) for t in layers]
    mirror_caches = mirror[0] if stacked else mirror
    copy_blocks(device_cache, mirror_caches, [9, 2, 30])  # "auto": Triton over UVA
    expected = clone(device_cache)
    for got, want in zip(reference.as_layers(mirror_caches),
                         reference.as_layers(expected), strict=True):
        assert torch.equal(reference.raw(got)[:, [9, 2, 30]],
                           reference.raw(want)[:, [9, 2, 30]].cpu())
    back = random_caches(spec, 22)
    before = clone(back)
    copy_blocks(mirror_caches, back, [9, 2, 30], [0, 31, 5])
    reference.copy_blocks(device_cache, before, [9, 2, 30], [0, 31, 5])
    assert same_bytes(back, before)
