"""Model runner: one TP rank's model, its paged KV caches, and one batch step.

The scheduler decides what runs; every step it sends the same :class:`StepBatch`
to all TP ranks (via :class:`kvbridge.reference.engine.workers.WorkerGroup`). Each rank's
:class:`ModelRunner` builds the slot mapping from the requests' block ids, runs
the sharded model (writing the new tokens' K/V into its caches) and samples the
requests that asked for a token. A batch carries everything a step needs (block
ids, start positions), so the runner keeps no per-request state: a request
whose earlier KV was copied into the caches by the transfer layer simply starts
at a later position.

``ModelRunner.kv_caches`` is public: the connector worker and the transfer agent
register, read and write those tensors directly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.reference.engine.attention import AttentionMetadata, SequenceSlice, kv_cache_shape
from kvbridge.reference.engine.model import DecoderModel
from kvbridge.reference.engine.model_config import ModelConfig
from kvbridge.reference.engine.parallel import TensorParallel
from kvbridge.reference.engine.sampling import SamplerParams, sample
from kvbridge.reference.engine.weights import init_weights, load_safetensors_dir
from kvbridge.reference.paged.block_table import BlockTable, GroupTableSpec
from kvbridge.topology import KVLayout, heads_for_tp_rank
from kvbridge.transfer.host_memory import kv_cache_zeros


class InvalidStepError(KVBridgeError, ValueError):
    """A step batch does not fit the runner (bad ids, positions or sizes)."""


class RequestStep(msgspec.Struct, frozen=True):
    """One request's share of a step.

    Attributes:
        req_id: Request id, unique within the step.
        token_ids: Tokens to run this step (>= 1): a prompt chunk, or the last
            sampled token when decoding.
        start_pos: Position of ``token_ids[0]``, i.e. tokens already in the cache.
        block_ids: The request's block table row; must cover positions
            ``[0, start_pos + len(token_ids))``. Extra trailing blocks are ignored.
        sample: Whether to sample a token after the last of ``token_ids``
            (False for prompt chunks before the last one).
        sampling: How to sample.
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool = True
    sampling: SamplerParams = msgspec.field(default_factory=SamplerParams)

    @property
    def end_pos(self) -> int:
        """Tokens in the cache after this step."""
        return self.start_pos + len(self.token_ids)


class StepBatch(msgspec.Struct, frozen=True):
    """What every TP rank runs in one step, in order.

    Attributes:
        requests: The requests of the step (may be empty).
        step_id: Scheduler's step counter, for logs.
    """

    requests: list[RequestStep]
    step_id: int = 0


