"""libc through ctypes for same-host reads: ``process_vm_readv``, ``memmove``, ``memset``.

``copy_source.py`` copies out of a server process with ``process_vm_readv``
(None where the platform has none); ``inline.py`` copies out of our maps of the
server's memory with ``memmove`` (arguments made once by ``memmove_rows``); a
copy that is not kept is zeroed with ``zero_rows``. Copies are described by
rows of ``struct iovec`` (``IovArray``: one (address, length) pair each).

``process_vm_readv`` is bound through ``CDLL``, which releases the GIL during
the call (a large copy runs on several threads at once, ``copier.py``);
``memmove`` through ``PyDLL``, which keeps it (see ``memmove``).
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import numpy.typing as npt

__all__ = [
    "IOV_MAX", "ROW_NBYTES", "IovArray", "MemmoveArgs", "map_address", "memmove",
    "memmove_rows", "process_vm_readv", "zero_rows",
]

IOV_MAX = 1024  # iovec entries per process_vm_readv call (Linux UIO_MAXIOV)
ROW_NBYTES = 16  # one struct iovec

IovArray = npt.NDArray[np.uint64]  # struct iovec[n]: (address, length) rows


def _bind_readv() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                      ctypes.c_ulong, ctypes.c_ulong]
    return readv


#: ``process_vm_readv(pid, local_iov, n_local, remote_iov, n_remote, 0)``; None off Linux.
process_vm_readv = _bind_readv() if sys.platform == "linux" else None


def _bind_memmove() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """libc's memmove, called with the GIL held and ready-made arguments (``inline.py``).

    A copy out of a map is many rows (32 KiB each for a typical block plane), one
    call each. Holding the GIL: letting it go per row, another thread of ours (the
    agent's loop on its report timer) takes it mid-copy and keeps it for its turn,
    which lengthens the read's tail. Ready-made ``c_void_p`` / ``c_size_t``
    arguments (``memmove_rows``): converting Python ints costs more than the call.
    Figures: docs/benchmarks.md, "Figures behind the code".
    """
    function = ctypes.PyDLL(None).memmove
    function.restype = None
    return function


memmove = _bind_memmove()
MemmoveArgs = tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def memmove_rows(local: IovArray, theirs: IovArray) -> list[MemmoveArgs]:
    """``memmove(ours, theirs, nbytes)``'s arguments per row (rows of equal lengths),
    made once: converting Python ints per call costs twice the call."""
    c_void_p, c_size_t = ctypes.c_void_p, ctypes.c_size_t
    return [(c_void_p(ours), c_void_p(address), c_size_t(nbytes)) for ours, address, nbytes
            in zip(local[:, 0].tolist(), theirs[:, 0].tolist(), theirs[:, 1].tolist(),
                   strict=True)]


def zero_rows(rows: IovArray) -> None:
    """Zero our memory that ``rows`` name: a copy that was not kept (the server's blocks
    may have gone to another request while it ran) leaves nothing behind."""
    for address, nbytes in rows.tolist():
        ctypes.memset(address, 0, nbytes)


def map_address(area: mmap.mmap) -> int:
    """Where a read-only map starts in this process."""
    return int(np.frombuffer(area, dtype=np.uint8).ctypes.data)
