"""KV cache tensors in host memory, on transparent huge pages where the OS offers them.

A KV cache is one large, long-lived allocation that transfers copy in and out of
block by block. On 4 KiB pages every 2 MiB of it is 512 page-table entries: each
same-host copy pins and walks them all (``process_vm_readv``), and every touch
costs TLB misses. Asking the kernel for transparent huge pages
(``madvise(MADV_HUGEPAGE)``, honoured when THP is ``always`` or ``madvise``)
makes that 1 entry per 2 MiB. Where that is not possible (not Linux, not a CPU
tensor, THP ``never``, a small tensor) this is ``torch.zeros``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import sys

import torch

__all__ = ["HUGE_PAGE_NBYTES", "kv_cache_zeros"]

HUGE_PAGE_NBYTES = 2 << 20


def kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed tensor like ``torch.zeros(shape, dtype=dtype, device=device)``.

    On host memory of at least ``HUGE_PAGE_NBYTES``, backed by an anonymous
    mapping advised to use huge pages (the tensor keeps the mapping alive).
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (torch.device(device).type != "cpu" or sys.platform != "linux"
            or nbytes < HUGE_PAGE_NBYTES or not hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.zeros(shape, dtype=dtype, device=device)
    size = -(-nbytes // HUGE_PAGE_NBYTES) * HUGE_PAGE_NBYTES
    # A huge page must start on a 2 MiB boundary, and mmap promises only 4 KiB: map
    # 2 MiB more and start the tensor at the first boundary (else a 2 MiB tensor
    # straddles two huge-page frames and gets none).
    area = mmap.mmap(-1, size + HUGE_PAGE_NBYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -_address(area) % HUGE_PAGE_NBYTES
    with contextlib.suppress(OSError):  # THP not built in: plain pages, still zeroed
        area.madvise(mmap.MADV_HUGEPAGE, start, size)
    tensor = torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=start)
    return tensor.view(dtype).view(shape)


def _address(area: mmap.mmap) -> int:
    """Where ``area`` is mapped in this process."""
    view = ctypes.c_char.from_buffer(area)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # releases the buffer export (the mapping could not be closed with it)