@dataclass(frozen=True, slots=True)
class StepLimits:
    """Bounds a step batch must respect; checkable without a model (e.g. by the caller)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    max_num_reqs: int
    max_num_batched_tokens: int

    def check(self, batch: StepBatch) -> None:
        """Validate ``batch``.

        Raises:
            InvalidStepError: too many requests or tokens, a duplicate request
                id, an empty token list, a token id outside the vocabulary, a
                negative start, a sequence beyond ``max_model_len``, too few
                blocks, or a block id outside ``[0, num_blocks)``.
        """
        reqs = batch.requests
        num_tokens = sum(len(r.token_ids) for r in reqs)
        if len(reqs) > self.max_num_reqs or num_tokens > self.max_num_batched_tokens:
            raise InvalidStepError(
                f"step has {len(reqs)} requests / {num_tokens} tokens; limits are "
                f"{self.max_num_reqs} / {self.max_num_batched_tokens}"
            )
        if len({r.req_id for r in reqs}) != len(reqs):
            raise InvalidStepError(f"duplicate request ids in step {batch.step_id}")
        for r in reqs:
            self._check_request(r)

    def _check_request(self, r: RequestStep) -> None:
        if not r.token_ids:
            raise InvalidStepError(f"request {r.req_id!r}: no tokens to run")
        if min(r.token_ids) < 0 or max(r.token_ids) >= self.vocab_size:
            raise InvalidStepError(
                f"request {r.req_id!r}: token ids span [{min(r.token_ids)}, "
                f"{max(r.token_ids)}], vocabulary is [0, {self.vocab_size})"
            )
        if r.start_pos < 0 or r.end_pos > self.max_model_len:
            raise InvalidStepError(
                f"request {r.req_id!r}: positions [{r.start_pos}, {r.end_pos}) outside "
                f"[0, max_model_len {self.max_model_len})"
            )
        if len(r.block_ids) * self.block_size < r.end_pos:
            raise InvalidStepError(
                f"request {r.req_id!r}: {len(r.block_ids)} blocks of {self.block_size} "
                f"cannot hold {r.end_pos} tokens"
            )
        if min(r.block_ids) < 0 or max(r.block_ids) >= self.num_blocks:
            raise InvalidStepError(
                f"request {r.req_id!r}: block ids span [{min(r.block_ids)}, "
                f"{max(r.block_ids)}], cache has {self.num_blocks} blocks"
            )


def kv_block_nbytes(config: ModelConfig, tp_size: int, block_size: int) -> int:
    """Bytes one cache block takes on one TP rank, over all layers, K and V.

    Raises:
        ConfigError: the model does not split over ``tp_size``.
    """
    config.check_tp_size(tp_size)
    num_heads = max(1, config.num_kv_heads // tp_size)
    itemsize = torch.empty((), dtype=config.torch_dtype).element_size()
    return 2 * config.num_layers * block_size * num_heads * config.head_dim * itemsize


class ModelRunner:
    """One TP rank: sharded model, per-layer paged KV caches, step execution.

    Args:
        model_config: Model to run.
        tp_rank: This rank.
        tp_size: TP size.
        group: Process group of the TP ranks (``None`` when ``tp_size == 1``).
        num_blocks: Cache blocks to allocate (per layer).
        block_size: Tokens per block.
        layout: Cache layout (a ``str`` is parsed).
        device: Device of the model and caches.
        weights: Full weights, a directory of safetensors, or ``None`` for the
            config's seeded weights.
        max_num_reqs: Most requests in one step.
        max_num_batched_tokens: Most tokens in one step (default ``max_model_len``).

    Raises:
        ConfigError: bad sizes, a model that does not split over ``tp_size``, or
            unusable weights.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None,
        num_blocks: int,
        block_size: int,
        layout: KVLayout | str,
        device: torch.device | str = "cpu",
        *,
        weights: Mapping[str, torch.Tensor] | str | Path | None = None,
        max_num_reqs: int = 256,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"num_blocks {num_blocks} and block_size {block_size} must be >= 1")
        self.model_config = model_config
        self.tp = TensorParallel(tp_rank, tp_size, group)
        self.layout = KVLayout.parse(layout)
        self.device = torch.device(device)
        self.limits = StepLimits(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.vocab_size,
            max_num_reqs=max_num_reqs,
            max_num_batched_tokens=max_num_batched_tokens or model_config.max_model_len,
        )
        if weights is None:
            weights = init_weights(model_config)
        elif isinstance(weights, str | Path):
            weights = load_safetensors_dir(weights, model_config)
        self.model = DecoderModel(model_config, self.tp, weights, self.device)
        self.kv_heads = heads_for_tp_rank(model_config.num_kv_heads, tp_size, tp_rank)
        shape = kv_cache_shape(
            self.layout, num_blocks, block_size, len(self.kv_heads), model_config.head_dim
        )
        self.kv_caches: list[torch.Tensor] = [  # huge pages on the host: paged/host_memory.py
            kv_cache_zeros(shape, model_config.torch_dtype, self.device)
            for _ in range(model_config.num_layers)
        ]
        self._table = BlockTable(
            GroupTableSpec.for_max_model_len(block_size, model_config.max_model_len),
            max_num_reqs=max_num_reqs,
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            device=self.device,
        )
        self._unseeded = torch.Generator(device=self.device)
        self._unseeded.manual_seed(int.from_bytes(os.urandom(8), "little"))

    @property
    def num_blocks(self) -> int:
        """Blocks per layer cache."""
        return self.limits.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.limits.block_size

    def execute(self, batch: StepBatch) -> list[int]:
        """Run one step: write the new tokens' K/V into the caches and sample.

        Args:
            batch: The step (identical on every TP rank).

        Returns:
            One sampled token id per request with ``sample=True``, in batch order.

        Raises:
            InvalidStepError: ``batch`` breaks :class:`StepLimits`; nothing ran.
        """
        self.limits.check(batch)
        if not batch.requests:
            return []
        with torch.no_grad():
            token_ids, positions, metadata = self._prepare(batch.requests)
            hidden = self.model.forward(token_ids, positions, self.kv_caches, metadata)
            sampled = [r for r in batch.requests if r.sample]
            if not sampled:
                return []
            last_rows = [
                seq.query_start + seq.num_query_tokens - 1
                for seq, r in zip(metadata.sequences, batch.requests, strict=True)
                if r.sample
            ]
            logits = self.model.compute_logits(hidden[last_rows])
            return sample(
                logits, [r.sampling for r in sampled], [r.end_pos for r in sampled], self._unseeded
            )

    def _prepare(
        self, reqs: Sequence[RequestStep]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the step's tokens and build slots and per-sequence block rows."""
        bs = self.block_size
        lens = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)
        starts = np.array([r.start_pos for r in reqs], dtype=np.int64)
        query_starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        # Position of step token t of request i: starts[i] + (t - query_starts[i]).
        req_indices = np.repeat(np.arange(len(reqs)), lens)
        positions = starts[req_indices] + np.arange(int(lens.sum())) - query_starts[req_indices]
        num_blocks_used = [math.ceil(r.end_pos / bs) for r in reqs]
        for row, (r, n) in enumerate(zip(reqs, num_blocks_used, strict=True)):
            self._table.add_row(r.block_ids[:n], row)
        self._table.compute_slot_mapping(req_indices, positions)
        self._table.commit_block_table(len(reqs))
        self._table.commit_slot_mapping(positions.shape[0])
        rows = self._table.block_ids_device
        sequences = [
            SequenceSlice(
                query_start=int(query_starts[i]),
                num_query_tokens=int(lens[i]),
                context_len=r.end_pos,
                block_ids=rows[i, : num_blocks_used[i]].long(),
            )
            for i, r in enumerate(reqs)
        ]
        metadata = AttentionMetadata(
            slot_mapping=self._table.slot_mapping_device[: positions.shape[0]].clone(),
            sequences=sequences,
            block_size=bs,
            layout=self.layout,
        )
        token_ids = torch.tensor(
            [t for r in reqs for t in r.token_ids], dtype=torch.long, device=self.device
        )
        return token_ids, torch.from_numpy(positions).to(self.device), metadata
