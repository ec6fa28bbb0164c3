"""Byte-level tokenizer of the reference engine: one token per UTF-8 byte.

Ids ``0..255`` are the bytes themselves; the model config's BOS, EOS and PAD ids
follow. Nothing is downloaded and every string round-trips exactly. The HTTP
layer encodes prompts and decodes completions with it; tests use it to build
prompts.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvbridge.reference.engine.model_config import NUM_BYTE_TOKENS, ModelConfig


class ByteTokenizer:
    """UTF-8 bytes <-> token ids, with BOS/EOS/PAD specials above the byte range.

    Args:
        bos_token_id: Begin-of-sequence id (>= 256).
        eos_token_id: End-of-sequence id (>= 256).
        pad_token_id: Padding id (>= 256).
        vocab_size: Ids the model may produce; defaults to the largest special + 1.
            Ids in ``[256, vocab_size)`` carry no bytes and decode to nothing.

    Raises:
        ValueError: a special id collides with a byte id or another special, or
            lies beyond ``vocab_size``.
    """

    def __init__(
        self,
        bos_token_id: int = NUM_BYTE_TOKENS,
        eos_token_id: int = NUM_BYTE_TOKENS + 1,
        pad_token_id: int = NUM_BYTE_TOKENS + 2,
        vocab_size: int | None = None,
    ) -> None:
        specials = (bos_token_id, eos_token_id, pad_token_id)
        vocab = max(specials) + 1 if vocab_size is None else vocab_size
        if (
            min(specials) < NUM_BYTE_TOKENS
            or len(set(specials)) != len(specials)
            or max(specials) >= vocab
        ):
            raise ValueError(
                f"special ids BOS {bos_token_id}, EOS {eos_token_id}, PAD {pad_token_id} "
                f"must be distinct and in [{NUM_BYTE_TOKENS}, {vocab})"
            )
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab

    @classmethod
    def for_model(cls, config: ModelConfig) -> ByteTokenizer:
        """The tokenizer matching ``config``'s special ids.

        Raises:
            ValueError: the config's special ids do not fit a byte tokenizer.
        """
        return cls(config.bos_token_id, config.eos_token_id, config.pad_token_id, config.vocab_size)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``'s UTF-8 bytes, optionally after BOS."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of the byte ids in ``token_ids``; specials and other non-byte ids are skipped.

        Byte sequences that are not valid UTF-8 (e.g. a completion cut inside a
        multi-byte character) decode to U+FFFD.

        Raises:
            ValueError: an id is negative or beyond the vocabulary.
        """
        data = bytearray()
        for token_id in token_ids:
            if token_id < NUM_BYTE_TOKENS:
                if token_id < 0:
                    raise ValueError(f"negative token id {token_id}")
                data.append(token_id)
            elif token_id >= self.vocab_size:
                raise ValueError(f"token id {token_id} outside vocabulary [0, {self.vocab_size})")
        return data.decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is BOS, EOS or PAD."""
        return token_id in (self.bos_token_id, self.eos_token_id, self.pad_token_id)
