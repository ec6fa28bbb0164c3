"""Chained, seeded block hashes for prefix caching.

A full block of tokens is identified by a hash over (parent block hash, the
block's token ids, extra keys). Chaining makes a block's hash name its whole
prefix, so one dictionary lookup per block finds the longest cached prefix.

Prefill (P) and decode (D) instances compare these hashes across processes and
machines, so the hash must not depend on anything local: the input is encoded
with msgpack (canonical, smallest-width integers, fixed byte order) and the
seed is an explicit argument, held by a :class:`BlockHasher`. There is no
module-global seed.

Called by ``paged/manager.py`` (hashes of a request's full blocks) and by the
benchmarks. ``block_pool.py`` keys its cache map with
:data:`BlockHashWithGroupId`.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NewType

import msgspec

BlockHash = bytes
"""Digest of one full block (32 bytes for sha256, 16 for blake2b)."""

HashFn = Callable[[bytes], bytes]
"""Maps an encoded block to its digest. Must be deterministic across machines."""

HASH_FN_NAMES: tuple[str, ...] = ("sha256", "blake2b", "xxh3_128")

# Domain tag of the root "parent" of a request's first block.
_ROOT_TAG = "kvbridge.block-hash.root.v1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b_128(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def make_hash_fn(name: str) -> HashFn:
    """Return the hash function called ``name``.

    On blocks of a few dozen tokens the Python call around the hash costs
    more than the hash itself, so the options differ mostly in key size and
    collision strength, not speed (see ``kvbridge/bench/paged_bench.py``).

    Args:
        name: ``"sha256"`` (cryptographic, 32-byte digests, the default
            choice); ``"blake2b"`` (blake2b with 16-byte digests, standard
            library, half the key size in the cache map); or ``"xxh3_128"``
            (non-cryptographic, 16 bytes; needs the optional ``xxhash``
            package on every P and D instance).

    Returns:
        A function from bytes to digest bytes.

    Raises:
        ValueError: ``name`` is not one of :data:`HASH_FN_NAMES`, or is
            ``"xxh3_128"`` and ``xxhash`` is not installed.
    """
    if name == "sha256":
        return _sha256
    if name == "blake2b":
        return _blake2b_128
    if name == "xxh3_128":
        try:
            import xxhash
        except ImportError as exc:
            raise ValueError(
                "block hash function 'xxh3_128' needs the 'xxhash' package; "
                "install it or use 'sha256' / 'blake2b'"
            ) from exc
        digest: HashFn = xxhash.xxh3_128_digest
        return digest
    raise ValueError(f"unknown block hash function {name!r}; expected one of {HASH_FN_NAMES}")


def available_hash_fn_names() -> tuple[str, ...]:
    """Return the names in :data:`HASH_FN_NAMES` usable in this environment."""
    has_xxhash = importlib.util.find_spec("xxhash") is not None
    return tuple(n for n in HASH_FN_NAMES if n != "xxh3_128" or has_xxhash)


def _encode(obj: object) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"block hash input cannot be encoded stably: {exc}") from exc


def root_hash(hash_fn: HashFn, seed: bytes) -> BlockHash:
    """Return the seeded stand-in parent hash of every request's first block.

    Args:
        hash_fn: The block hash function.
        seed: Cluster-wide seed; P and D must use the same one.

    Returns:
        ``hash_fn`` over the encoded (root tag, seed).
    """
    return hash_fn(_encode((_ROOT_TAG, seed)))


def hash_block_tokens(
    hash_fn: HashFn,
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None,
    seed: bytes,
) -> BlockHash:
    """Hash one full block, chained to its parent.

    Args:
        hash_fn: From :func:`make_hash_fn`.
        parent_hash: Hash of the previous block of the request, or ``None`` for
            the first block (then the seeded :func:`root_hash` is the parent).
        token_ids: The block's token ids (Python ints; other sequences such as
            numpy arrays are converted).
        extra_keys: Extra keys of this block (:func:`block_extra_keys`) or
            ``None``. Elements must be msgpack-encodable (int, str, bytes,
            tuples of those).
        seed: Cluster-wide seed. Only used when ``parent_hash`` is ``None``:
            every later block inherits it through the chain.

    Returns:
        The block's hash.

    Raises:
        ValueError: the token ids or extra keys cannot be encoded.
    """
    if parent_hash is None:
        parent_hash = root_hash(hash_fn, seed)
    if not isinstance(token_ids, list | tuple):
        token_ids = [int(t) for t in token_ids]
    return hash_fn(_encode((parent_hash, token_ids, extra_keys)))


BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""Key of the block pool's cache map: ``block_hash + group_id`` as 4 bytes.

Plain ``bytes`` rather than a tuple because bytes cache their own hash, which
makes the pool's dictionary lookups cheaper. Build with
:func:`make_block_hash_with_group_id`, split with :func:`get_block_hash` and
:func:`get_group_id`.
"""

