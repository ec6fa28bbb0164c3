"""Pack and unpack of split K/V caches (SGLang), torch and Triton, against the reference.

A split cache keeps K and V of each layer in two tensors ``[num_blocks,
block_size, num_heads, head_dim]``; the kernels take one entry per plane, each
its single-plane view ``plane[None]`` (NHD), K0, V0, K1, V1, ... Besides the
reference, every landing is checked against the same K and V moved as an
ordinary NHD ``[2, ...]`` cache: a split plane must land exactly as its half of
a K/V pair would, head slices, block size conversion and offsets included.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvbridge.kernels import Impl, KernelInputError, PackedFormat, copy_blocks, pack, unpack
from kvbridge.kernels import packed_format as packed_format_of
from kvbridge.topology import KVLayout
from tests.kernels import reference
from tests.kernels.helpers import DEVICE, IMPLS, shuffled_ids
from tests.kernels.reference import raw

NHD, HND = KVLayout.NHD, KVLayout.HND


@dataclass(frozen=True)
class Split:
    """Shape of one side's split caches: ``2 * num_layers`` planes."""

    num_heads: int
    block_size: int = 16
    head_dim: int = 8
    num_blocks: int = 10
    num_layers: int = 2
    dtype: torch.dtype = torch.bfloat16


def random_pairs(spec: Split, seed: int) -> torch.Tensor:
    """Random K/V bytes as ordinary NHD caches ``[L, 2, N, B, H, D]`` (NaNs and all)."""
    gen = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=spec.dtype).element_size()
    shape = (spec.num_layers, 2, spec.num_blocks, spec.block_size, spec.num_heads)
    data = torch.randint(0, 256, (*shape, spec.head_dim * elem), dtype=torch.uint8,
                         generator=gen)
    return data.view(spec.dtype).to(DEVICE)


def as_planes(pairs: torch.Tensor) -> list[torch.Tensor]:
    """SGLang's layer list over ``pairs``' memory: K0, V0, K1, V1, ... each ``[1, N, B, H, D]``."""
    return [pairs[layer, kv][None] for layer in range(pairs.shape[0]) for kv in (0, 1)]


def zero_pairs(spec: Split) -> torch.Tensor:
    return torch.zeros(spec.num_layers, 2, spec.num_blocks, spec.block_size, spec.num_heads,
                       spec.head_dim, dtype=spec.dtype, device=DEVICE)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", [(0, 4), (2, 4), (1, 2)])
def test_pack_gathers_each_plane_like_its_half_of_a_pair(impl: Impl, heads: tuple[int, int]
                                                          ) -> None:
    spec = Split(num_heads=4, block_size=5, head_dim=3, dtype=torch.float16)
    pairs = random_pairs(spec, seed=1)
    planes, ids = as_planes(pairs), [7, 2, 2, 9]
    buf = pack(planes, ids, *heads, NHD, impl=impl)
    assert torch.equal(buf, reference.pack(planes, ids, *heads, NHD).to(DEVICE))
    # [layer][kv][block] of a pair is [plane = 2 * layer + kv][block]: the same bytes
    assert torch.equal(buf, pack(list(pairs), ids, *heads, NHD, impl=impl))
    fmt = packed_format_of(planes, NHD, *heads)
    assert (fmt.split_kv, fmt.fused_kv, fmt.num_kv, fmt.num_layers) == (True, False, 1, 4)
    assert buf.numel() == fmt.nbytes(len(ids))


