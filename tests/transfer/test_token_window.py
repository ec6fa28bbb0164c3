"""Where a read's tokens sit in the received chunks and in the local blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.reading.tokens import TokenWindow


def local(block_size: int) -> EngineTopology:
    return EngineTopology(tp_size=1, pp_size=1, block_size=block_size, num_kv_heads=1,
                          is_mla=False, layout=KVLayout.NHD, num_layers=1)


def test_read_from_the_middle_of_a_remote_block() -> None:
    # tokens [48, 90): remote blocks of 32 -> blocks 1..2, skip 16; local blocks of 16 -> 3..
    window = TokenWindow(48, 42, 32, local(16))
    assert (window.first_remote_block, window.end_remote_block, window.skip) == (1, 3, 16)
    assert (window.first_local_block, window.local_offset) == (3, 0)
    # chunks of one remote block: (src offset, tokens, local position)
    assert window.in_chunk(0, 32) == (16, 16, 0)
    assert window.in_chunk(32, 32) == (0, 26, 16)


@settings(max_examples=200, deadline=None)
@given(
    remote_bs=st.sampled_from([4, 16, 32]),
    local_bs=st.sampled_from([4, 16, 32]),
    first_token=st.integers(0, 200),
    num_tokens=st.integers(1, 200),
    chunk_blocks=st.integers(1, 4),
)
def test_every_token_lands_once_in_order(
    remote_bs: int, local_bs: int, first_token: int, num_tokens: int, chunk_blocks: int
) -> None:
    window = TokenWindow(first_token, num_tokens, remote_bs, local(local_bs))
    num_blocks = window.end_remote_block - window.first_remote_block
    landed = []  # (request token, local block index, slot)
    for first_block in range(0, num_blocks, chunk_blocks):
        blocks = min(chunk_blocks, num_blocks - first_block)
        src, count, position = window.in_chunk(first_block * remote_bs, blocks * remote_bs)
        assert src >= 0 and src + count <= blocks * remote_bs
        for k in range(count):
            buffer_token = first_block * remote_bs + src + k
            token = window.first_remote_block * remote_bs + buffer_token
            p = position + k
            landed.append((token, window.first_local_block + p // local_bs, p % local_bs))
    assert [t for t, _, _ in landed] == list(range(first_token, first_token + num_tokens))
    assert all(index * local_bs + slot == t for t, index, slot in landed)
