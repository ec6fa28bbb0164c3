"""Tests for kvbridge.reference.engine.runner: steps, layouts, chunking, the P/D cache property."""

from __future__ import annotations

import pytest

from kvbridge.reference.engine.runner import (
    InvalidStepError,
    ModelRunner,
    RequestStep,
    StepBatch,
    kv_block_nbytes,
)
from kvbridge.reference.engine.sampling import SamplerParams
from kvbridge.topology import KVLayout
from tests.reference.engine.helpers import PROMPTS, TINY, generate

NUM_NEW = 8


def make_runner(
    layout: KVLayout = KVLayout.NHD, block_size: int = 16, num_blocks: int = 32
) -> ModelRunner:
    return ModelRunner(TINY, 0, 1, None, num_blocks, block_size, layout)


def blocks_for(num_tokens: int, block_size: int, first: int = 0, stride: int = 3) -> list[int]:
    """Scattered block ids (``first, first + stride, ...``) covering ``num_tokens``."""
    return [first + stride * i for i in range(-(-num_tokens // block_size))]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy continuations of PROMPTS: NHD, block size 16, one-shot prefill."""
    runner = make_runner()
    out = []
    for prompt in PROMPTS:
        out.append(generate(runner, prompt, blocks_for(len(prompt) + NUM_NEW, 16), NUM_NEW))
    return out


def test_generation_is_not_degenerate(reference: list[list[int]]) -> None:
    for tokens in reference:
        assert len(set(tokens)) > 2, tokens
    assert len({tuple(t) for t in reference}) == len(reference)


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("chunk", [None, 5, 16])
def test_layout_block_size_and_chunking_do_not_change_tokens(
    reference: list[list[int]], layout: KVLayout, block_size: int, chunk: int | None
) -> None:
    runner = make_runner(layout, block_size)
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        rows = blocks_for(len(prompt) + NUM_NEW, block_size, first=1, stride=2)
        assert generate(runner, prompt, rows, NUM_NEW, chunk=chunk) == expected


def test_batched_requests_match_running_alone(reference: list[list[int]]) -> None:
    runner = make_runner(num_blocks=64)
    rows = [blocks_for(len(p) + NUM_NEW, 16, first=i, stride=3) for i, p in enumerate(PROMPTS)]
    outs: list[list[int]] = [[] for _ in PROMPTS]
    done = [0] * len(PROMPTS)
    # Prompts advance in chunks of 6; a request decodes while others still prefill.
    while any(len(o) < NUM_NEW for o in outs):
        steps, owners = [], []
        for i, prompt in enumerate(PROMPTS):
            if len(outs[i]) >= NUM_NEW:
                continue
            prefilling = done[i] < len(prompt)
            ids = prompt[done[i] : done[i] + 6] if prefilling else [outs[i][-1]]
            sample = done[i] + len(ids) >= len(prompt)
            steps.append(RequestStep(f"r{i}", ids, done[i], rows[i], sample))
            owners.append(i)
            done[i] += len(ids)
        sampled = iter(runner.execute(StepBatch(steps)))
        for step, i in zip(steps, owners, strict=True):
            if step.sample:
                outs[i].append(next(sampled))
    assert outs == reference


def copy_blocks(src: ModelRunner, dst: ModelRunner, src_ids: list[int], dst_ids: list[int]) -> None:
    """What the transfer layer does: copy whole blocks, layer by layer (relayout if needed)."""
    for src_cache, dst_cache in zip(src.kv_caches, dst.kv_caches, strict=True):
        blocks = src_cache[:, src_ids]
        if src.layout != dst.layout:
            blocks = blocks.transpose(2, 3)  # [2, n, B, H, D] <-> [2, n, H, B, D]
        dst_cache[:, dst_ids] = blocks


@pytest.mark.parametrize(
    ("p_layout", "d_layout"),
    [(KVLayout.NHD, KVLayout.NHD), (KVLayout.HND, KVLayout.HND), (KVLayout.HND, KVLayout.NHD)],
)
def test_copied_cache_continues_like_the_prefill_engine(
    reference: list[list[int]], p_layout: KVLayout, d_layout: KVLayout
) -> None:
    prefill = make_runner(p_layout)
    decode = make_runner(d_layout, num_blocks=40)
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        p_rows = blocks_for(len(prompt), 16, first=2, stride=5)
        first = generate(prefill, prompt, p_rows, 1)  # P: prefill + one token
        d_rows = blocks_for(len(prompt) + NUM_NEW, 16, first=39, stride=-4)
        copy_blocks(prefill, decode, p_rows, d_rows[: len(p_rows)])
        # D never sees the prompt tokens: only the cache and the first token.
        tokens = first + generate(
            decode, [*prompt, first[0]], d_rows, NUM_NEW - 1, start_pos=len(prompt)
        )
        assert tokens == expected


def test_partial_transfer_then_local_recompute(reference: list[list[int]]) -> None:
    prompt, expected = PROMPTS[1], reference[1]
    prefill, decode = make_runner(), make_runner(KVLayout.HND)
    p_rows = blocks_for(len(prompt), 16)
    generate(prefill, prompt, p_rows, 1)
    d_rows = blocks_for(len(prompt) + NUM_NEW, 16, first=30, stride=-3)
    # Only the first full block arrives (e.g. the rest failed): D recomputes from there.
    copy_blocks(prefill, decode, p_rows[:1], d_rows[:1])
    assert generate(decode, prompt, d_rows, NUM_NEW, start_pos=16) == expected


@pytest.mark.parametrize("lost", ["first layer, first block", "last layer, last block"])
def test_the_cache_really_is_the_context(reference: list[list[int]], lost: str) -> None:
    # If the seeded model ignored its cache, the P/D tests above could not fail.
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        prefill, decode = make_runner(), make_runner()
        rows = blocks_for(len(prompt), 16)
        first = generate(prefill, prompt, rows, 1)
        copy_blocks(prefill, decode, rows, rows)
        layer, block = (0, rows[0]) if lost.startswith("first") else (-1, rows[-1])
        decode.kv_caches[layer][:, block] = 0.0
        full_rows = blocks_for(len(prompt) + NUM_NEW, 16)
        rest = generate(decode, [*prompt, first[0]], full_rows, NUM_NEW - 1, start_pos=len(prompt))
        assert first + rest != expected


def test_seeded_sampling_is_reproducible_and_survives_a_split() -> None:
    params = SamplerParams(temperature=1.0, top_p=0.9, seed=42)
    prompt = PROMPTS[2]
    rows = blocks_for(len(prompt) + NUM_NEW, 16)
    colocated = generate(make_runner(), prompt, rows, NUM_NEW, sampling=params)
    assert generate(make_runner(), prompt, rows, NUM_NEW, sampling=params) == colocated
    other = SamplerParams(temperature=1.0, top_p=0.9, seed=43)
    assert generate(make_runner(), prompt, rows, NUM_NEW, sampling=other) != colocated
    prefill, decode = make_runner(), make_runner()
    first = generate(prefill, prompt, rows, 1, sampling=params)
    copy_blocks(prefill, decode, rows, rows)
    rest = generate(
        decode, [*prompt, first[0]], rows, NUM_NEW - 1, start_pos=len(prompt), sampling=params
    )
    assert first + rest == colocated


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (RequestStep("a", [], 0, [0]), "no tokens"),
        (RequestStep("a", [1, 259], 0, [0]), "vocabulary"),
        (RequestStep("a", [1], -1, [0]), "positions"),
        (RequestStep("a", [1], 2048, [0] * 129), "max_model_len"),
        (RequestStep("a", [1] * 17, 0, [0]), "1 blocks of 16 cannot hold 17"),
        (RequestStep("a", [1], 0, [32]), "cache has 32 blocks"),
    ],
)
def test_invalid_steps_raise_and_change_nothing(step: RequestStep, match: str) -> None:
    runner = make_runner()
    good = RequestStep("b", [1, 2, 3], 0, [1])
    with pytest.raises(InvalidStepError, match=match):
        runner.execute(StepBatch([good, step]))
    assert all(cache.abs().sum() == 0 for cache in runner.kv_caches)
    with pytest.raises(InvalidStepError, match="duplicate"):
        runner.execute(StepBatch([good, good]))


def test_sizes() -> None:
    runner = make_runner(KVLayout.HND, block_size=32, num_blocks=8)
    cache = runner.kv_caches[0]
    assert tuple(cache.shape) == (2, 8, TINY.num_kv_heads, 32, TINY.head_dim)
    assert len(runner.kv_caches) == TINY.num_layers
    per_block = sum(c[:, 0].numel() * c.element_size() for c in runner.kv_caches)
    assert kv_block_nbytes(TINY, 1, 32) == per_block
    assert kv_block_nbytes(TINY, 2, 32) == per_block // 2
    assert runner.execute(StepBatch([])) == []
    assert runner.execute(StepBatch([RequestStep("a", [1, 2], 0, [0], sample=False)])) == []
