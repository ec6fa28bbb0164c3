"""Token sampling: greedy, or temperature / top-p with a per-request seed.

A seeded draw depends only on ``(seed, position of the new token)`` and the
logits: the generator is re-seeded for every token instead of carrying state
from step to step. So the same request produces the same tokens whether it runs
on one engine, or is prefilled on P and continued on D, and whatever else is in
the batch. The model runner calls :func:`sample` once per step.

:class:`SamplerParams` are what a step carries to the workers for one request:
the part of a request's :class:`kvbridge.reference.engine.request.SamplingParams` the
sampler reads (the stop conditions stay with the scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

_MASK64 = (1 << 64) - 1


def check_sampler_args(temperature: float, top_p: float) -> None:
    """Validate the sampler's knobs (shared by both parameter classes).

    Raises:
        ValueError: negative (or NaN) temperature, or ``top_p`` outside ``(0, 1]``.
    """
    if not temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class SamplerParams(msgspec.Struct, frozen=True):
    """How the sampler picks one request's next token.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: Keep the smallest set of most likely tokens whose probability
            reaches ``top_p`` (1.0 keeps all).
        seed: Makes random draws reproducible; ``None`` draws from the runner's
            own unseeded generator.

    Raises:
        ValueError: negative temperature or ``top_p`` outside ``(0, 1]``
            (``msgspec.ValidationError`` when decoding).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampler_args(self.temperature, self.top_p)

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax."""
        return self.temperature == 0.0


def token_seed(seed: int, position: int) -> int:
    """Generator seed of the token at ``position`` of a request seeded with ``seed``.

    A splitmix64 finaliser over ``seed`` and ``position``, so neighbouring
    positions and seeds give unrelated streams.
    """
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest top set of ``probs`` (``[V]``) reaching ``top_p``; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    # Keep a token if the mass strictly before it is still below top_p (the
    # first token is always kept).
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplerParams],
    positions: Sequence[int],
    unseeded: torch.Generator,
) -> list[int]:
    """Pick one token per row of ``logits``.

    Args:
        logits: ``[S, vocab]`` float logits.
        params: Sampling parameters of each row.
        positions: Position the sampled token will take in its request (its
            sequence length before the token), per row; mixed into the seed.
        unseeded: Generator for rows whose ``seed`` is ``None``; advanced.

    Returns:
        ``S`` token ids.

    Raises:
        ValueError: ``params`` or ``positions`` do not have one entry per row.
    """
    num_rows = logits.shape[0]
    if len(params) != num_rows or len(positions) != num_rows:
        raise ValueError(
            f"{num_rows} logit rows but {len(params)} params and {len(positions)} positions"
        )
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, position) in enumerate(zip(params, positions, strict=True)):
        if p.is_greedy:
            continue
        if p.seed is None:
            gen = unseeded
        else:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(token_seed(p.seed, position))
        probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)
        probs = top_p_filter(probs, p.top_p)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return [int(t) for t in tokens]
