"""Per-layer KV cache specs: what one layer stores per block, and its worst case.

A spec describes one layer's cache format: how many tokens a block holds, how many
bytes one block (a *page*) takes, and the most bytes a single request can ever pin
in that layer. The scheduler-side sizing in :mod:`kvbridge.reference.paged.sizing` and the
block manager (one KV cache group per block table) build on these types.

Layer kinds and their worst case for one request (``T`` = max_model_len,
``B`` = max_num_batched_tokens, ``bs`` = block_size):

    full attention      ceil(T / bs) pages (T split across decode-CP ranks)
    sliding window      ceil(min(window - 1 + B, T) / bs) + 1 pages
    chunked local       ceil(min(chunk + B, T) / bs) pages
    cross attention     ceil(max_num_encoder_tokens / bs) pages
    Mamba               1 + num_speculative_blocks pages (one state per request)
    encoder-only        nothing: the layer keeps no cache between steps

Decision for encoder-only layers: their page size is 0 and
:func:`kvbridge.reference.paged.sizing.group_layers` leaves them out of every KV cache group,
so no block or tensor is ever allocated for them. A model whose layers are all
encoder-only has no KV cache groups.

Which layers may share one block table, and the records the block manager
consumes (``KVCacheGroupSpec``, ``KVCacheTensor``, ``KVCacheConfig``), are in
``kv_cache_config.py``.

All specs are frozen, hashable dataclasses validated on construction; bad sizes
raise :class:`~kvbridge.errors.ConfigError` with the offending numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from kvbridge.errors import ConfigError


class UnsupportedSpecError(ConfigError):
    """A spec type (or object) that kvbridge does not know how to size or group."""


class SpecMismatchError(ConfigError):
    """Specs that must agree (one KV cache group, one merged spec) do not."""


def cdiv(num: int, den: int) -> int:
    """Ceiling division of non-negative ``num`` by positive ``den``."""
    return -(-num // den)


def _require_positive(owner: object, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{type(owner).__name__}: {name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Base of every spec: the cache format of one layer.

    Subclasses define :attr:`page_size_bytes` and :meth:`max_memory_usage_bytes`;
    the base raises :class:`UnsupportedSpecError` for both.
    """

    block_size: int

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.block_size, int):
            raise ConfigError(f"{type(self).__name__}: block_size must be an int, "
                              f"got {self.block_size!r}")
        _require_positive(self, block_size=self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of ``block_size`` tokens takes in this layer."""
        raise UnsupportedSpecError(f"{type(self).__name__} defines no page size")

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_num_batched_tokens: int,
        *,
        max_num_encoder_tokens: int | None = None,
        dcp_world_size: int = 1,
    ) -> int:
        """Most bytes one request can hold in this layer at any time.

        Args:
            max_model_len: longest request (prompt + output) in tokens.
            max_num_batched_tokens: most tokens scheduled in one step.
            max_num_encoder_tokens: longest encoder input (cross attention only);
                ``None`` means ``max_num_batched_tokens``, the scheduler default.
            dcp_world_size: decode context-parallel ranks; each full-attention rank
                stores ``ceil(max_model_len / dcp_world_size)`` tokens.

        Returns:
            The worst-case bytes, a whole number of pages.

        Raises:
            ConfigError: a limit is not positive, or the layer kind does not
                support decode context parallelism.
            UnsupportedSpecError: the spec type defines no worst case.
        """
        raise UnsupportedSpecError(f"{type(self).__name__} defines no memory bound")


def _check_limits(spec: KVCacheSpec, max_model_len: int, max_num_batched_tokens: int,
                  dcp_world_size: int) -> None:
    _require_positive(spec, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens,
                      dcp_world_size=dcp_world_size)


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    """Attention layer storing a K and a V vector per token and KV head."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def _validate(self) -> None:
        KVCacheSpec._validate(self)
        _require_positive(self, num_kv_heads=self.num_kv_heads, head_size=self.head_size)
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"{type(self).__name__}: dtype must be a torch.dtype, "
                              f"got {self.dtype!r}")

    @property
    def _num_vectors(self) -> int:
        return 2  # K and V

    @property
    def page_size_bytes(self) -> int:
        return (self._num_vectors * self.block_size * self.num_kv_heads * self.head_size
                * self.dtype.itemsize)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: every token of the request keeps its K/V.

    ``sliding_window`` / ``attention_chunk_size`` are only *recorded*: a hybrid
    model run without per-kind groups treats its local-attention layers as full
    attention for allocation, while the kernel still applies the window.
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def _validate(self) -> None:
        AttentionSpec._validate(self)
        _require_positive(self, sliding_window=self.sliding_window,
                          attention_chunk_size=self.attention_chunk_size)
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ConfigError(
                f"{type(self).__name__}: sliding_window={self.sliding_window} and "
                f"attention_chunk_size={self.attention_chunk_size} cannot both be set")

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int, *,
        max_num_encoder_tokens: int | None = None, dcp_world_size: int = 1,
    ) -> int:
        _check_limits(self, max_model_len, max_num_batched_tokens, dcp_world_size)
        num_tokens = cdiv(max_model_len, dcp_world_size)
        return cdiv(num_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent per token, no K/V pair.

    ``head_size`` is the latent width and ``num_kv_heads`` is normally 1.
    """

    @property
    def _num_vectors(self) -> int:
        return 1


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens only."""

    sliding_window: int

    def _validate(self) -> None:
        AttentionSpec._validate(self)
        _require_positive(self, sliding_window=self.sliding_window)

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int, *,
        max_num_encoder_tokens: int | None = None, dcp_world_size: int = 1,
    ) -> int:
        _check_limits(self, max_model_len, max_num_batched_tokens, dcp_world_size)
        if dcp_world_size != 1:
            raise ConfigError(f"sliding window attention does not support decode context "
                              f"parallelism (dcp_world_size={dcp_world_size})")
        # A step needs the window - 1 tokens before it plus every new token.
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        # One extra page: the held tokens rarely start on a block boundary.
        #   bs=4, 4 tokens A..D held, aligned:  [A B C D]            -> 1 page
        #   same 4 tokens, shifted by two:      [. . A B][C D . .]   -> 2 pages
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens."""

    attention_chunk_size: int

    def _validate(self) -> None:
        AttentionSpec._validate(self)
        _require_positive(self, attention_chunk_size=self.attention_chunk_size)

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int, *,
        max_num_encoder_tokens: int | None = None, dcp_world_size: int = 1,
    ) -> int:
        _check_limits(self, max_model_len, max_num_batched_tokens, dcp_world_size)
        # At most the current chunk's computed tokens plus one step of new tokens.
        num_tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder layer attending to encoder outputs; caches the encoder tokens' K/V."""

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int, *,
        max_num_encoder_tokens: int | None = None, dcp_world_size: int = 1,
    ) -> int:
        _check_limits(self, max_model_len, max_num_batched_tokens, dcp_world_size)
        if max_num_encoder_tokens is None:
            max_num_encoder_tokens = max_num_batched_tokens
        _require_positive(self, max_num_encoder_tokens=max_num_encoder_tokens)
        return cdiv(max_num_encoder_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional encoder layer: K/V live for one forward pass, nothing is cached.

    Page size and worst case are both 0; ``config.group_layers`` skips these layers.
    """

    @property
    def page_size_bytes(self) -> int:
        return 0

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int, *,
        max_num_encoder_tokens: int | None = None, dcp_world_size: int = 1,
    ) -> int:
        _check_limits(self, max_model_len, max_num_batched_tokens, dcp_world_size)
        return 0


@dataclass(frozen=True, slots=True)
class MambaSpec(KVCacheSpec):
    """State-space layer: fixed-size state tensors per request, not per token.

    ``page_size_padded`` lets a Mamba page match the attention page size of a
    hybrid model; it must be at least the unpadded size.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None
    num_speculative_blocks: int = 0

    def _validate(self) -> None:
        KVCacheSpec._validate(self)
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ConfigError(f"MambaSpec: need one dtype per state shape, got "
                              f"{len(self.shapes)} shapes and {len(self.dtypes)} dtypes")
        for shape in self.shapes:
            if any(dim <= 0 for dim in shape):
                raise ConfigError(f"MambaSpec: state shape {shape} has a dimension <= 0")
        if not all(isinstance(dtype, torch.dtype) for dtype in self.dtypes):
            raise ConfigError(f"MambaSpec: dtypes must be torch.dtype, got {self.dtypes!r}")
        if self.num_speculative_blocks < 0:
            raise ConfigError(f"MambaSpec: num_speculative_blocks must be >= 0, "
                              f"got {self.num_speculative_blocks}")
        unpadded = self.unpadded_page_size_bytes
        if self.page_size_padded is not None and self.page_size_padded < unpadded:
            raise ConfigError(f"MambaSpec: page_size_padded={self.page_size_padded} is "
                              f"smaller than the state size {unpadded} bytes")

    @property
    def unpadded_page_size_bytes(self) -> int:
        """Bytes of the state tensors themselves, before padding."""
        return sum(prod(shape) * dtype.itemsize
                   for shape, dtype in zip(self.shapes, self.dtypes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page_size_bytes

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int, *,
        max_num_encoder_tokens: int | None = None, dcp_world_size: int = 1,
    ) -> int:
        _check_limits(self, max_model_len, max_num_batched_tokens, dcp_world_size)
        # One state block per request, plus one per speculative step.
        return (1 + self.num_speculative_blocks) * self.page_size_bytes
