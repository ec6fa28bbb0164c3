"""KV cache allocation on huge pages (``kvbridge.paged.host_memory``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvbridge.paged.host_memory import HUGE_PAGE_NBYTES, kv_cache_zeros


@pytest.mark.parametrize("shape", [(2, 64, 16, 8, 128), (3, 5), (2, 17, 16, 3, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_like_torch_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = kv_cache_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous() and not t.any()
    t.fill_(3)  # writable, all of it
    assert bool((t == 3).all())


@pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages are Linux's")
def test_a_large_cache_sits_on_huge_pages_where_the_os_allows() -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    t = kv_cache_zeros((8, HUGE_PAGE_NBYTES // 4), torch.float32)  # 16 MiB
    t.fill_(1)  # fault it in
    start = t.data_ptr()
    huge_kb = 0
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and int(head.split("-")[0], 16) <= start < int(head.split("-")[1], 16):
            for entry in lines[i + 1 :]:
                if entry.startswith("AnonHugePages:"):
                    huge_kb = int(entry.split()[1])
                    break
            break
    assert huge_kb >= 8 * 1024, f"only {huge_kb} kB of the 16 MiB cache on huge pages"
