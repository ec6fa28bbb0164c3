"""Tests for kvbridge.reference.paged.hashing: chained, seeded, stable block hashes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.reference.paged.hashing import (
    BlockHasher,
    MultiModalSpan,
    RequestHashExtras,
    available_hash_fn_names,
    block_extra_keys,
    get_block_hash,
    get_group_id,
    hash_block_tokens,
    make_block_hash_with_group_id,
    make_hash_fn,
    root_hash,
)

SEED = b"cluster-seed"


def _chain(hasher: BlockHasher, token_ids: list[int], extra: RequestHashExtras | None = None):
    return hasher.hash_request_blocks(token_ids, 0, [], extra)


# ------------------------------------------------------------------ hash fns


def test_make_hash_fn_matches_hashlib() -> None:
    data = b"some block bytes"
    assert make_hash_fn("sha256")(data) == hashlib.sha256(data).digest()
    assert make_hash_fn("blake2b")(data) == hashlib.blake2b(data, digest_size=16).digest()


def test_make_hash_fn_unknown_name() -> None:
    with pytest.raises(ValueError, match="md5"):
        make_hash_fn("md5")


def test_xxhash_option_is_clear_when_missing() -> None:
    if "xxh3_128" in available_hash_fn_names():
        fn = make_hash_fn("xxh3_128")
        assert fn(b"abc") == fn(b"abc") and len(fn(b"abc")) == 16
    else:
        with pytest.raises(ValueError, match="xxhash"):
            make_hash_fn("xxh3_128")


@pytest.mark.parametrize("name", available_hash_fn_names())
def test_encoding_is_plain_msgpack(name: str) -> None:
    # Pins the wire format independently of msgspec: P and D may run
    # different library versions, so the bytes hashed must be canonical
    # msgpack of [parent (bin 8), tokens (array), extra keys (nil)].
    fn = make_hash_fn(name)
    parent = bytes(range(32))
    tokens = [1, 2, 300, 70000]
    expected = (
        b"\x93"
        + b"\xc4\x20" + parent
        + b"\x94" + b"\x01" + b"\x02" + b"\xcd\x01\x2c" + b"\xce\x00\x01\x11\x70"
        + b"\xc0"
    )
    assert hash_block_tokens(fn, parent, tokens, None, SEED) == fn(expected)


# ------------------------------------------------------- hash_block_tokens


def test_first_block_uses_seeded_root() -> None:
    fn = make_hash_fn("sha256")
    tokens = [5, 6, 7, 8]
    first = hash_block_tokens(fn, None, tokens, None, SEED)
    assert first == hash_block_tokens(fn, root_hash(fn, SEED), tokens, None, b"ignored")
    assert first != hash_block_tokens(fn, None, tokens, None, SEED + b"x")


@pytest.mark.parametrize("name", available_hash_fn_names())
def test_every_input_changes_the_hash(name: str) -> None:
    fn = make_hash_fn(name)
    parent = fn(b"parent")
    base = hash_block_tokens(fn, parent, [1, 2, 3, 4], None, SEED)
    variants = [
        hash_block_tokens(fn, fn(b"other parent"), [1, 2, 3, 4], None, SEED),
        hash_block_tokens(fn, parent, [1, 2, 3, 5], None, SEED),
        hash_block_tokens(fn, parent, [1, 2, 3], None, SEED),
        hash_block_tokens(fn, parent, [1, 2, 3, 4], (7,), SEED),
        hash_block_tokens(fn, parent, [1, 2, 3, 4], ("7",), SEED),
        hash_block_tokens(fn, parent, [1, 2, 3, 4], (("img", 0),), SEED),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    assert len(base) == len(fn(b""))


def test_non_list_token_sequences_hash_like_lists() -> None:
    fn = make_hash_fn("blake2b")
    expected = hash_block_tokens(fn, None, [3, 1, 4, 1], None, SEED)
    assert hash_block_tokens(fn, None, (3, 1, 4, 1), None, SEED) == expected
    assert hash_block_tokens(fn, None, np.array([3, 1, 4, 1], np.int64), None, SEED) == expected
    assert hash_block_tokens(fn, None, range(3, 4), None, SEED) == hash_block_tokens(
        fn, None, [3], None, SEED
    )


def test_unencodable_extra_keys_raise() -> None:
    with pytest.raises(ValueError, match="encoded"):
        hash_block_tokens(make_hash_fn("sha256"), None, [1], (object(),), SEED)


# -------------------------------------------------------------- group keys


@pytest.mark.parametrize("group_id", [0, 1, 255, 2**32 - 1])
def test_group_key_round_trip(group_id: int) -> None:
    block_hash = hashlib.sha256(b"x").digest()
    key = make_block_hash_with_group_id(block_hash, group_id)
    assert get_block_hash(key) == block_hash
    assert get_group_id(key) == group_id


def test_group_keys_differ_per_group() -> None:
    block_hash = hashlib.sha256(b"x").digest()
    keys = {make_block_hash_with_group_id(block_hash, g) for g in range(4)}
    assert len(keys) == 4


@pytest.mark.parametrize("group_id", [-1, 2**32])
def test_group_id_out_of_range(group_id: int) -> None:
    with pytest.raises(ValueError, match=str(group_id)):
        make_block_hash_with_group_id(b"h" * 32, group_id)


# ------------------------------------------------------------ BlockHasher


@pytest.mark.parametrize(
    ("name", "seed", "block_size", "match"),
    [
        ("sha256", SEED, 0, "block_size"),
        ("sha256", SEED, -16, "block_size"),
        ("crc32", SEED, 16, "crc32"),
        ("sha256", "text-seed", 16, "seed"),
    ],
)
def test_hasher_rejects_bad_config(name: str, seed: object, block_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BlockHasher(name, seed, block_size)  # type: ignore[arg-type]


def test_equal_config_gives_equal_hashers() -> None:
    assert BlockHasher("sha256", SEED, 16) == BlockHasher("sha256", SEED, 16)
    assert BlockHasher("sha256", SEED, 16) != BlockHasher("sha256", SEED + b"!", 16)


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 4, 5, 11, 12, 13])
def test_only_full_blocks_are_hashed(num_tokens: int) -> None:
    hasher = BlockHasher("sha256", SEED, 4)
    hashes = _chain(hasher, list(range(num_tokens)))
    assert len(hashes) == num_tokens // 4


def test_request_chain_matches_block_by_block() -> None:
    hasher = BlockHasher("sha256", SEED, 4)
    tokens = list(range(100, 114))
    hashes = _chain(hasher, tokens)
    fn = make_hash_fn("sha256")
    parent = None
    for i, h in enumerate(hashes):
        parent = hash_block_tokens(fn, parent, tokens[4 * i : 4 * i + 4], None, SEED)
        assert h == parent
    assert hasher.hash_block(None, tokens[:4]) == hashes[0]


def test_incremental_hashing_matches_one_shot() -> None:
    hasher = BlockHasher("blake2b", SEED, 4)
    tokens = list(range(23))
    existing: list[bytes] = []
    for end in range(len(tokens) + 1):
        before = list(existing)
        new = hasher.hash_request_blocks(tokens[:end], len(existing), existing, None)
        assert existing == before  # not modified
        existing += new
    assert existing == _chain(hasher, tokens)


def test_restart_from_middle_block() -> None:
    hasher = BlockHasher("sha256", SEED, 4)
    tokens = list(range(20))
    full = _chain(hasher, tokens)
    assert hasher.hash_request_blocks(tokens, 2, full[:2], None) == full[2:]
    # start_block below len(existing): recompute from there with the right parent.
    assert hasher.hash_request_blocks(tokens, 3, full, None) == full[3:]


@pytest.mark.parametrize("start_block", [-1, 3])
def test_start_block_out_of_range(start_block: int) -> None:
    hasher = BlockHasher("sha256", SEED, 4)
    with pytest.raises(ValueError, match=str(start_block)):
        hasher.hash_request_blocks(list(range(16)), start_block, [b"a", b"b"], None)


def test_changing_one_token_changes_all_later_blocks() -> None:
    hasher = BlockHasher("sha256", SEED, 4)
    tokens = list(range(16))
    changed = list(tokens)
    changed[5] += 1  # block 1
    a, b = _chain(hasher, tokens), _chain(hasher, changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_seed_and_hash_fn_change_every_block() -> None:
    tokens = list(range(12))
    a = _chain(BlockHasher("sha256", SEED, 4), tokens)
    b = _chain(BlockHasher("sha256", b"other", 4), tokens)
    c = _chain(BlockHasher("blake2b", SEED, 4), tokens)
    assert all(len({x, y, z}) == 3 for x, y, z in zip(a, b, c, strict=True))


# ----------------------------------------------------------------- extras


def test_lora_name_enters_every_block() -> None:
    hasher = BlockHasher("sha256", SEED, 4)
    tokens = list(range(12))
    plain = _chain(hasher, tokens)
    lora = _chain(hasher, tokens, RequestHashExtras(lora_name="sql"))
    other = _chain(hasher, tokens, RequestHashExtras(lora_name="chat"))
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, lora, other, strict=True))
    for i in range(3):
        assert block_extra_keys(RequestHashExtras(lora_name="sql"), 4 * i, 4 * i + 4) == ("sql",)


def test_cache_salt_only_in_first_block() -> None:
    salted = RequestHashExtras(cache_salt="tenant-a")
    assert block_extra_keys(salted, 0, 4) == ("tenant-a",)
    assert block_extra_keys(salted, 4, 8) is None
    hasher = BlockHasher("sha256", SEED, 4)
    tokens = list(range(12))
    plain, salty = _chain(hasher, tokens), _chain(hasher, tokens, salted)
    assert plain[0] != salty[0]
    # Block 1 differs only through its parent: same parent -> same hash.
    assert hasher.hash_block(salty[0], tokens[4:8], block_extra_keys(salted, 4, 8)) == salty[1]
    assert hasher.hash_block(salty[0], tokens[4:8], None) == salty[1]


def test_no_extras_means_no_keys() -> None:
    assert block_extra_keys(None, 0, 4) is None
    assert block_extra_keys(RequestHashExtras(), 0, 4) is None
    hasher = BlockHasher("sha256", SEED, 4)
    assert _chain(hasher, list(range(8)), RequestHashExtras()) == _chain(hasher, list(range(8)))


def test_mm_span_offsets_relative_to_block() -> None:
    # block size 4; span "img" covers tokens 2..8 (blocks 0, 1, 2), "aud" 13..14.
    #   block:   0: [0,4)   1: [4,8)   2: [8,12)   3: [12,16)
    #   img:       2......................8
    #   aud:                                          13.14
    img = MultiModalSpan("img", offset=2, length=7)
    aud = MultiModalSpan("aud", offset=13, length=2)
    extras = RequestHashExtras(lora_name="a", cache_salt="s", mm_features=(img, aud))
    bs = 4
    for block in range(5):
        start, end = block * bs, block * bs + bs
        expected: list[object] = ["a"]
        for span in (img, aud):
            if span.offset < end and span.offset + span.length > start:
                expected.append((span.mm_hash, span.offset - start))
        if block == 0:
            expected.append("s")
        assert block_extra_keys(extras, start, end) == tuple(expected)
    assert block_extra_keys(extras, 4, 8) == ("a", ("img", -2))
    assert block_extra_keys(extras, 16, 20) == ("a",)


def test_mm_hash_and_offset_change_the_hash() -> None:
    hasher = BlockHasher("sha256", SEED, 4)
    tokens = [0] * 8  # placeholder tokens look alike; only the mm keys differ
    a = _chain(hasher, tokens, RequestHashExtras(mm_features=(MultiModalSpan("a", 1, 2),)))
    b = _chain(hasher, tokens, RequestHashExtras(mm_features=(MultiModalSpan("b", 1, 2),)))
    c = _chain(hasher, tokens, RequestHashExtras(mm_features=(MultiModalSpan("a", 2, 2),)))
    assert len({a[0], b[0], c[0]}) == 3


@pytest.mark.parametrize(("offset", "length"), [(-1, 2), (0, 0), (3, -1)])
def test_bad_mm_span(offset: int, length: int) -> None:
    with pytest.raises(ValueError, match=str(length)):
        MultiModalSpan("x", offset, length)


@pytest.mark.parametrize(
    "spans",
    [
        (MultiModalSpan("a", 5, 2), MultiModalSpan("b", 1, 2)),  # unsorted
        (MultiModalSpan("a", 1, 4), MultiModalSpan("b", 3, 2)),  # overlapping
    ],
)
def test_mm_spans_must_be_sorted_and_disjoint(spans: tuple[MultiModalSpan, ...]) -> None:
    with pytest.raises(ValueError, match="sorted and disjoint"):
        RequestHashExtras(mm_features=spans)


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=40),
    block_size=st.integers(1, 8),
    extra_lora=st.none() | st.text(min_size=1, max_size=8),
)
def test_prefix_property(tokens: list[int], block_size: int, extra_lora: str | None) -> None:
    # The hashes of a prefix are a prefix of the hashes.
    hasher = BlockHasher("blake2b", SEED, block_size)
    extras = RequestHashExtras(lora_name=extra_lora)
    full = _chain(hasher, tokens, extras)
    cut = len(tokens) // 2
    assert _chain(hasher, tokens[:cut], extras) == full[: cut // block_size]
    assert len(set(full)) == len(full)  # chaining makes repeated blocks distinct


# ---------------------------------------------------- cross-process stability

_CHILD = textwrap.dedent(
    """
    import sys
    from kvbridge.reference.paged.hashing import BlockHasher, MultiModalSpan, RequestHashExtras
    extras = RequestHashExtras(
        lora_name="seven", cache_salt="salt", mm_features=(MultiModalSpan("img", 3, 6),)
    )
    for name in ("sha256", "blake2b"):
        hasher = BlockHasher(name, bytes.fromhex(sys.argv[1]), 4)
        for h in hasher.hash_request_blocks(list(range(1000, 1019)), 0, [], extras):
            print(h.hex())
    """
)


def test_hashes_identical_in_fresh_processes() -> None:
    extras = RequestHashExtras(
        lora_name="seven", cache_salt="salt", mm_features=(MultiModalSpan("img", 3, 6),)
    )
    expected = [
        h.hex()
        for name in ("sha256", "blake2b")
        for h in BlockHasher(name, SEED, 4).hash_request_blocks(
            list(range(1000, 1019)), 0, [], extras
        )
    ]
    # Different PYTHONHASHSEEDs: nothing may depend on Python's str hashing.
    for py_hash_seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": py_hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, SEED.hex()],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()
        assert out == expected
