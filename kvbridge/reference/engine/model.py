"""Llama-style decoder of the reference engine, sharded for tensor parallelism.

Embedding -> L x [RMSNorm -> GQA attention (rotary) -> residual, RMSNorm ->
SwiGLU MLP -> residual] -> RMSNorm -> LM head. Layers are plain tensors and
functions (inference only, no autograd, no ``nn.Module``).

Tensor parallelism, TP size ``t`` on rank ``r``::

    q_proj, k_proj, v_proj, gate_proj, up_proj   column-parallel: rows of this rank's
                                                 heads / intermediate slice
    o_proj, down_proj                            row-parallel: matching columns,
                                                 partial sums all-reduced
    embedding, norms, lm_head                    replicated

KV heads follow :func:`kvbridge.topology.heads_for_tp_rank` (split when
``t <= num_kv_heads``, replicated otherwise) so the engine's caches hold exactly
the heads the transfer topology expects. The model runner owns one instance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbridge.reference.engine.attention import AttentionMetadata, paged_attention
from kvbridge.reference.engine.model_config import ModelConfig
from kvbridge.reference.engine.parallel import TensorParallel
from kvbridge.reference.engine.weights import check_weights
from kvbridge.topology import heads_for_tp_rank

_ALL = slice(None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension, computed in float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


class RotaryEmbedding:
    """Rotary position embedding, "rotate half" convention (Llama checkpoints).

    Pairs ``(i, i + D/2)`` of each head are rotated by ``position * theta^(-2i/D)``.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, device: torch.device):
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().float().to(device)  # [max_positions, D/2]
        self.sin = angles.sin().float().to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[T, H, D]``) by each token's position (``[T]``)."""
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        first, second = x.float().chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.to(x.dtype)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's local (sharded) weights."""

    input_norm: torch.Tensor
    qkv_proj: torch.Tensor  # [q_local + 2 * kv_local, hidden], fused column-parallel
    o_proj: torch.Tensor  # [hidden, q_local], row-parallel
    post_norm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * inter_local, hidden], fused column-parallel
    down_proj: torch.Tensor  # [hidden, inter_local], row-parallel


class DecoderModel:
    """The sharded decoder of one TP rank.

    Args:
        config: Model shape.
        tp: This rank's tensor-parallel view.
        weights: FULL (unsharded) weights, e.g. from ``init_weights``; this rank
            keeps copies of its slices on ``device``.
        device: Where weights and activations live.

    Raises:
        ConfigError: the model does not split over ``tp.size`` ranks, or the
            weights are missing or misshaped.
    """

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
    ) -> None:
        config.check_tp_size(tp.size)
        check_weights(weights, config)
        self.config = config
        self.tp = tp
        self.device = device
        self.q_heads = tp.shard(config.num_heads, "num_heads")
        self.kv_heads = heads_for_tp_rank(config.num_kv_heads, tp.size, tp.rank)
        self.inter = tp.shard(config.intermediate_size, "intermediate_size")
        self.scale = config.head_dim**-0.5
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, device
        )
        self.embed = self._local(weights, "model.embed_tokens.weight")
        self.final_norm = self._local(weights, "model.norm.weight")
        self.lm_head = self._local(weights, "lm_head.weight")
        self.layers = [self._shard_layer(weights, i) for i in range(config.num_layers)]

    @property
    def num_local_q_heads(self) -> int:
        """Query heads on this rank."""
        return len(self.q_heads)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads on this rank (the cache's head dimension)."""
        return len(self.kv_heads)

    def _local(
        self,
        weights: Mapping[str, torch.Tensor],
        name: str,
        rows: slice = _ALL,
        cols: slice = _ALL,
    ) -> torch.Tensor:
        """This rank's ``[rows, cols]`` slice of a full weight, on the model's device."""
        part = weights[name][rows, cols] if weights[name].dim() == 2 else weights[name][rows]
        return part.to(device=self.device, dtype=self.config.torch_dtype).contiguous()

    def _shard_layer(self, weights: Mapping[str, torch.Tensor], layer: int) -> LayerWeights:
        p = f"model.layers.{layer}."
        d = self.config.head_dim
        q_rows = slice(self.q_heads.start * d, self.q_heads.stop * d)
        kv_rows = slice(self.kv_heads.start * d, self.kv_heads.stop * d)
        inter = slice(self.inter.start, self.inter.stop)
        qkv = (
            self._local(weights, p + "self_attn.q_proj.weight", q_rows),
            self._local(weights, p + "self_attn.k_proj.weight", kv_rows),
            self._local(weights, p + "self_attn.v_proj.weight", kv_rows),
        )
        gate_up = (
            self._local(weights, p + "mlp.gate_proj.weight", inter),
            self._local(weights, p + "mlp.up_proj.weight", inter),
        )
        return LayerWeights(
            input_norm=self._local(weights, p + "input_layernorm.weight"),
            qkv_proj=torch.cat(qkv),
            o_proj=self._local(weights, p + "self_attn.o_proj.weight", _ALL, q_rows),
            post_norm=self._local(weights, p + "post_attention_layernorm.weight"),
            gate_up_proj=torch.cat(gate_up),
            down_proj=self._local(weights, p + "mlp.down_proj.weight", _ALL, inter),
        )

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the step's tokens through every layer, reading and writing the caches.

        Args:
            token_ids: int64 ``[T]``.
            positions: int64 ``[T]`` position of each token in its sequence.
            kv_caches: One cache tensor per layer (modified in place).
            metadata: Slots and sequences of the step.

        Returns:
            Final-normed hidden states ``[T, hidden]`` (replicated on all ranks).
        """
        hidden = F.embedding(token_ids, self.embed)
        eps = self.config.rms_norm_eps
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            attn = self._attention(
                rms_norm(hidden, layer.input_norm, eps), positions, layer, kv_cache, metadata
            )
            hidden = hidden + attn
            hidden = hidden + self._mlp(rms_norm(hidden, layer.post_norm, eps), layer)
        return rms_norm(hidden, self.final_norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[S, vocab]`` of final hidden states ``[S, hidden]``."""
        return F.linear(hidden, self.lm_head).float()

    def _attention(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        layer: LayerWeights,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, d = x.shape[0], self.config.head_dim
        q_width, kv_width = self.num_local_q_heads * d, self.num_local_kv_heads * d
        qkv = F.linear(x, layer.qkv_proj)
        q, k, v = torch.split(qkv, [q_width, kv_width, kv_width], dim=-1)
        q = self.rotary.apply(q.reshape(num_tokens, -1, d), positions)
        k = self.rotary.apply(k.reshape(num_tokens, -1, d), positions)
        v = v.reshape(num_tokens, -1, d)
        out = paged_attention(q, k, v, kv_cache, metadata, self.scale)
        return self.tp.all_reduce(F.linear(out.reshape(num_tokens, q_width), layer.o_proj))

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up_proj).chunk(2, dim=-1)
        return self.tp.all_reduce(F.linear(F.silu(gate) * up, layer.down_proj))
