"""What one engine looks like to kvbridge, and how it splits KV heads and layers.

An :class:`EngineTopology` is the static description of one engine (the local
one, or a peer learned in the handshake): TP and PP sizes, block size, the
model-wide KV head and layer counts, MLA or not, the cache layout, and whether
K and V share one plane per head (``fused_kv``, vLLM's CPU cache) or each have a
tensor of their own (``split_kv``, SGLang's cache).

The two split rules live here so that P and D, which both call them, always
agree on who holds what:

Heads over TP ranks (``H`` model-wide KV heads, TP size ``t``)::

    t <= H (split):       rank r holds heads [r*H/t, (r+1)*H/t)
        H=4, t=2:  rank 0 -> [h0 h1]      rank 1 -> [h2 h3]
    t > H (replicated):   rank r holds head r // (t/H); each head lives on t/H ranks
        H=2, t=4:  ranks 0,1 -> [h0]      ranks 2,3 -> [h1]

MLA keeps one latent per token that cannot be split, so an MLA engine has
``num_kv_heads == 1``: with ``t > 1`` every rank holds the whole latent, which is
the replicated rule above with ``H = 1``.

Layers over PP ranks (``L`` layers, PP size ``p``): contiguous runs; when ``p``
does not divide ``L`` the first ``L % p`` ranks get one layer more::

    L=10, p=4:  rank 0 -> [0,3)  rank 1 -> [3,6)  rank 2 -> [6,8)  rank 3 -> [8,10)

Callers: :mod:`kvbridge.topology.tp_topology`, :mod:`kvbridge.topology.read_plan`,
and the transfer handshake (which builds one of these from a peer's metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.topology.layout import KVLayout


def _require_positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


def _require_rank(name: str, rank: int, size: int) -> None:
    if not 0 <= rank < size:
        raise ConfigError(f"{name} {rank} out of range for size {size}")


def heads_for_tp_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV heads held by one TP rank (see the module docstring).

    Args:
        num_kv_heads: Model-wide number of KV heads (1 for MLA).
        tp_size: Tensor-parallel size; must divide, or be a multiple of,
            ``num_kv_heads``.
        tp_rank: Rank in ``[0, tp_size)``.

    Returns:
        A ``range`` of global head indices; length ``num_kv_heads // tp_size``
        when split, 1 when replicated.

    Raises:
        ConfigError: a count is not positive, the rank is out of range, or
            neither of ``num_kv_heads`` and ``tp_size`` divides the other.
    """
    _require_positive("num_kv_heads", num_kv_heads)
    _require_positive("tp_size", tp_size)
    _require_rank("tp_rank", tp_rank, tp_size)
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ConfigError(f"num_kv_heads {num_kv_heads} not divisible by tp_size {tp_size}")
        num_per_rank = num_kv_heads // tp_size
        return range(tp_rank * num_per_rank, (tp_rank + 1) * num_per_rank)
    if tp_size % num_kv_heads:
        raise ConfigError(f"tp_size {tp_size} not a multiple of num_kv_heads {num_kv_heads}")
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def layers_for_pp_rank(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global layers held by one PP rank: contiguous, first ``L % p`` ranks get one more.

    Args:
        num_layers: Model-wide number of attention layers.
        pp_size: Pipeline-parallel size, at most ``num_layers``.
        pp_rank: Rank in ``[0, pp_size)``.

    Returns:
        A non-empty ``range`` of global layer indices.

    Raises:
        ConfigError: a count is not positive, the rank is out of range, or
            ``pp_size > num_layers`` (some rank would hold no layer).
    """
    _require_positive("num_layers", num_layers)
    _require_positive("pp_size", pp_size)
    _require_rank("pp_rank", pp_rank, pp_size)
    if pp_size > num_layers:
        raise ConfigError(f"pp_size {pp_size} exceeds num_layers {num_layers}")
    base, num_longer = divmod(num_layers, pp_size)
    # Ranks below num_longer hold base + 1 layers, the rest hold base.
    start = pp_rank * base + min(pp_rank, num_longer)
    return range(start, start + base + (1 if pp_rank < num_longer else 0))


@dataclass(frozen=True, slots=True)
class EngineTopology:
    """Static parallel and cache description of one engine. Validated on creation.

    Attributes:
        tp_size: Tensor-parallel size.
        pp_size: Pipeline-parallel size.
        block_size: Tokens per KV cache block.
        num_kv_heads: Model-wide KV heads (not per rank); 1 for MLA.
        is_mla: Whether the cache holds an MLA latent instead of K and V.
        layout: Token/head order inside a block (a ``str`` is parsed).
        num_layers: Model-wide number of attention layers.
        fused_kv: The cache is one plane per layer holding K and V of each head
            together, ``[num_blocks, num_heads, block_size, 2 * head_dim]`` as
            vLLM's CPU attention backend keeps it: per block and head, K
            *transposed* (``[head_dim, block_size]``) then V (``[block_size,
            head_dim]``), one run of ``2 * block_size * head_dim`` elements,
            heads outer (HND). Heads split over TP ranks as usual, but K is not
            token-major, so such blocks move only whole, never re-blocked or
            relaid out.
        split_kv: Every entry of the engine's layer list is ONE plane, K or V
            alone, ``[num_blocks, block_size, num_heads, head_dim]`` (NHD), as
            SGLang keeps them: the list alternates K of layer 0, V of layer 0,
            K of layer 1, ..., and ``num_layers`` counts these planes (twice
            the model's attention layers). kvbridge never pairs them: PP
            splits this list as it is, and an even count is the engine's
            business. Token-major like any NHD cache: heads split over TP,
            block sizes convert and reads may start inside a block.

    Raises:
        ConfigError: a size is not positive, ``tp_size`` and ``num_kv_heads``
            do not divide one another, ``pp_size > num_layers``, an MLA
            engine declares more than one KV head, ``fused_kv`` with MLA or
            with a layout other than HND, or ``split_kv`` with MLA, with
            ``fused_kv`` or with a layout other than NHD.
    """

    tp_size: int
    pp_size: int
    block_size: int
    num_kv_heads: int
    is_mla: bool
    layout: KVLayout
    num_layers: int
    fused_kv: bool = False
    split_kv: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", KVLayout.parse(self.layout))
        for name in ("tp_size", "pp_size", "block_size", "num_kv_heads", "num_layers"):
            _require_positive(name, getattr(self, name))
        if self.is_mla and self.num_kv_heads != 1:
            raise ConfigError(
                f"an MLA cache holds one latent per token: num_kv_heads must be 1, "
                f"got {self.num_kv_heads}"
            )
        if self.fused_kv and (self.is_mla or self.layout is not KVLayout.HND):
            raise ConfigError(
                f"a fused K/V cache (vLLM CPU) keeps heads outer in each block: it needs "
                f"layout HND and no MLA, got layout {self.layout}, is_mla {self.is_mla}"
            )
        if self.split_kv and (self.is_mla or self.fused_kv or self.layout is not KVLayout.NHD):
            raise ConfigError(
                f"a split K/V cache (one K or V plane per layer entry, SGLang) is token-major: "
                f"it needs layout NHD, no MLA and no fused K/V, got layout {self.layout}, "
                f"is_mla {self.is_mla}, fused_kv {self.fused_kv}"
            )
        big, small = max(self.tp_size, self.num_kv_heads), min(self.tp_size, self.num_kv_heads)
        if big % small:
            raise ConfigError(
                f"tp_size {self.tp_size} and num_kv_heads {self.num_kv_heads}: "
                f"neither divides the other"
            )
        if self.pp_size > self.num_layers:
            raise ConfigError(f"pp_size {self.pp_size} exceeds num_layers {self.num_layers}")

    @property
    def world_size(self) -> int:
        """Number of workers: ``tp_size * pp_size``."""
        return self.tp_size * self.pp_size

    @property
    def num_heads_per_rank(self) -> int:
        """KV heads in each rank's cache tensor (1 when replicated)."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def is_kv_replicated(self) -> bool:
        """True when TP exceeds the KV head count, so several ranks hold each head."""
        return self.tp_size > self.num_kv_heads

    @property
    def replicates_kv_cache(self) -> bool:
        """True when ranks hold identical KV: MLA always, otherwise ``is_kv_replicated``."""
        return self.is_mla or self.is_kv_replicated

    def global_rank(self, tp_rank: int, pp_rank: int) -> int:
        """Worker index ``pp_rank * tp_size + tp_rank``.

        Raises:
            ConfigError: a rank is out of range.
        """
        _require_rank("tp_rank", tp_rank, self.tp_size)
        _require_rank("pp_rank", pp_rank, self.pp_size)
        return pp_rank * self.tp_size + tp_rank

    def heads_of(self, tp_rank: int) -> range:
        """Global KV heads held by ``tp_rank`` (see :func:`heads_for_tp_rank`)."""
        return heads_for_tp_rank(self.num_kv_heads, self.tp_size, tp_rank)

    def layers_of(self, pp_rank: int) -> range:
        """Global layers held by ``pp_rank`` (see :func:`layers_for_pp_rank`)."""
        return layers_for_pp_rank(self.num_layers, self.pp_size, pp_rank)
