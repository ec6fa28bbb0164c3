"""Cache builders for the kernel tests: random bytes in every dtype, any layout.

``DEVICE`` is where the tests put their caches: the CPU (Triton under
``TRITON_INTERPRET=1``), or ``KVBRIDGE_TEST_DEVICE=cuda`` on a GPU machine, where
the same parametrisations run the compiled kernels (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbridge.kernels import Impl
from kvbridge.topology import KVLayout
from tests.kernels.reference import as_layers, raw

IMPLS: tuple[Impl, ...] = ("torch", "triton")
DEVICE = torch.device(os.environ.get("KVBRIDGE_TEST_DEVICE", "cpu"))


@dataclass(frozen=True)
class CacheSpec:
    """Shape of one side's caches."""

    layout: KVLayout
    block_size: int
    num_heads: int
    head_dim: int = 16
    num_blocks: int = 24
    num_layers: int = 2
    dtype: torch.dtype = torch.float16
    mla: bool = False
    stacked: bool = False

    def layer_shape(self) -> tuple[int, ...]:
        if self.mla:
            return (self.num_blocks, self.block_size, self.head_dim)
        if self.layout == KVLayout.NHD:
            return (2, self.num_blocks, self.block_size, self.num_heads, self.head_dim)
        return (2, self.num_blocks, self.num_heads, self.block_size, self.head_dim)


def random_caches(spec: CacheSpec, seed: int) -> list[torch.Tensor] | torch.Tensor:
    """Caches full of random bytes (NaN and subnormal patterns included)."""
    gen = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=spec.dtype).element_size()
    shape = (spec.num_layers, *spec.layer_shape())
    data = torch.randint(0, 256, (*shape[:-1], shape[-1] * elem), dtype=torch.uint8, generator=gen)
    stacked = data.view(spec.dtype).to(DEVICE)
    return stacked if spec.stacked else [t.clone() for t in stacked.unbind(0)]


def clone(caches: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor] | torch.Tensor:
    if isinstance(caches, torch.Tensor):
        return caches.clone()
    return [t.clone() for t in caches]


def same_bytes(
    a: Sequence[torch.Tensor] | torch.Tensor, b: Sequence[torch.Tensor] | torch.Tensor
) -> bool:
    left, right = as_layers(a), as_layers(b)
    return len(left) == len(right) and all(
        torch.equal(raw(x), raw(y)) for x, y in zip(left, right, strict=True)
    )


def shuffled_ids(count: int, num_blocks: int, seed: int, repeats: bool) -> list[int]:
    """``count`` unsorted block ids; with ``repeats`` some ids appear twice."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen)[:count].tolist()
    if repeats and count >= 3:
        ids[-1] = ids[0]
    return ids
