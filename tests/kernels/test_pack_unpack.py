"""pack and unpack against the plain reference, byte for byte, both implementations."""

from __future__ import annotations

import pytest
import torch

from kvbridge.kernels import Impl, pack, packed_format, torch_cpu, unpack
from kvbridge.topology import KVLayout
from tests.kernels import reference
from tests.kernels.checks import check_transfer
from tests.kernels.helpers import DEVICE, IMPLS, CacheSpec, clone, random_caches, same_bytes

NHD, HND = KVLayout.NHD, KVLayout.HND
BLOCK_SIZES = [(4, 4), (4, 8), (4, 16), (8, 4), (16, 4)]  # (remote, local): ratios 1, 2, 4


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("remote_bs", "local_bs"), BLOCK_SIZES)
@pytest.mark.parametrize("remote_layout", [NHD, HND])
@pytest.mark.parametrize("local_layout", [NHD, HND])
def test_layouts_and_block_sizes(
    impl: Impl, remote_layout: KVLayout, local_layout: KVLayout, remote_bs: int, local_bs: int
) -> None:
    # 4 remote heads, slice [1, 3) lands at heads [2, 4) of 5 local; last block partial
    check_transfer(
        impl,
        CacheSpec(remote_layout, remote_bs, num_heads=4),
        CacheSpec(local_layout, local_bs, num_heads=5),
        head_start=1, head_end=3, head_offset=2,
        num_remote_blocks=max(2, 24 // remote_bs), drop_tokens=remote_bs // 2 + 1,
    )  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float8_e4m3fn]
)
@pytest.mark.parametrize(("remote_layout", "remote_bs", "local_bs"), [(HND, 8, 16), (NHD, 16, 4)])
def test_dtypes(
    impl: Impl, dtype: torch.dtype, remote_layout: KVLayout, remote_bs: int, local_bs: int
) -> None:
    local_layout = NHD if remote_layout == HND else HND
    check_transfer(
        impl,
        CacheSpec(remote_layout, remote_bs, num_heads=2, dtype=dtype),
        CacheSpec(local_layout, local_bs, num_heads=4, dtype=dtype),
        head_offset=2, drop_tokens=3,
    )  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [(80, torch.float16), (96, torch.bfloat16), (80, torch.float32), (3, torch.uint8),
     (5, torch.float16), (12, torch.float8_e4m3fn)],
)  # fmt: skip
def test_odd_head_dims(impl: Impl, head_dim: int, dtype: torch.dtype) -> None:
    check_transfer(
        impl,
        CacheSpec(HND, 4, num_heads=3, head_dim=head_dim, dtype=dtype),
        CacheSpec(NHD, 8, num_heads=3, head_dim=head_dim, dtype=dtype),
        head_start=1, drop_tokens=1,
    )  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("remote_bs", "local_bs"), [(8, 8), (4, 16), (16, 4)])
def test_mla(impl: Impl, remote_bs: int, local_bs: int) -> None:
    check_transfer(
        impl,
        CacheSpec(NHD, remote_bs, num_heads=1, head_dim=72, mla=True, num_layers=3),
        CacheSpec(HND, local_bs, num_heads=1, head_dim=72, mla=True, num_layers=3),
        head_end=1, num_remote_blocks=max(2, 32 // remote_bs), drop_tokens=2,
    )  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mla", [False, True])
def test_stacked_cross_layer(impl: Impl, mla: bool) -> None:
    heads = 1 if mla else 4
    check_transfer(
        impl,
        CacheSpec(HND, 4, num_heads=heads, mla=mla, stacked=True, num_layers=3),
        CacheSpec(NHD, 8, num_heads=heads, mla=mla, stacked=True, num_layers=3),
        num_remote_blocks=4,
    )  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("remote_bs", "local_bs", "token_offset"), [(4, 8, 3), (8, 4, 5), (4, 4, 9)]
)
def test_token_offset(impl: Impl, remote_bs: int, local_bs: int, token_offset: int) -> None:
    # a chunk that starts mid local block, the way the transfer agent sends pieces
    check_transfer(
        impl,
        CacheSpec(NHD, remote_bs, num_heads=2),
        CacheSpec(HND, local_bs, num_heads=2),
        num_remote_blocks=3, drop_tokens=1, token_offset=token_offset,
    )  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
def test_physically_blocks_first_stacked_cache(impl: Impl) -> None:
    """A stacked cache stored blocks-first ([nb, L, 2, ...] permuted): strided layers work."""
    num_layers, num_blocks, block_size, heads, dim = 2, 6, 4, 2, 8
    storage = torch.randint(-100, 100, (num_blocks, num_layers, 2, block_size, heads, dim),
                            device=DEVICE)
    caches = storage.to(torch.float16).permute(1, 2, 0, 3, 4, 5)  # [L, 2, nb, bs, H, D]
    buf = pack(caches, [4, 1], 0, heads, NHD, impl=impl)
    assert torch.equal(buf, reference.pack(caches, [4, 1], 0, heads, NHD))
    fmt = packed_format(caches, NHD, 0, heads)
    dst = torch.zeros_like(caches)
    expected = dst.clone()
    unpack(buf, fmt, 2, dst, [2, 5], NHD, impl=impl)
    reference.unpack(buf, fmt, 2, expected, [2, 5], NHD)
    assert same_bytes(dst, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_buffer_is_reused(impl: Impl) -> None:
    spec = CacheSpec(NHD, 4, num_heads=2)
    caches = random_caches(spec, 3)
    staging = torch.full((10_000,), 7, dtype=torch.uint8, device=DEVICE)
    buf = pack(caches, [3, 0], 0, 2, NHD, out=staging, impl=impl)
    assert buf.data_ptr() == staging.data_ptr()
    assert torch.equal(buf, reference.pack(caches, [3, 0], 0, 2, NHD))
    assert bool((staging[buf.numel() :] == 7).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_transfers_write_nothing(impl: Impl) -> None:
    spec = CacheSpec(HND, 4, num_heads=2)
    caches = random_caches(spec, 4)
    before = clone(caches)
    assert pack(caches, [], 0, 2, HND, impl=impl).numel() == 0
    fmt = packed_format(caches, HND, 0, 2)
    buf = pack(caches, [1], 0, 2, HND, impl=impl)
    unpack(buf, fmt, 1, caches, [5], HND, num_tokens=0, impl=impl)
    assert same_bytes(caches, before)


def test_torch_path_scatters_layers_in_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large unpacks scatter layers on a thread pool; the bytes must not change."""
    monkeypatch.setattr(torch_cpu, "_PARALLEL_MIN_NBYTES", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_transfer(
            "torch",
            CacheSpec(HND, 4, num_heads=2, num_layers=5),
            CacheSpec(NHD, 8, num_heads=3, num_layers=5),
            head_offset=1, num_remote_blocks=6, drop_tokens=2,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
