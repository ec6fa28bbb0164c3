"""KV cache tensors in host memory, on transparent huge pages where the OS offers them.

A KV cache is one large, long-lived allocation that transfers copy in and out of
block by block. On 4 KiB pages every 2 MiB of it is 512 page-table entries: each
same-host copy pins and walks them all (``process_vm_readv``), and every touch
costs TLB misses. Asking the kernel for transparent huge pages
(``madvise(MADV_HUGEPAGE)``, honoured when THP is ``always`` or ``madvise``, for
shared memory when ``shmem_enabled`` says so) makes that 1 entry per 2 MiB.
Where that is not possible (not Linux, not a CPU tensor, a small tensor) this is
``torch.zeros``.

With ``shared=True`` the memory is a ``memfd`` mapped shared, so that a reader on
this host can map it too, read-only, and copy blocks out of it with a plain
``memcpy`` instead of ``process_vm_readv``, which pins every page it copies
(``transfer/reading/cache_maps.py``), which makes small reads faster. It is off by
default: where ``shmem_enabled`` gives shared memory no huge pages (``never``,
the common default), large reads out of it are slower, with rare long stalls,
with either copy (figures: docs/benchmarks.md, "Figures behind the code").
``shared_region(tensor)`` tells the fd a tensor's memory is in. A process forked
after the allocation shares the cache with its parent instead of copying it on
write.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

__all__ = ["HUGE_PAGE_NBYTES", "SharedRegion", "kv_cache_zeros", "shared_region"]

HUGE_PAGE_NBYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class SharedRegion:
    """A mapping of a whole memfd in this process: another process on this host maps
    ``/proc/<pid>/fd/<fd>`` (and checks the file's ``inode``) to see the same bytes."""

    address: int
    nbytes: int
    fd: int
    inode: int


# tensor start address -> its region, for the tensors ``kv_cache_zeros`` made (alive)
_regions: dict[int, SharedRegion] = {}
_regions_lock = threading.Lock()


def shared_region(tensor: torch.Tensor) -> SharedRegion | None:
    """The shared mapping ``tensor``'s memory is in, if ``kv_cache_zeros`` made it so."""
    with _regions_lock:
        region = _regions.get(tensor.data_ptr())
    if region is None or tensor.data_ptr() + tensor.nbytes > region.address + region.nbytes:
        return None
    return region


def kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device | str = "cpu", *, shared: bool = False) -> torch.Tensor:
    """A zeroed tensor like ``torch.zeros(shape, dtype=dtype, device=device)``.

    On host memory, backed by a mapping advised to use huge pages (the tensor keeps
    the mapping alive): of a memfd (``shared``, see the module docstring; any size)
    where the OS allows one, else anonymous (from ``HUGE_PAGE_NBYTES`` on).
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (torch.device(device).type != "cpu" or sys.platform != "linux"
            or (nbytes < HUGE_PAGE_NBYTES and not shared) or not hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.zeros(shape, dtype=dtype, device=device)
    size = -(-nbytes // HUGE_PAGE_NBYTES) * HUGE_PAGE_NBYTES
    # A huge page must start on a 2 MiB boundary, and mmap promises only 4 KiB: map
    # 2 MiB more and start the tensor at the first boundary (else a 2 MiB tensor
    # straddles two huge-page frames and gets none).
    area, fd = _mapping(size + HUGE_PAGE_NBYTES, shared)
    start = -_address(area) % HUGE_PAGE_NBYTES
    with contextlib.suppress(OSError):  # THP not built in: plain pages, still zeroed
        area.madvise(mmap.MADV_HUGEPAGE, start, size)
    tensor = torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=start)
    if fd >= 0:
        region = SharedRegion(_address(area), len(area), fd, os.fstat(fd).st_ino)
        with _regions_lock:
            _regions[tensor.data_ptr()] = region
        weakref.finalize(area, _forget, tensor.data_ptr(), fd)
    return tensor.view(dtype).view(shape)


def _mapping(nbytes: int, shared: bool) -> tuple[mmap.mmap, int]:
    """Zeroed memory: a memfd mapped shared and its fd, or an anonymous mapping and -1."""
    if shared:
        try:
            fd = os.memfd_create("kvbridge-kv-cache", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            pass  # memfd not allowed here: private memory
        else:
            try:
                os.ftruncate(fd, nbytes)
                return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), fd
            except OSError:
                os.close(fd)
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), -1


def _forget(start: int, fd: int) -> None:
    with _regions_lock:
        _regions.pop(start, None)
    os.close(fd)


def _address(area: mmap.mmap) -> int:
    """Where ``area`` is mapped in this process."""
    view = ctypes.c_char.from_buffer(area)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # releases the buffer export (the mapping could not be closed with it)
