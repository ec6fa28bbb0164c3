"""Tests for kvbridge.reference.engine.tokenizer: byte round trip and special tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.reference.engine.model_config import get_model_config
from kvbridge.reference.engine.tokenizer import ByteTokenizer

TOK = ByteTokenizer.for_model(get_model_config("tiny"))


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert ids[0] == TOK.bos_token_id
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    assert TOK.encode(text, add_bos=False) == ids[1:]


def test_specials_are_skipped_and_bad_bytes_replaced() -> None:
    ids = [TOK.bos_token_id, *b"ok", TOK.eos_token_id, TOK.pad_token_id]
    assert TOK.decode(ids) == "ok"
    assert all(TOK.is_special(i) for i in ids[:1] + ids[3:])
    assert not TOK.is_special(ord("o"))
    # A completion cut inside a multi-byte character.
    assert TOK.decode(list("é".encode())[:1]) == "\ufffd"


@pytest.mark.parametrize("bad", [-1, 259, 10_000])
def test_out_of_vocab_ids_raise(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        TOK.decode([65, bad])


def test_specials_must_be_distinct_non_bytes() -> None:
    with pytest.raises(ValueError):
        ByteTokenizer(bos_token_id=65)
    with pytest.raises(ValueError):
        ByteTokenizer(bos_token_id=256, eos_token_id=256)
