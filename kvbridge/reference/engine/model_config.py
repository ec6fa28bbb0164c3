"""Model shapes of the reference engine: frozen ``ModelConfig`` and the named presets.

Everything that sizes the model, its weights and its KV cache comes from one
``ModelConfig``. The presets are small enough to run on a CPU (``tiny`` in float32
so that TP=1 and TP=2 agree to float rounding). The runner, the weight loader, the
tokenizer and later the CLI (``--model tiny``) read these; nothing mutates them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from kvbridge.errors import ConfigError

_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)

#: Byte-level vocabulary: 256 byte ids, then BOS, EOS and PAD.
NUM_BYTE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-style decoder. Validated on creation.

    Attributes:
        name: Preset name (``tiny``, ``small``) or a free label.
        num_layers: Decoder layers.
        hidden_size: Residual stream width.
        num_heads: Query heads (model-wide).
        num_kv_heads: Key/value heads (model-wide); divides ``num_heads`` (GQA).
        head_dim: Width of one head; even (rotary rotates pairs).
        intermediate_size: SwiGLU inner width.
        vocab_size: Embedding rows; the byte tokenizer needs at least 259.
        rope_theta: Rotary base.
        rms_norm_eps: RMSNorm epsilon.
        max_model_len: Longest sequence (prompt + output) in tokens.
        dtype: Weight, activation and KV cache dtype name (``float32``...).
        seed: Seed of the random weights (ignored when loading safetensors).
        bos_token_id: Begin-of-sequence token.
        eos_token_id: End-of-sequence token.
        pad_token_id: Padding token.

    Raises:
        ConfigError: a size is not positive, ``num_kv_heads`` does not divide
            ``num_heads``, ``head_dim`` is odd, a special token id lies outside
            the vocabulary, or ``dtype`` is unknown.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = NUM_BYTE_TOKENS + 3
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_model_len: int = 2048
    dtype: str = "float32"
    seed: int = 0
    bos_token_id: int = NUM_BYTE_TOKENS
    eos_token_id: int = NUM_BYTE_TOKENS + 1
    pad_token_id: int = NUM_BYTE_TOKENS + 2

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_model_len",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError(
                f"rope_theta {self.rope_theta} and rms_norm_eps {self.rms_norm_eps} must be > 0"
            )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token_id = getattr(self, name)
            if not 0 <= token_id < self.vocab_size:
                raise ConfigError(f"{name} {token_id} outside vocabulary [0, {self.vocab_size})")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch dtype."""
        return _DTYPES[self.dtype]

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Width of all query heads together."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads together."""
        return self.num_kv_heads * self.head_dim

    def check_tp_size(self, tp_size: int) -> None:
        """Check that the model splits over ``tp_size`` ranks.

        Query heads and the MLP split evenly; KV heads split evenly when
        ``tp_size <= num_kv_heads`` and are replicated when ``tp_size`` is a
        multiple of ``num_kv_heads``.

        Raises:
            ConfigError: ``tp_size`` < 1 or one of the splits above is uneven.
        """
        if tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
        big, small = max(tp_size, self.num_kv_heads), min(tp_size, self.num_kv_heads)
        if self.num_heads % tp_size or self.intermediate_size % tp_size or big % small:
            raise ConfigError(
                f"tp_size {tp_size} does not split num_heads {self.num_heads}, "
                f"intermediate_size {self.intermediate_size} and num_kv_heads "
                f"{self.num_kv_heads} evenly"
            )


_PRESETS: Mapping[str, ModelConfig] = MappingProxyType(
    {
        "tiny": ModelConfig(
            name="tiny",
            num_layers=4,
            hidden_size=256,
            num_heads=8,
            num_kv_heads=8,
            head_dim=32,
            intermediate_size=512,
        ),
        "small": ModelConfig(
            name="small",
            num_layers=8,
            hidden_size=512,
            num_heads=16,
            num_kv_heads=8,
            head_dim=32,
            intermediate_size=1408,
            max_model_len=4096,
        ),
    }
)


def model_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_model_config`."""
    return tuple(_PRESETS)


def get_model_config(name: str) -> ModelConfig:
    """Return the preset called ``name``.

    Raises:
        ConfigError: no preset has that name.
    """
    try:
        return _PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; expected one of {list(_PRESETS)}") from None


def config_from_hf(hf_config: Mapping[str, object], name: str = "hf") -> ModelConfig:
    """Build a ``ModelConfig`` from a Llama ``config.json`` dictionary.

    Args:
        hf_config: Parsed ``config.json`` (``hidden_size``, ``num_attention_heads``...).
        name: Label for the result.

    Returns:
        The matching config, float32 unless ``torch_dtype`` names another known dtype.

    Raises:
        ConfigError: a required key is missing or has the wrong type, or the
            resulting config is invalid.
    """

    def get_int(key: str, default: int | None = None) -> int:
        value = hf_config.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.json: {key!r} must be an integer, got {value!r}")
        return value

    hidden = get_int("hidden_size")
    num_heads = get_int("num_attention_heads")
    theta = hf_config.get("rope_theta", 10000.0)
    eps = hf_config.get("rms_norm_eps", 1e-5)
    dtype = hf_config.get("torch_dtype", "float32")
    if not isinstance(theta, int | float) or not isinstance(eps, int | float):
        raise ConfigError(f"config.json: rope_theta {theta!r} / rms_norm_eps {eps!r} not numbers")
    vocab = get_int("vocab_size")
    return ModelConfig(
        name=name,
        num_layers=get_int("num_hidden_layers"),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=get_int("num_key_value_heads", num_heads),
        head_dim=get_int("head_dim", hidden // max(num_heads, 1)),
        intermediate_size=get_int("intermediate_size"),
        vocab_size=vocab,
        rope_theta=float(theta),
        rms_norm_eps=float(eps),
        max_model_len=get_int("max_position_embeddings", 2048),
        dtype=dtype if isinstance(dtype, str) and dtype in _DTYPES else "float32",
        bos_token_id=_special_id(hf_config, "bos_token_id", min(NUM_BYTE_TOKENS, vocab - 1)),
        eos_token_id=_special_id(hf_config, "eos_token_id", min(NUM_BYTE_TOKENS + 1, vocab - 1)),
        pad_token_id=_special_id(hf_config, "pad_token_id", min(NUM_BYTE_TOKENS + 2, vocab - 1)),
    )


def _special_id(hf_config: Mapping[str, object], key: str, default: int) -> int:
    """A special token id; ``config.json`` may hold an int, a list of ints or null."""
    value = hf_config.get(key)
    if isinstance(value, list) and value and isinstance(value[0], int):
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else default
