"""Configuration of one ``LLMEngine``: model, parallelism, KV cache sizing, batching, connector.

``EngineConfig`` is frozen and validated on creation; the CLI (``kvbridge serve``)
builds one from flags and tests build small ones. :func:`kv_cache_config_for`
sizes the paged cache with ``kvbridge/reference/paged/sizing.py`` from either a block
count or a byte budget per TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from kvbridge.errors import ConfigError
from kvbridge.reference.engine.model_config import ModelConfig, get_model_config
from kvbridge.reference.engine.remote_kv import LoadFailurePolicy
from kvbridge.reference.engine.runner import kv_block_nbytes
from kvbridge.reference.paged.kv_cache_config import KVCacheConfig
from kvbridge.reference.paged.sizing import RequestLimits, get_kv_cache_config
from kvbridge.reference.paged.spec import FullAttentionSpec, KVCacheSpec
from kvbridge.topology import KVLayout
from kvbridge.transfer.agent_config import AgentConfig

__all__ = ["ConnectorSettings", "EngineConfig", "EngineRole", "kv_cache_config_for"]

#: KV cache bytes per TP rank when neither a block count nor a budget is given.
DEFAULT_KV_MEMORY_NBYTES = 128 << 20


class EngineRole(StrEnum):
    """What an instance is deployed as. Any instance can serve both halves per
    request (the proxy decides); the role is reported and passed to the connector."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """How this engine's connector reaches and is reached by peers.

    Attributes:
        engine_id: This engine's id, unique in the cluster.
        host: Address the transfer agents advertise, and listen on unless
            ``listen_host`` says otherwise.
        listen_host: Address the agents bind instead (``"0.0.0.0"``: every
            interface, for an advertised address translated by NAT).
        transfer_base_port: TP rank ``r``'s agent listens on ``base + r``; this
            is also the port P names in its ``kv_transfer_params``.
        secret: Cluster secret for the handshake HMAC. ``None``: ``$KVBRIDGE_SECRET``,
            else (unless ``insecure``) this user's host secret on a loopback
            ``host`` (``kvbridge/transfer/protocol/cluster_secret.py``); a
            non-loopback ``host`` then refuses to start.
        insecure: With no secret, run without authentication (logged at every start).
        lease_s: How long P keeps a finished request's blocks for readers.
        max_held_share: Share of P's KV cache blocks that finished prefills
            held for readers may take; beyond it the oldest holds are revoked.
        load_failure_policy: ``recompute`` (roll back to the first bad block)
            or ``fail`` (the request fails with an error).
        host_buffer: Stage transfers through a host copy of the cache.
        agent: Transfer agent timeouts and buffer sizes (``None``: defaults).

    Raises:
        ConfigError: empty id or host, a port outside ``[1, 65535]``, a
            non-positive lease, a held share outside ``(0, 1]`` or an unknown policy.
    """

    engine_id: str
    transfer_base_port: int
    host: str = "127.0.0.1"
    secret: bytes | None = None
    insecure: bool = False
    listen_host: str | None = None
    lease_s: float = 30.0
    max_held_share: float = 0.5
    load_failure_policy: LoadFailurePolicy = "recompute"
    host_buffer: bool = False
    agent: AgentConfig | None = None

    def __post_init__(self) -> None:
        if not self.engine_id or not self.host:
            raise ConfigError(f"connector engine_id ({self.engine_id!r}) and host "
                              f"({self.host!r}) must be non-empty")
        if not 1 <= self.transfer_base_port <= 65535:
            raise ConfigError(f"transfer_base_port {self.transfer_base_port} outside [1, 65535]")
        if not self.lease_s > 0:
            raise ConfigError(f"lease_s must be > 0, got {self.lease_s}")
        if not 0 < self.max_held_share <= 1:
            raise ConfigError(f"max_held_share must be in (0, 1], got {self.max_held_share}")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(f"load_failure_policy must be 'recompute' or 'fail', got "
                              f"{self.load_failure_policy!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an ``LLMEngine`` is built from.

    Attributes:
        model: Preset name (``tiny``, ``small``) or a ``ModelConfig``.
        tp_size: Tensor-parallel worker processes.
        block_size: Tokens per KV cache block.
        num_blocks: KV cache blocks (per rank; every rank has the same count).
        kv_memory_nbytes: KV cache bytes per rank, used when ``num_blocks`` is
            ``None`` (default :data:`DEFAULT_KV_MEMORY_NBYTES`).
        kv_layout: Cache layout of every layer; ``None`` picks the connector's
            preferred layout (HND) with a connector, else NHD.
        max_model_len: Longest request; ``None`` keeps the model's.
        max_num_batched_tokens: Token budget of one step.
        max_num_seqs: Most requests running at once.
        enable_chunked_prefill: Split long prompts over steps.
        enable_prefix_caching: Reuse cached prompt blocks.
        role: Deployment role (reported; passed to the connector).
        connector: Connector settings; ``None`` runs colocated only.
        weights_dir: Llama safetensors directory; ``None`` uses seeded weights.
        device: ``cpu`` or ``cuda``.
        hash_fn_name: Block hash function (P and D must agree).
        hash_seed: Block hash seed (P and D must agree).
        in_process: Run a TP-1 worker in the engine's own process (no spawn).
        step_timeout_s: Limit on one worker step.

    Raises:
        ConfigError: inconsistent sizes, a model that does not split over
            ``tp_size``, or both or neither sizing knob invalid.
    """

    model: str | ModelConfig = "tiny"
    tp_size: int = 1
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_nbytes: int | None = None
    kv_layout: KVLayout | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    role: EngineRole = EngineRole.BOTH
    connector: ConnectorSettings | None = None
    weights_dir: str | None = None
    device: str = "cpu"
    hash_fn_name: str = "sha256"
    hash_seed: bytes = b"kvbridge"
    in_process: bool = False
    step_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        layout = KVLayout.NHD
        if self.kv_layout is not None:
            layout = KVLayout.parse(self.kv_layout)
        elif self.connector is not None:
            from kvbridge.connector.worker import ConnectorWorker

            layout = ConnectorWorker.prefers_layout()
        object.__setattr__(self, "kv_layout", layout)
        object.__setattr__(self, "role", EngineRole(self.role))
        model = self.model_config()  # raises for unknown presets
        model.check_tp_size(self.tp_size)
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError(f"block_size {self.block_size}, max_num_seqs {self.max_num_seqs} "
                              f"and max_num_batched_tokens {self.max_num_batched_tokens} "
                              f"must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (one is the null block), "
                              f"got {self.num_blocks}")
        if self.kv_memory_nbytes is not None and self.kv_memory_nbytes < 1:
            raise ConfigError(f"kv_memory_nbytes must be >= 1, got {self.kv_memory_nbytes}")
        if self.in_process and self.tp_size != 1:
            raise ConfigError(f"in_process needs tp_size 1, got {self.tp_size}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < model.max_model_len:
            raise ConfigError(f"without chunked prefill max_num_batched_tokens "
                              f"({self.max_num_batched_tokens}) must be >= max_model_len "
                              f"({model.max_model_len})")

    @property
    def layout(self) -> KVLayout:
        """The resolved cache layout."""
        assert self.kv_layout is not None  # resolved in __post_init__
        return self.kv_layout

    def model_config(self) -> ModelConfig:
        """The model, with ``max_model_len`` applied.

        Raises:
            ConfigError: unknown preset or a bad ``max_model_len``.
        """
        model = get_model_config(self.model) if isinstance(self.model, str) else self.model
        if self.max_model_len is not None and self.max_model_len != model.max_model_len:
            model = replace(model, max_model_len=self.max_model_len)
        return model

    def kv_cache_config(self) -> KVCacheConfig:
        """The sized paged cache of one rank (see :func:`kv_cache_config_for`)."""
        return kv_cache_config_for(self.model_config(), self.tp_size, self.block_size,
                                   self.max_num_batched_tokens, num_blocks=self.num_blocks,
                                   kv_memory_nbytes=self.kv_memory_nbytes)


def kv_cache_config_for(
    model: ModelConfig,
    tp_size: int,
    block_size: int,
    max_num_batched_tokens: int,
    *,
    num_blocks: int | None = None,
    kv_memory_nbytes: int | None = None,
) -> KVCacheConfig:
    """Size one rank's KV cache: one full-attention group of all layers.

    Args:
        model: The model (its ``max_model_len`` must fit at least once).
        tp_size: TP size (KV heads are split, or replicated, over ranks).
        block_size: Tokens per block.
        max_num_batched_tokens: Step budget (enters the per-request bound).
        num_blocks: Exact block count; wins over ``kv_memory_nbytes``.
        kv_memory_nbytes: Byte budget per rank (default
            :data:`DEFAULT_KV_MEMORY_NBYTES`).

    Returns:
        The config for ``KVCacheManager``; its ``num_blocks`` is what each
        worker allocates.

    Raises:
        ConfigError: the cache cannot hold one ``max_model_len`` request.
    """
    heads_per_rank = max(1, model.num_kv_heads // tp_size)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads_per_rank,
                             head_size=model.head_dim, dtype=model.torch_dtype)
    specs: dict[str, KVCacheSpec] = {f"layers.{i}": spec for i in range(model.num_layers)}
    limits = RequestLimits(max_model_len=model.max_model_len,
                           max_num_batched_tokens=max_num_batched_tokens)
    if num_blocks is not None:
        available = num_blocks * kv_block_nbytes(model, tp_size, block_size)
    else:
        available = kv_memory_nbytes or DEFAULT_KV_MEMORY_NBYTES
    return get_kv_cache_config(specs, available, limits, num_blocks_override=num_blocks)