# (remote heads, packed slice, local heads, head_offset): a D rank at TP 1 takes the
# second of two P ranks' halves; a D rank at TP 2 takes its half of one P rank's heads.
TP_2_TO_1 = (2, (0, 2), 4, 2)
TP_1_TO_2 = (4, (2, 4), 2, 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", [TP_2_TO_1, TP_1_TO_2], ids=["tp2to1", "tp1to2"])
@pytest.mark.parametrize(("remote_bs", "local_bs"), [(16, 32), (32, 16), (16, 16)])
@pytest.mark.parametrize(
    ("src_token_offset", "token_offset", "tail"),
    [(0, 0, 0), (0, 0, 5), (3, 3, 7)],  # whole; a partial last block; from inside a block
    ids=["whole", "partial-last", "first-token-3"],
)
def test_unpack_lands_planes_as_pairs_would(
    impl: Impl, heads: tuple[int, tuple[int, int], int, int], remote_bs: int, local_bs: int,
    src_token_offset: int, token_offset: int, tail: int,
) -> None:
    remote_heads, (head_start, head_end), local_heads, head_offset = heads
    remote, local = Split(remote_heads, remote_bs), Split(local_heads, local_bs)
    src = random_pairs(remote, seed=2)
    remote_ids = shuffled_ids(3, remote.num_blocks, seed=3, repeats=False)
    num_tokens = 3 * remote_bs - src_token_offset - tail
    local_ids = shuffled_ids(-(-(token_offset + num_tokens) // local_bs), local.num_blocks,
                             seed=4, repeats=False)
    buf = pack(as_planes(src), remote_ids, head_start, head_end, NHD, impl=impl)
    fmt = packed_format_of(as_planes(src), NHD, head_start, head_end)
    got, want, as_pair = zero_pairs(local), zero_pairs(local), zero_pairs(local)
    window = dict(head_offset=head_offset, num_tokens=num_tokens, token_offset=token_offset)
    unpack(buf, fmt, len(remote_ids), as_planes(got), local_ids, NHD, **window,
           src_token_offset=src_token_offset, impl=impl)
    reference.unpack(buf, fmt, len(remote_ids), as_planes(want), local_ids, NHD, **window,
                     src_token_offset=src_token_offset)
    assert torch.equal(raw(got), raw(want))
    # the same K and V moved as an ordinary NHD cache land on the same bytes
    pair_buf = pack(list(src), remote_ids, head_start, head_end, NHD, impl=impl)
    pair_fmt = packed_format_of(list(src), NHD, head_start, head_end)
    unpack(pair_buf, pair_fmt, len(remote_ids), list(as_pair), local_ids, NHD, **window,
           src_token_offset=src_token_offset, impl=impl)
    assert torch.equal(raw(got), raw(as_pair))
    assert raw(got).any()  # something landed (the zeros compared equal otherwise)


@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_planes_and_block_copies(impl: Impl) -> None:
    spec = Split(num_heads=3, block_size=4, head_dim=5, dtype=torch.uint8)
    planes = as_planes(random_pairs(spec, seed=5))
    stacked = torch.stack(planes)  # [2L, 1, N, B, H, D]
    assert torch.equal(pack(stacked, [1, 4], 0, 3, NHD, impl=impl),
                       pack(planes, [1, 4], 0, 3, NHD, impl=impl))
    dst = as_planes(zero_pairs(spec))
    copy_blocks(planes, dst, [2, 7, 3], [0, 9, 5], impl=impl)
    for s, d in zip(planes, dst, strict=True):
        assert torch.equal(raw(d[0][[0, 9, 5]]), raw(s[0][[2, 7, 3]]))
        assert not raw(d[0][[1, 2, 3, 4, 6, 7, 8]]).any()


def refused(impl: Impl, dst: list[torch.Tensor], local_layout: KVLayout,
            fmt: PackedFormat | None = None) -> str:
    """Unpack a 1-block split buffer into ``dst`` so; the error, with nothing written."""
    spec = Split(num_heads=2, block_size=8)
    src = as_planes(random_pairs(spec, seed=6))
    buf = pack(src, [1], 0, 2, NHD, impl=impl)
    with pytest.raises(KernelInputError) as info:
        unpack(buf, fmt or packed_format_of(src, NHD, 0, 2), 1, dst, [0], local_layout,
               impl=impl)
    assert all(not raw(t).any() for t in dst)
    return str(info.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_split_planes_land_only_in_split_caches_and_never_relaid_out(impl: Impl) -> None:
    spec = Split(num_heads=2, block_size=8)
    planes = as_planes(zero_pairs(spec))
    # the same [1, N, B, H, D] planes said to be HND are fused K/V caches: refused
    assert ("packed split K or V planes (NHD) land only in caches of that kind, not in fused "
            "K/V planes (HND) (1, 10, 8, 2, 8)") in refused(impl, planes, HND)
    # ordinary K/V pairs, either layout: refused
    pairs = list(zero_pairs(Split(num_heads=2, block_size=8, num_layers=4)))
    for layout in (NHD, HND):
        assert "packed split K or V planes (NHD) land only in caches of that kind, not in " \
               "K/V pairs" in refused(impl, pairs, layout)
    # and a buffer of K/V pairs (same row and layer count) into split planes
    pair_fmt = PackedFormat(NHD, 8, 2, 8, 2, 4)
    assert "packed K/V pairs land only in caches of that kind, not in split K or V planes" \
        in refused(impl, planes, NHD, pair_fmt)


def test_a_split_packed_format_is_nhd_and_nothing_else() -> None:
    for kwargs in (dict(layout=HND), dict(layout=NHD, is_mla=True, num_heads=1),
                   dict(layout=HND, fused_kv=True)):
        fields = dict(block_size=8, num_heads=2, head_dim=8, elem_nbytes=2, num_layers=4,
                      split_kv=True) | kwargs
        with pytest.raises(KernelInputError, match="split K/V packed format is NHD, not MLA"):
            PackedFormat(**fields)
    fmt = PackedFormat(NHD, 8, 2, 8, 2, 4, split_kv=True)
    assert (fmt.num_kv, fmt.block_nbytes) == (1, 4 * 8 * 2 * 8 * 2)
