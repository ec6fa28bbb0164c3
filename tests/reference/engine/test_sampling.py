"""Tests for kvbridge.reference.engine.sampling: greedy, seeded draws, top-p, parameter checks."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from kvbridge.reference.engine.request import SamplingParams
from kvbridge.reference.engine.sampling import SamplerParams, sample, token_seed, top_p_filter


def unseeded() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax() -> None:
    logits = random_logits(6)
    tokens = sample(logits, [SamplerParams()] * 6, list(range(6)), unseeded())
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_draw_depends_only_on_seed_position_and_logits() -> None:
    logits = random_logits(1)
    params = SamplerParams(temperature=1.5, seed=7)
    alone = [sample(logits, [params], [pos], unseeded())[0] for pos in range(40)]
    # Same request at the same positions, now behind other rows and with another
    # unseeded generator state: identical tokens.
    others = random_logits(3, seed=9)
    batched = [
        sample(
            torch.cat([others, logits]),
            [SamplerParams(temperature=1.0)] * 3 + [params],
            [5, 6, 7, pos],
            torch.Generator().manual_seed(pos),
        )[3]
        for pos in range(40)
    ]
    assert batched == alone
    assert len(set(alone)) > 5  # really random, not greedy
    other_seed = [
        sample(logits, [SamplerParams(temperature=1.5, seed=8)], [pos], unseeded())[0]
        for pos in range(40)
    ]
    assert other_seed != alone


def test_seeded_draws_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.75, 0.25]]))
    params = SamplerParams(temperature=1.0, seed=3)
    draws = [sample(logits, [params], [pos], unseeded())[0] for pos in range(2000)]
    assert abs(draws.count(0) / len(draws) - 0.75) < 0.04


def test_token_seed_spreads_neighbours() -> None:
    seeds = {token_seed(seed, pos) for seed in range(20) for pos in range(50)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**64 for s in seeds)


def test_top_p_filter_keeps_the_smallest_top_set() -> None:
    probs = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(top_p_filter(probs, 0.6), torch.tensor([0.0, 0.625, 0.375]))
    torch.testing.assert_close(top_p_filter(probs, 0.5), torch.tensor([0.0, 1.0, 0.0]))
    assert top_p_filter(probs, 1.0) is probs
    # Tiny top_p makes seeded sampling greedy.
    logits = random_logits(4)
    params = [SamplerParams(temperature=1.0, top_p=1e-6, seed=s) for s in range(4)]
    assert sample(logits, params, [0, 1, 2, 3], unseeded()) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params_type", [SamplerParams, SamplingParams])
@pytest.mark.parametrize(
    "kwargs", [{"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_invalid_params_raise(
    params_type: type[SamplerParams | SamplingParams], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError):
        params_type(**kwargs)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(kwargs), type=params_type)


def test_request_params_give_the_sampler_its_fields_only() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=3, ignore_eos=True)
    assert params.sampler_params() == SamplerParams(temperature=0.7, top_p=0.9, seed=5)
    assert not isinstance(params, SamplerParams)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_row_count_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="2 logit rows"):
        sample(random_logits(2), [SamplerParams()], [0, 1], unseeded())
