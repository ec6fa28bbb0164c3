"""KV cache events: which blocks entered or left the prefix cache.

The block pool records them (when enabled) and a caller drains them with
``BlockPool.take_events()``, e.g. to tell a router which prefixes an instance
holds. They are msgspec structs in one tagged union so they can cross a
process boundary with :func:`encode_events` / :func:`decode_events`.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, frozen=True, tag=True):
    """Full blocks of one request were added to the prefix cache.

    Attributes:
        block_hashes: Hashes of the newly cached blocks, in chain order.
        parent_block_hash: Hash of the block before the first one, ``None``
            when the first one starts the request.
        block_ids: Physical ids of the blocks, aligned with ``block_hashes``.
        group_id: KV cache group of the blocks.
        token_ids: Tokens of the cached blocks, flattened, when the caller
            supplied them.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    block_ids: list[int]
    group_id: int
    token_ids: list[int] | None = None


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    """A block left the prefix cache (evicted for reuse or invalidated).

    Attributes:
        block_hash: Hash of the block's content.
        block_id: Physical id of the block.
        group_id: KV cache group of the block.
    """

    block_hash: bytes
    block_id: int
    group_id: int


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_events(events: list[KVCacheEvent]) -> bytes:
    """Serialize events to msgpack.

    Returns:
        Bytes that :func:`decode_events` turns back into equal events.
    """
    return msgspec.msgpack.encode(events)


def decode_events(data: bytes) -> list[KVCacheEvent]:
    """Parse bytes from :func:`encode_events`.

    Raises:
        msgspec.ValidationError: the bytes are not a list of KV cache events
            (a ``ValueError`` subclass).
        msgspec.DecodeError: the bytes are not msgpack.
    """
    return msgspec.msgpack.decode(data, type=list[KVCacheEvent])
