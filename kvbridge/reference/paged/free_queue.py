"""Block records and the queue of free blocks, in eviction (LRU) order.

Why hand-written: the pool must take a cached block out of the *middle* of the
free queue when a new request hits it (``touch``). ``collections.deque`` removes
from the middle in O(n); ``OrderedDict`` does it in O(1) but allocates a node
and hashes a key on every operation. This queue is intrusive: the links live in
the :class:`KVCacheBlock` records themselves, so pop-left, append and
remove-from-middle are O(1) and allocate nothing.

Order: at start, by block id. The pool appends blocks as they are freed, so the
front holds the least recently used block. The manager frees a request's blocks
tail first, so among blocks freed together the tail of the chain (the block
with the longest prefix, least likely to be shared) is evicted first. That
ordering is the caller's job; this queue keeps whatever order it is given.

Ownership: only this queue reads or writes ``prev_free`` / ``next_free``; only
the block pool changes ``ref_cnt`` and ``block_hash``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.errors import IntegrityError, KVBridgeError
from kvbridge.reference.paged.hashing import BlockHashWithGroupId


class NoFreeBlocksError(KVBridgeError, ValueError):
    """More blocks were requested than are free. Nothing was changed."""

    def __init__(self, num_requested: int, num_free: int) -> None:
        super().__init__(f"requested {num_requested} blocks but only {num_free} are free")
        self.num_requested = num_requested
        self.num_free = num_free


class FreeQueueError(KVBridgeError, ValueError):
    """A block was appended twice or removed while not in the queue."""


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV cache block. Compared by identity.

    Attributes:
        block_id: Index of the block in the KV cache tensors.
        ref_cnt: Number of requests holding the block (pool-owned).
        block_hash: Cache key while the block holds a cached full block
            (pool-owned), else ``None``.
        prev_free: Queue link (queue-owned); ``None`` when not free.
        next_free: Queue link (queue-owned); ``None`` when not free.
        is_null: True only for the pool's placeholder block 0.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHashWithGroupId | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        # The links would print the whole queue; show neighbour ids only.
        prev_id = self.prev_free.block_id if self.prev_free is not None else None
        next_id = self.next_free.block_id if self.next_free is not None else None
        hash_hex = self.block_hash.hex()[:16] if self.block_hash is not None else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={hash_hex}, prev_free={prev_id}, next_free={next_id}, "
            f"is_null={self.is_null})"
        )


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels.

    ::

        head <-> b3 <-> b7 <-> b1 <-> tail
        (front: evicted first)   (back: freed last)

    A block is in the queue exactly when its links are set; sentinels mean
    every queued block has both neighbours, so no operation special-cases ends.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        """Queue ``blocks`` in the given order.

        Raises:
            FreeQueueError: a block is already linked or appears twice.
        """
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_free_blocks = 0
        self.append_n(blocks)

    @property
    def num_free_blocks(self) -> int:
        """Number of blocks in the queue."""
        return self._num_free_blocks

    def __len__(self) -> int:
        return self._num_free_blocks

    @staticmethod
    def contains(block: KVCacheBlock) -> bool:
        """Whether ``block`` is in a free queue (its links are set)."""
        return block.prev_free is not None

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front (least recently used) block.

        Raises:
            NoFreeBlocksError: the queue is empty.
        """
        first = self._head.next_free
        assert first is not None
        if first is self._tail:
            raise NoFreeBlocksError(1, 0)
        self._unlink(first)
        return first

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Remove and return the ``num_blocks`` front blocks, front first.

        Raises:
            ValueError: ``num_blocks`` is negative.
            NoFreeBlocksError: fewer than ``num_blocks`` are free (queue unchanged).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self._num_free_blocks:
            raise NoFreeBlocksError(num_blocks, self._num_free_blocks)
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        for _ in range(num_blocks):
            assert block is not None and block is not self._tail
            nxt = block.next_free
            block.prev_free = block.next_free = None
            out.append(block)
            block = nxt
        # Splice: head <-> first block not taken.
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self._num_free_blocks -= num_blocks
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the middle of the queue.

        Raises:
            FreeQueueError: ``block`` is not in the queue.
        """
        if block.prev_free is None or block.next_free is None:
            raise FreeQueueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last).

        Raises:
            FreeQueueError: ``block`` is already in a queue.
        """
        if block.prev_free is not None or block.next_free is not None:
            raise FreeQueueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back in the given order (the last is evicted last).

        Raises:
            FreeQueueError: a block is already queued or appears twice (queue unchanged).
        """
        old_last = self._tail.prev_free
        assert old_last is not None
        last = old_last
        for i, block in enumerate(blocks):
            if block.prev_free is not None or block.next_free is not None:
                # Already queued, or a repeat linked a moment ago: undo the
                # partial splice, which only touched old_last and blocks[:i].
                for done in blocks[:i]:
                    done.prev_free = done.next_free = None
                old_last.next_free = self._tail
                raise FreeQueueError(f"block {block.block_id} is already in the free queue")
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self._num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Return the queued blocks front to back (for tests and integrity checks)."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        # Bounded walk so a corrupted (cyclic) list cannot hang the caller.
        while block is not None and block is not self._tail and len(out) <= self._num_free_blocks:
            out.append(block)
            block = block.next_free
        return out

    def check_integrity(self) -> None:
        """Walk the list and check links and counts.

        Raises:
            IntegrityError: with the counts and block ids that disagree.
        """
        problems: list[str] = []
        num_walked = 0
        prev = self._head
        block = self._head.next_free
        # Stop one past the expected count so a cycle cannot hang the check.
        while block is not None and block is not self._tail and num_walked <= self._num_free_blocks:
            if block.prev_free is not prev:
                problems.append(f"block {block.block_id}: prev link does not point back")
            if block is self._head:
                problems.append("the head sentinel is linked inside the queue")
            num_walked += 1
            prev = block
            block = block.next_free
        if block is None:
            problems.append(f"chain broken after {num_walked} blocks (next link is None)")
        elif block is self._tail and self._tail.prev_free is not prev:
            problems.append("tail's prev link does not point to the last block")
        if num_walked != self._num_free_blocks:
            problems.append(
                f"walked {num_walked} blocks before the tail (or a cycle), "
                f"num_free_blocks says {self._num_free_blocks}"
            )
        if self._head.prev_free is not None or self._tail.next_free is not None:
            problems.append("sentinel outer links are set")
        if problems:
            raise IntegrityError("free block queue: " + "; ".join(problems))

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._num_free_blocks -= 1
