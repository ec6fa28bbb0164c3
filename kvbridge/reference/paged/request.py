"""The request as the KV cache manager sees it.

The scheduler creates one ``Request`` per generation request and keeps it up to
date: it appends sampled tokens with :meth:`Request.append_output_token_ids` and
advances :attr:`Request.num_computed_tokens` after each step. The request keeps
the hash of every full block of its tokens current, which is what the manager
looks up in the prefix cache (``paged/manager.py``).

Ownership: ``num_computed_tokens`` belongs to the scheduler; the manager only
reads it. Token lists and block hashes belong to the request and are exposed
read-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvbridge.reference.paged.hashing import BlockHash, BlockHasher, RequestHashExtras

__all__ = ["Request"]


class Request:
    """Tokens, progress and block hashes of one request.

    Args:
        request_id: Unique id within one engine.
        prompt_token_ids: The prompt, at least one token.
        hasher: Computes block hashes; ``None`` means the request never uses
            the prefix cache (no hashes are kept).
        hash_extras: LoRA name, cache salt and multimodal spans that enter the
            block hashes.
        skip_prefix_cache: Never read from the prefix cache (e.g. the caller
            wants prompt logprobs, which need every prompt token computed).
        num_encoder_tokens: Encoder input length, for cross-attention groups.

    Raises:
        ValueError: empty prompt or id, a negative token id or encoder length,
            or a multimodal span beyond the prompt.
    """

    __slots__ = (
        "request_id",
        "hash_extras",
        "skip_prefix_cache",
        "num_encoder_tokens",
        "num_computed_tokens",
        "_hasher",
        "_num_prompt_tokens",
        "_all_token_ids",
        "_block_hashes",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hasher: BlockHasher | None = None,
        *,
        hash_extras: RequestHashExtras | None = None,
        skip_prefix_cache: bool = False,
        num_encoder_tokens: int = 0,
    ) -> None:
        if not request_id:
            raise ValueError("request_id must be a non-empty string")
        tokens = [int(t) for t in prompt_token_ids]
        if not tokens:
            raise ValueError(f"request {request_id!r}: prompt must have at least one token")
        _check_token_ids(request_id, tokens)
        if num_encoder_tokens < 0:
            raise ValueError(
                f"request {request_id!r}: num_encoder_tokens must be >= 0, "
                f"got {num_encoder_tokens}"
            )
        if hash_extras is not None:
            for span in hash_extras.mm_features:
                if span.offset + span.length > len(tokens):
                    raise ValueError(
                        f"request {request_id!r}: multimodal span {span.mm_hash!r} ends at "
                        f"{span.offset + span.length}, beyond the {len(tokens)}-token prompt"
                    )
        self.request_id = request_id
        self.hash_extras = hash_extras
        self.skip_prefix_cache = skip_prefix_cache
        self.num_encoder_tokens = num_encoder_tokens
        # Tokens whose KV is in the cache (computed or loaded). Advanced by the
        # scheduler after each step; read by the manager.
        self.num_computed_tokens = 0
        self._hasher = hasher
        self._num_prompt_tokens = len(tokens)
        self._all_token_ids = tokens
        self._block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    # ----------------------------------------------------------------- tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return self._num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens appended since the prompt."""
        return len(self._all_token_ids) - self._num_prompt_tokens

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by output tokens (a read-only view; do not mutate)."""
        return self._all_token_ids

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        """The prompt tokens (a copy)."""
        return tuple(self._all_token_ids[: self._num_prompt_tokens])

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The output tokens so far (a copy)."""
        return tuple(self._all_token_ids[self._num_prompt_tokens :])

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens and hash any block they complete.

        Args:
            token_ids: One token id or several, in order.

        Raises:
            ValueError: a token id is negative (nothing appended).
        """
        new_tokens = [int(token_ids)] if isinstance(token_ids, int) else [
            int(t) for t in token_ids
        ]
        _check_token_ids(self.request_id, new_tokens)
        self._all_token_ids.extend(new_tokens)
        self._update_block_hashes()

    # ----------------------------------------------------------------- hashes

    @property
    def hasher(self) -> BlockHasher | None:
        """The block hasher, or ``None`` when the request keeps no hashes."""
        return self._hasher

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Hash of every full block, in order (a read-only view; do not mutate)."""
        return self._block_hashes

    def _update_block_hashes(self) -> None:
        hasher = self._hasher
        if hasher is None:
            return
        if len(self._all_token_ids) < (len(self._block_hashes) + 1) * hasher.block_size:
            return  # fast path: no block became full
        self._block_hashes.extend(
            hasher.hash_request_blocks(
                self._all_token_ids,
                len(self._block_hashes),
                self._block_hashes,
                self.hash_extras,
            )
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_prompt_tokens={self._num_prompt_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, "
            f"num_block_hashes={len(self._block_hashes)})"
        )


def _check_token_ids(request_id: str, token_ids: Sequence[int]) -> None:
    if token_ids and min(token_ids) < 0:
        bad = next(t for t in token_ids if t < 0)
        raise ValueError(f"request {request_id!r}: token ids must be >= 0, got {bad}")