_GROUP_ID_NBYTES = 4
# Suffixes of the common small group ids, built once: to_bytes costs as much
# as the dictionary lookup the key is made for.
_GROUP_SUFFIXES: tuple[bytes, ...] = tuple(
    i.to_bytes(_GROUP_ID_NBYTES, "big") for i in range(64)
)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Return the pool key of ``block_hash`` in KV cache group ``group_id``.

    Raises:
        ValueError: ``group_id`` is negative or does not fit in 4 bytes.
    """
    if 0 <= group_id < len(_GROUP_SUFFIXES):
        return BlockHashWithGroupId(block_hash + _GROUP_SUFFIXES[group_id])
    if not 0 <= group_id < 1 << (8 * _GROUP_ID_NBYTES):
        raise ValueError(f"kv cache group id {group_id} out of range [0, 2**32)")
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_NBYTES, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """Return the block hash part of a pool key."""
    return key[:-_GROUP_ID_NBYTES]


def get_group_id(key: BlockHashWithGroupId) -> int:
    """Return the KV cache group id part of a pool key."""
    return int.from_bytes(key[-_GROUP_ID_NBYTES:], "big")


@dataclass(frozen=True, slots=True)
class MultiModalSpan:
    """Placeholder tokens of one multimodal input inside a request's prompt.

    Attributes:
        mm_hash: Content hash of the input (image, audio, ...).
        offset: Index of the span's first token in the request.
        length: Number of placeholder tokens.
    """

    mm_hash: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"multimodal span {self.mm_hash!r}: offset {self.offset} must be >= 0 "
                f"and length {self.length} > 0"
            )


@dataclass(frozen=True, slots=True)
class RequestHashExtras:
    """Per-request inputs that change block hashes besides the tokens.

    Attributes:
        lora_name: LoRA adapter name, part of every block's extra keys. The name,
            not an integer id: two instances may number the same adapter
            differently, and P and D must agree on every hash (vLLM keys it so too).
        cache_salt: Isolates a tenant's cache; part of the first block only
            (the chain carries it to every later block).
        mm_features: Multimodal spans, sorted by offset, not overlapping.
    """

    lora_name: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[MultiModalSpan, ...] = ()

    def __post_init__(self) -> None:
        prev_end = 0
        for span in self.mm_features:
            if span.offset < prev_end:
                raise ValueError(
                    f"multimodal spans must be sorted and disjoint: span {span.mm_hash!r} "
                    f"starts at {span.offset}, before the previous span's end {prev_end}"
                )
            prev_end = span.offset + span.length


def block_extra_keys(
    extras: RequestHashExtras | None, block_start: int, block_end: int
) -> tuple[object, ...] | None:
    """Return the extra hash keys of the block covering tokens [block_start, block_end).

    Order: LoRA name, then ``(mm_hash, offset)`` per overlapping multimodal span,
    then the cache salt (first block only). ``offset`` is the span's start
    relative to the block and is negative when the span began in an earlier
    block::

        tokens   ... | block k: [block_start, block_end) | ...
        span         [offset ............ offset+length)
        key          (mm_hash, offset - block_start)   # < 0 here

    Args:
        extras: The request's extras, or ``None``.
        block_start: First token index of the block.
        block_end: One past the last token index of the block.

    Returns:
        The keys, or ``None`` when the block has none.
    """
    if extras is None:
        return None
    keys: list[object] = []
    if extras.lora_name is not None:
        keys.append(extras.lora_name)
    for span in extras.mm_features:
        if span.offset >= block_end:
            break  # sorted: no later span overlaps either
        if span.offset + span.length > block_start:
            keys.append((span.mm_hash, span.offset - block_start))
    if block_start == 0 and extras.cache_salt is not None:
        keys.append(extras.cache_salt)
    return tuple(keys) if keys else None


@dataclass(frozen=True)
class BlockHasher:
    """Hashes a request's full blocks with one hash function, seed and block size.

    P and D build equal ``BlockHasher``s from configuration; equal hashers give
    equal hashes on any machine.

    Attributes:
        hash_fn_name: See :func:`make_hash_fn`.
        seed: Cluster-wide seed.
        block_size: Tokens per block (the manager's block size).
    """

    hash_fn_name: str
    seed: bytes
    block_size: int
    _hash_fn: HashFn = field(init=False, repr=False, compare=False)
    _root: BlockHash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if not isinstance(self.seed, bytes):
            raise ValueError(f"seed must be bytes, got {type(self.seed).__name__}")
        hash_fn = make_hash_fn(self.hash_fn_name)
        object.__setattr__(self, "_hash_fn", hash_fn)
        object.__setattr__(self, "_root", root_hash(hash_fn, self.seed))

    @property
    def hash_fn(self) -> HashFn:
        """The resolved hash function."""
        return self._hash_fn

    def hash_block(
        self,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[object, ...] | None = None,
    ) -> BlockHash:
        """Hash one full block; see :func:`hash_block_tokens`."""
        parent = self._root if parent_hash is None else parent_hash
        return hash_block_tokens(self._hash_fn, parent, token_ids, extra_keys, self.seed)

    def hash_request_blocks(
        self,
        token_ids: Sequence[int],
        start_block: int,
        existing: list[BlockHash],
        extra: RequestHashExtras | None,
    ) -> list[BlockHash]:
        """Hash the full blocks of a request from block ``start_block`` on.

        ::

            token_ids  |  blk 0  |  blk 1  | ... | blk n-1 | partial |
            existing   [h0 ... h(start_block-1)]              (not hashed)
            returned             [h(start_block) ... h(n-1)]

        Args:
            token_ids: All tokens of the request so far.
            start_block: First block to hash; its parent is
                ``existing[start_block - 1]``. Usually ``len(existing)``.
            existing: Hashes already computed for the request. Not modified.
            extra: The request's extra hash inputs, or ``None``.

        Returns:
            Hashes of blocks ``start_block`` .. last full block; the caller
            appends them to its list. Empty when no new block is full.

        Raises:
            ValueError: ``start_block`` is negative or beyond ``len(existing)``.
        """
        if not 0 <= start_block <= len(existing):
            raise ValueError(
                f"start_block {start_block} out of range [0, {len(existing)}] "
                f"(number of existing hashes)"
            )
        bs = self.block_size
        num_full_blocks = len(token_ids) // bs
        if start_block >= num_full_blocks:
            return []
        # Hot path (every prompt and every completed decode block): inline
        # hash_block_tokens and convert the token slice once, not per block.
        tokens = token_ids[start_block * bs : num_full_blocks * bs]
        if not isinstance(tokens, list | tuple):
            tokens = [int(t) for t in tokens]
        hash_fn, encode = self._hash_fn, _encode
        parent: BlockHash = existing[start_block - 1] if start_block > 0 else self._root
        new_hashes: list[BlockHash] = []
        for i in range(num_full_blocks - start_block):
            start = (start_block + i) * bs
            keys = None if extra is None else block_extra_keys(extra, start, start + bs)
            parent = hash_fn(encode((parent, tokens[i * bs : i * bs + bs], keys)))
            new_hashes.append(parent)
        return new_hashes
