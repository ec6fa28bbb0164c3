"""Which tokens of a read land where: remote blocks, received buffer, local blocks.

Used by the link (``link.py``) to pick the remote blocks a plan item needs and
to tell whether it may be read direct (it may not when it starts inside a
block), and by the staged read (``staged.py``) to unpack each chunk's part.
"""

from __future__ import annotations

from kvbridge.topology import EngineTopology

__all__ = ["TokenWindow"]


class TokenWindow:
    """Where the read tokens sit in the received buffer and in the local blocks.

    The buffer holds whole remote blocks from ``first_remote_block`` on; buffer
    token ``u`` is request token ``first_remote_block * remote_bs + u``::

        request tokens  0 ............ first ................. end
        buffer          |  r  |  r  |  r  |  r  |             (whole remote blocks)
                                 <skip>^
        local blocks    |  l  |  l  |  l  |  l  |  l  |  l  | (local_block_ids)

    Buffer tokens ``[skip, skip + num_tokens)`` are written, to local position
    ``first - first_local_block * local_bs + (u - skip)`` of the local blocks
    from ``first_local_block`` on. ``whole_blocks`` (fused K/V caches, whose
    rows are not tokens) writes the last block whole, as a direct read does:
    its slots past the prompt are unused.
    """

    def __init__(
        self, first_token: int, num_tokens: int, remote_block_size: int, local: EngineTopology,
        *, whole_blocks: bool = False,
    ) -> None:
        end = first_token + num_tokens
        self.first_remote_block = first_token // remote_block_size
        self.end_remote_block = -(-end // remote_block_size)
        if whole_blocks:
            num_tokens = self.end_remote_block * remote_block_size - first_token
        self.num_tokens = num_tokens
        self.skip = first_token - self.first_remote_block * remote_block_size
        self.first_local_block = first_token // local.block_size
        self.local_offset = first_token - self.first_local_block * local.block_size

    def in_chunk(self, first_buffer_token: int, num_buffer_tokens: int) -> tuple[int, int, int]:
        """``(src_token_offset, num_tokens, token_offset)`` for one chunk's unpack."""
        low = max(first_buffer_token, self.skip)
        high = min(first_buffer_token + num_buffer_tokens, self.skip + self.num_tokens)
        return low - first_buffer_token, max(0, high - low), self.local_offset + low - self.skip
