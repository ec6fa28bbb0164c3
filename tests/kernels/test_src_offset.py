"""unpack with ``src_token_offset``: a read that starts inside the sender's first block.

The connector loads a request from the token after the receiver's local prefix
hit; when that token is not on a sender block boundary, the first received
block is only partly written. Both implementations against the reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.kernels import Impl, KernelInputError, pack, packed_format, unpack
from kvbridge.topology import KVLayout
from tests.kernels import reference
from tests.kernels.helpers import IMPLS, CacheSpec, clone, random_caches, same_bytes, shuffled_ids

NHD, HND = KVLayout.NHD, KVLayout.HND


def check(
    impl: Impl, remote: CacheSpec, local: CacheSpec, num_remote_blocks: int,
    src_token_offset: int, num_tokens: int, token_offset: int, seed: int = 0,
) -> None:
    src = random_caches(remote, seed)
    ids = shuffled_ids(num_remote_blocks, remote.num_blocks, seed, repeats=False)
    buf = pack(src, ids, 0, remote.num_heads, remote.layout, impl=impl)
    fmt = packed_format(src, remote.layout, 0, remote.num_heads)
    num_local = -(-(token_offset + num_tokens) // local.block_size)
    local_ids = shuffled_ids(num_local, local.num_blocks, seed + 1, repeats=False)
    dst = random_caches(local, seed + 2)
    expected = clone(dst)
    unpack(buf, fmt, num_remote_blocks, dst, local_ids, local.layout, 0, num_tokens,
           token_offset, src_token_offset=src_token_offset, impl=impl)
    reference.unpack(buf, fmt, num_remote_blocks, expected, local_ids, local.layout, 0,
                     num_tokens, token_offset, src_token_offset)
    assert same_bytes(dst, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("remote_bs", "local_bs"), [(8, 4), (16, 4), (8, 8), (4, 8)])
@pytest.mark.parametrize(("remote_layout", "local_layout"), [(NHD, HND), (HND, HND)])
@pytest.mark.parametrize(
    ("src_token_offset", "tail"),
    [(4, 0), (1, 5), (12, 3)],  # tail: tokens dropped from the last block
)
def test_skip_the_start_of_the_first_remote_block(
    impl: Impl, remote_bs: int, local_bs: int, remote_layout: KVLayout,
    local_layout: KVLayout, src_token_offset: int, tail: int,
) -> None:
    num_remote_blocks = 4
    num_tokens = num_remote_blocks * remote_bs - src_token_offset - tail
    if num_tokens <= 0:
        pytest.skip("nothing to write")
    # the receiver's blocks start at a block boundary, as after a local prefix hit
    check(impl, CacheSpec(remote_layout, remote_bs, num_heads=3),
          CacheSpec(local_layout, local_bs, num_heads=3), num_remote_blocks,
          src_token_offset, num_tokens, token_offset=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_skip_within_a_single_block(impl: Impl) -> None:
    # first and last written token in the same remote block
    check(impl, CacheSpec(NHD, 16, num_heads=2), CacheSpec(HND, 4, num_heads=2), 1,
          src_token_offset=5, num_tokens=6, token_offset=2)


@settings(max_examples=25, deadline=None)
@given(
    remote_bs=st.sampled_from([4, 8, 16]),
    local_bs=st.sampled_from([4, 8, 16]),
    layouts=st.sampled_from([(NHD, NHD), (NHD, HND), (HND, NHD), (HND, HND)]),
    num_remote_blocks=st.integers(1, 5),
    data=st.data(),
)
def test_any_window_matches_the_reference(
    remote_bs: int, local_bs: int, layouts: tuple[KVLayout, KVLayout], num_remote_blocks: int,
    data: st.DataObject,
) -> None:
    total = num_remote_blocks * remote_bs
    start = data.draw(st.integers(0, total - 1))
    num_tokens = data.draw(st.integers(1, total - start))
    token_offset = data.draw(st.integers(0, 2 * local_bs))
    check("torch", CacheSpec(layouts[0], remote_bs, num_heads=2),
          CacheSpec(layouts[1], local_bs, num_heads=2), num_remote_blocks, start, num_tokens,
          token_offset)


def test_window_past_the_buffer_is_rejected() -> None:
    spec = CacheSpec(NHD, 8, num_heads=2)
    src = random_caches(spec, 0)
    buf = pack(src, [1, 2], 0, 2, NHD)
    fmt = packed_format(src, NHD, 0, 2)
    dst = random_caches(spec, 1)
    before = clone(dst)
    with pytest.raises(KernelInputError, match="src_token_offset 17 outside"):
        unpack(buf, fmt, 2, dst, [0, 1, 2], NHD, src_token_offset=17)
    with pytest.raises(KernelInputError, match="num_tokens 12 outside"):
        unpack(buf, fmt, 2, dst, [0, 1, 2], NHD, num_tokens=12, src_token_offset=5)
    assert same_bytes(dst, before)
    # by default everything after the skipped tokens is written
    unpack(buf, fmt, 2, dst, [0, 1], NHD, src_token_offset=5)
    expected = clone(before)
    reference.unpack(buf, fmt, 2, expected, [0, 1], NHD, 0, 11, 0, 5)
    assert same_bytes(dst, expected)
    assert not torch.equal(dst[0], before[0])
