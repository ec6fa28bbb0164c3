"""Pack, unpack and copy_blocks of fused K/V caches (vLLM CPU), torch and Triton.

A fused cache is ``[num_blocks, num_heads, block_size, 2 * head_size]`` per layer,
each head of a block holding K transposed then V; the kernels take its
single-plane view ``cache[None]``. The reference here is built from real K and V
tensors, so "exact" also means K and V come back as K and V, not just as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvbridge.kernels import Impl, KernelInputError, PackedFormat, copy_blocks, pack, unpack
from kvbridge.kernels import packed_format as packed_format_of
from kvbridge.topology import KVLayout
from tests.kernels.helpers import DEVICE, IMPLS
from tests.kernels.reference import raw


@dataclass(frozen=True)
class Fused:
    """Shape of one side's fused caches."""

    num_heads: int
    block_size: int = 8
    head_size: int = 4
    num_blocks: int = 12
    num_layers: int = 2
    dtype: torch.dtype = torch.bfloat16


def fuse(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """vLLM CPU block memory from token-major K and V ``[N, H, B, D]``: ``[N, H, B, 2D]``."""
    n, h, b, d = k.shape
    k_t = k.transpose(2, 3).reshape(n, h, d * b)  # K^T: [D, B] per head
    return torch.cat([k_t, v.reshape(n, h, b * d)], dim=2).view(n, h, b, 2 * d)


def unfuse(cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major ``(K, V)`` ``[N, H, B, D]`` back out of fused block memory."""
    n, h, b, _ = cache.shape
    flat = cache.reshape(n, h, -1)
    k = flat[..., : head_size * b].reshape(n, h, head_size, b).transpose(2, 3)
    return k, flat[..., head_size * b :].reshape(n, h, b, head_size)


def random_fused(spec: Fused, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-layer single-plane views over one storage, and the K and V they hold."""
    gen = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, spec.num_blocks, spec.num_heads, spec.block_size, spec.head_size)
    elem = torch.empty((), dtype=spec.dtype).element_size()
    # random bytes: NaN and subnormal patterns too, which must survive bit for bit
    k, v = (torch.randint(0, 256, (*shape[:-1], shape[-1] * elem), dtype=torch.uint8,
                          generator=gen).view(spec.dtype) for _ in range(2))
    store = torch.stack([fuse(k[layer], v[layer]) for layer in range(spec.num_layers)])
    store, k, v = store.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    return [layer[None] for layer in store.unbind(0)], k, v


def zero_fused(spec: Fused) -> list[torch.Tensor]:
    store = torch.zeros(spec.num_layers, 1, spec.num_blocks, spec.num_heads, spec.block_size,
                        2 * spec.head_size, dtype=spec.dtype, device=DEVICE)
    return list(store.unbind(0))


SHAPES = [
    Fused(num_heads=4),
    Fused(num_heads=3, block_size=5, head_size=3, dtype=torch.float16),  # odd everything
    Fused(num_heads=2, block_size=32, head_size=16, num_layers=3),  # vLLM-like
    Fused(num_heads=1, block_size=4, head_size=5, dtype=torch.uint8),
    Fused(num_heads=2, block_size=3, head_size=2, dtype=torch.float32),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("spec", SHAPES, ids=str)
def test_pack_gathers_whole_head_runs(impl: Impl, spec: Fused) -> None:
    caches, _, _ = random_fused(spec, seed=1)
    ids, heads = [7, 2, 2, 11], (spec.num_heads // 2, spec.num_heads)
    buf = pack(caches, ids, *heads, KVLayout.HND, impl=impl)
    want = torch.cat([raw(layer[0, block, heads[0] : heads[1]]).reshape(-1).view(torch.uint8)
                      for layer in caches for block in ids])
    assert torch.equal(buf, want)
    fmt = packed_format_of(caches, KVLayout.HND, *heads)
    assert (fmt.fused_kv, fmt.num_kv, fmt.head_dim) == (True, 1, 2 * spec.head_size)
    assert buf.numel() == fmt.nbytes(len(ids))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("spec", SHAPES, ids=str)
def test_unpack_lands_k_and_v_exactly_at_the_head_offset(impl: Impl, spec: Fused) -> None:
    src, k, v = random_fused(spec, seed=2)
    local_spec = Fused(spec.num_heads * 2, spec.block_size, spec.head_size, 10,
                       spec.num_layers, spec.dtype)
    dst = zero_fused(local_spec)
    remote_ids, local_ids = [3, 9, 0], [4, 1, 8]
    buf = pack(src, remote_ids, 0, spec.num_heads, KVLayout.HND, impl=impl)
    fmt = packed_format_of(src, KVLayout.HND, 0, spec.num_heads)
    offset = spec.num_heads  # a P rank's heads into the second half of D's
    unpack(buf, fmt, len(remote_ids), dst, local_ids, KVLayout.HND, head_offset=offset,
           impl=impl)
    heads = slice(offset, offset + spec.num_heads)
    for layer in range(spec.num_layers):
        got_k, got_v = unfuse(dst[layer][0], spec.head_size)
        assert torch.equal(raw(got_k[local_ids, heads]), raw(k[layer, remote_ids]))
        assert torch.equal(raw(got_v[local_ids, heads]), raw(v[layer, remote_ids]))
        assert torch.equal(raw(dst[layer][0][local_ids, heads]), raw(src[layer][0][remote_ids]))
        untouched = [b for b in range(local_spec.num_blocks) if b not in local_ids]
        assert not raw(dst[layer][0][untouched]).any()
        assert not raw(dst[layer][0][local_ids, :offset]).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_unpack_skips_whole_blocks_on_both_sides(impl: Impl) -> None:
    spec = Fused(num_heads=2)
    src, _, _ = random_fused(spec, seed=3)
    dst = zero_fused(spec)
    buf = pack(src, [5, 6, 7], 0, 2, KVLayout.HND, impl=impl)
    fmt = packed_format_of(src, KVLayout.HND, 0, 2)
    bs = spec.block_size
    # buffer blocks 1 and 2 only, into local positions from block 1 on (block 0: a local hit)
    unpack(buf, fmt, 3, dst, [0, 9, 4], KVLayout.HND, num_tokens=2 * bs, token_offset=bs,
           src_token_offset=bs, impl=impl)
    for layer in range(spec.num_layers):
        assert torch.equal(raw(dst[layer][0][[9, 4]]), raw(src[layer][0][[6, 7]]))
        assert not raw(dst[layer][0][0]).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_fused_caches_pack_like_a_list(impl: Impl) -> None:
    spec = Fused(num_heads=2, num_layers=3)
    caches, _, _ = random_fused(spec, seed=4)
    stacked = torch.stack(caches)  # [L, 1, N, H, B, 2D]
    assert torch.equal(pack(stacked, [1, 4], 0, 2, KVLayout.HND, impl=impl),
                       pack(caches, [1, 4], 0, 2, KVLayout.HND, impl=impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_blocks_moves_fused_blocks(impl: Impl) -> None:
    spec = Fused(num_heads=3, block_size=5, head_size=3)
    src, _, _ = random_fused(spec, seed=5)
    dst = zero_fused(spec)
    copy_blocks(src, dst, [2, 7, 3], [0, 11, 5], impl=impl)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(raw(d[0][[0, 11, 5]]), raw(s[0][[2, 7, 3]]))
        assert not raw(d[0][[1, 2, 3, 4, 6, 7, 8, 9, 10]]).any()


def refused(
    impl: Impl, *, local_bs: int = 8, fmt: PackedFormat | None = None,
    local_layout: KVLayout = KVLayout.HND, num_tokens: int | None = None, token_offset: int = 0,
    src_token_offset: int = 0,
) -> str:
    """Unpack a 2-block fused buffer so; the error it raised, with nothing written."""
    spec = Fused(num_heads=2)
    src, _, _ = random_fused(spec, seed=6)
    dst = zero_fused(Fused(num_heads=2, block_size=local_bs))
    buf = pack(src, [1, 2], 0, 2, KVLayout.HND, impl=impl)
    with pytest.raises(KernelInputError) as info:
        unpack(buf, fmt or packed_format_of(src, KVLayout.HND, 0, 2), 2, dst, [0, 3, 5, 6],
               local_layout, num_tokens=num_tokens, token_offset=token_offset,
               src_token_offset=src_token_offset, impl=impl)
    assert all(not raw(t).any() for t in dst)
    return str(info.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_conversions_and_partial_blocks_are_refused(impl: Impl) -> None:
    assert "not re-blocked: remote block size 8, local 4" in refused(impl, local_bs=4)
    assert "not re-blocked: remote block size 8, local 16" in refused(impl, local_bs=16)
    assert "whole blocks of 8 tokens: num_tokens 13" in refused(impl, num_tokens=13)
    assert "token_offset 3" in refused(impl, token_offset=3)
    assert "src_token_offset 4" in refused(impl, src_token_offset=4, num_tokens=8)
    # a [1, ...] cache given as NHD is a split K or V plane, another kind of cache
    assert ("packed fused K/V planes (HND) land only in caches of that kind, not in split K "
            "or V planes (NHD) (1, 12, 2, 8, 8)") in refused(impl, local_layout=KVLayout.NHD)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_and_plain_buffers_never_mix(impl: Impl) -> None:
    plain_fmt = PackedFormat(KVLayout.HND, 8, 2, 8, 2, 2)  # same row length, two planes
    assert "fused_kv remote False local True" in refused(impl, fmt=plain_fmt)
    spec = Fused(num_heads=2)
    src, _, _ = random_fused(spec, seed=7)
    buf = pack(src, [1], 0, 2, KVLayout.HND, impl=impl)
    plain = [torch.zeros(2, 4, 2, 8, 4, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    with pytest.raises(KernelInputError, match="fused_kv remote True local False"):
        unpack(buf, packed_format_of(src, KVLayout.HND, 0, 2), 1, plain, [0], KVLayout.HND,
               impl=impl)


def test_a_fused_packed_format_is_hnd_and_not_mla() -> None:
    with pytest.raises(KernelInputError, match="fused K/V packed format is HND and not MLA"):
        PackedFormat(KVLayout.NHD, 8, 2, 8, 2, 2, fused_kv=True)
    with pytest.raises(KernelInputError, match="fused K/V packed format is HND and not MLA"):
        PackedFormat(KVLayout.HND, 8, 1, 8, 2, 2, is_mla=True, fused_kv=True)
    fmt = PackedFormat(KVLayout.HND, 8, 2, 8, 2, 3, fused_kv=True)
    assert (fmt.num_kv, fmt.block_nbytes) == (1, 3 * 8 * 2 * 8 * 2)


def test_a_four_dim_cache_in_a_list_says_how_to_pass_it() -> None:
    caches = [torch.zeros(4, 2, 8, 8, dtype=torch.bfloat16)] * 2
    with pytest.raises(KernelInputError, match=r"fused K/V cache: pass cache\[None\]"):
        pack(caches, [0], 0, 2, KVLayout.HND)
