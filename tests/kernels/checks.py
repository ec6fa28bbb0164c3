"""Checks shared by the kernel tests: a whole pack/unpack transfer against the reference.

``test_pack_unpack.py`` calls :func:`check_transfer` on chosen shapes,
``test_properties.py`` on shapes hypothesis draws.
"""

from __future__ import annotations

import torch

from kvbridge.kernels import Impl, pack, packed_format, unpack
from tests.kernels import reference
from tests.kernels.helpers import CacheSpec, clone, random_caches, same_bytes, shuffled_ids


def check_transfer(
    impl: Impl,
    remote: CacheSpec,
    local: CacheSpec,
    *,
    head_start: int = 0,
    head_end: int | None = None,
    head_offset: int = 0,
    num_remote_blocks: int = 3,
    drop_tokens: int = 0,
    token_offset: int = 0,
    seed: int = 0,
) -> None:
    """Pack from ``remote``, unpack into ``local``; both must equal the reference."""
    head_end = remote.num_heads if head_end is None else head_end
    src = random_caches(remote, seed)
    ids = shuffled_ids(num_remote_blocks, remote.num_blocks, seed, repeats=True)
    buf = pack(src, ids, head_start, head_end, remote.layout, impl=impl)
    expected_buf = reference.pack(src, ids, head_start, head_end, remote.layout)
    assert torch.equal(buf, expected_buf)

    fmt = packed_format(src, remote.layout, head_start, head_end)
    num_tokens = num_remote_blocks * remote.block_size - drop_tokens
    num_local = -(-(token_offset + num_tokens) // local.block_size)
    local_ids = shuffled_ids(num_local, local.num_blocks, seed + 1, repeats=False)
    dst = random_caches(local, seed + 2)
    expected = clone(dst)
    unpack(
        buf, fmt, num_remote_blocks, dst, local_ids, local.layout, head_offset,
        num_tokens, token_offset, impl=impl,
    )  # fmt: skip
    reference.unpack(
        expected_buf, fmt, num_remote_blocks, expected, local_ids, local.layout,
        head_offset, num_tokens, token_offset,
    )  # fmt: skip
    assert same_bytes(dst, expected)
