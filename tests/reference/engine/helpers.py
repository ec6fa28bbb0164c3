"""Shared helpers of the engine tests: small configs and a greedy generation loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvbridge.reference.engine.model_config import get_model_config
from kvbridge.reference.engine.runner import ModelRunner, RequestStep, StepBatch
from kvbridge.reference.engine.sampling import SamplerParams
from kvbridge.reference.engine.workers import WorkerGroup

TINY = get_model_config("tiny")

#: Two layers and a short max length: fast enough for property-style loops.
MICRO = dataclasses.replace(TINY, name="micro", num_layers=2, max_model_len=256)

#: One KV head shared by all query heads: with TP 2 the head is replicated.
MQA = dataclasses.replace(TINY, name="mqa", num_layers=2, num_kv_heads=1, max_model_len=256)

PROMPTS = [
    list(range(1, 8)),  # shorter than a block
    [256, *b"The quick brown fox jumps over the lazy dog, again and again."],
    [256, *b"0123456789" * 5],
]


def generate(
    engine: ModelRunner | WorkerGroup,
    prompt: Sequence[int],
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    chunk: int | None = None,
    start_pos: int = 0,
    sampling: SamplerParams | None = None,
    req_id: str = "r",
) -> list[int]:
    """Prefill ``prompt[start_pos:]`` (in chunks of ``chunk``) then decode greedily.

    Returns:
        ``num_tokens`` generated tokens (the first one sampled after the prompt).
    """
    params = sampling or SamplerParams()
    chunk = chunk or len(prompt)
    pos = start_pos
    out: list[int] = []
    while pos < len(prompt):
        ids = list(prompt[pos : pos + chunk])
        last = pos + len(ids) == len(prompt)
        out = engine.execute(
            StepBatch([RequestStep(req_id, ids, pos, list(block_ids), last, params)])
        )
        pos += len(ids)
    while len(out) < num_tokens:
        out += engine.execute(
            StepBatch([RequestStep(req_id, [out[-1]], pos, list(block_ids), True, params)])
        )
        pos += 1
    return out
