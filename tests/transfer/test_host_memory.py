"""KV cache allocation on huge pages (``kvbridge.transfer.host_memory``)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

from kvbridge.transfer.host_memory import HUGE_PAGE_NBYTES, kv_cache_zeros, shared_region


@pytest.mark.parametrize("shape", [(2, 64, 16, 8, 128), (3, 5), (2, 17, 16, 3, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_like_torch_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = kv_cache_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous() and not t.any()
    t.fill_(3)  # writable, all of it
    assert bool((t == 3).all())


@pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages are Linux's")
@pytest.mark.parametrize("shared", [False, True])
def test_a_large_cache_sits_on_huge_pages_where_the_os_allows(shared: bool) -> None:
    """Private memory when THP is on; shared memory (a memfd) when THP is on for shmem."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/" + ("shmem_enabled" if shared else "enabled"))
    if not mode.exists() or any(f"[{off}]" in mode.read_text() for off in ("never", "deny")):
        pytest.skip(f"transparent huge pages are off on this machine ({mode.name})")
    # the kernel's count of huge-page faults it served with small pages instead
    fallback = "thp_file_fallback" if shared else "thp_fault_fallback"
    fallbacks_before = _vmstat(fallback)
    t = kv_cache_zeros((8, HUGE_PAGE_NBYTES // 4), torch.float32, shared=shared)  # 16 MiB
    t.fill_(1)  # fault it in
    start = t.data_ptr()
    huge_kb = 0
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and int(head.split("-")[0], 16) <= start < int(head.split("-")[1], 16):
            for entry in lines[i + 1 :]:
                if entry.startswith("ShmemPmdMapped:" if shared else "AnonHugePages:"):
                    huge_kb = int(entry.split()[1])
                    break
            break
    if huge_kb < 8 * 1024 and _vmstat(fallback) > fallbacks_before:
        pytest.skip(f"the kernel had no huge page to give ({fallback} rose: memory too "
                    f"fragmented or too little free now); {huge_kb} kB on huge pages")
    assert huge_kb >= 8 * 1024, f"only {huge_kb} kB of the 16 MiB cache on huge pages"


def _vmstat(name: str) -> int:
    """A counter of /proc/vmstat (0 where this kernel has none)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


@pytest.mark.skipif(sys.platform != "linux", reason="memfd is Linux's")
def test_a_shared_cache_is_a_memfd_another_process_can_map() -> None:
    """``shared_region`` names the memfd: its file (through /proc, as a reader on this
    host opens it) holds the tensor's bytes; the fd closes with the tensor."""
    t = kv_cache_zeros((2, 64, 16, 8, 64), torch.bfloat16, shared=True)
    region = shared_region(t)
    assert region is not None and region.address <= t.data_ptr()
    assert t.data_ptr() + t.nbytes <= region.address + region.nbytes
    t.view(-1).view(torch.uint8)[:16] = torch.arange(16, dtype=torch.uint8)
    file = Path(f"/proc/{os.getpid()}/fd/{region.fd}")
    assert os.stat(file).st_ino == region.inode
    with file.open("rb") as f:
        f.seek(t.data_ptr() - region.address)
        assert f.read(16) == bytes(range(16))
    assert shared_region(t[1]) is None  # a view that does not start the tensor
    assert shared_region(kv_cache_zeros((2, 64, 16, 8, 64), torch.bfloat16)) is None  # default
    assert shared_region(torch.zeros(4)) is None
    fd = region.fd
    del t
    gc.collect()
    assert not Path(f"/proc/{os.getpid()}/fd/{fd}").exists() or os.stat(
        f"/proc/{os.getpid()}/fd/{fd}").st_ino != region.inode
