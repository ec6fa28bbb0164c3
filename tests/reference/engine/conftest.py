"""Engine test fixtures: one torch thread per test (2-core CI boxes run tests in parallel)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # The tiny model's matmuls are too small to gain from threads, and spinning
    # threads on a shared 2-core box slow every step down several times.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
