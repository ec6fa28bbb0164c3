"""Same-host reads without the wire: the reader copies the server's blocks itself.

When a reader and the server of a link run on one host (same boot, same pid
namespace), the kernel copies between their address spaces in one pass
(``process_vm_readv``, the "cross-memory attach" that UCX's own ``cma``
transport uses). A read through UCX's shared memory costs two passes (the
server copies into a FIFO, the reader out of it), both on the same cores; this
costs one, and the reader splits it over ``AgentConfig.copy_threads`` threads.

The server still decides what may be read: the reader asks as for any direct
read, and the server checks the grant, pins it and answers ``CopyGo`` (where
the read's blocks sit, and for how long it holds them: ``hold_s``). It unpins
when the reader says ``CopyDone`` or when ``hold_s`` has passed. The reader
keeps the bytes only if its copy ended within ``hold_s`` of sending the
request (the server's hold started later), so it never keeps a block the
server may have handed back to its engine::

    reader: t0 send ReadRequest ........ copy ....... t1   keep iff t1 - t0 < hold_s
    server:      recv, pin ----------------- hold_s ------------> unpin

The copy need not wait for the go: a grant's blocks do not change from its
issue (after the prefill wrote them, before D learns the token) to its release,
so when an earlier go of the same shape (layers, heads) told where the blocks
sit, the reader copies while the server checks, and keeps the bytes only if
the go, when it comes, confirms the grant and the same place (``reader.py``).

Who may copy from whom is settled on top of the handshake: the server offers a
``wire.HostInfo`` (boot id, pid namespace, pid, the address and value of a
random probe); the reader copies the probe and compares before it trusts the
pid, and again after every copy (the pid could name another process by then).

Used for direct reads of ``AgentConfig.local_copy_min_nbytes`` (16 MiB) and
more: below that, UCX's shared memory with both processes copying at once is as
fast as one copy followed by the wait for the server's answer. Besides the
speed, a copy costs the server's process no CPU per byte, where UCX's shared
memory makes it copy every byte into its FIFO.

Off (reads go through UCX) when ``AgentConfig.local_copy`` is False, when
``KVBRIDGE_LOCAL_COPY=0``, when ``UCX_TLS`` leaves out UCX's shared-memory
transports (an operator who asked for TCP asked for the network: the netns
"hosts" of the tests are one host to the kernel), off Linux, and for caches
not in host memory.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from kvbridge.transfer import wire
from kvbridge.transfer.errors import PeerClosedError, ProtocolError, TransferError

__all__ = [
    "ENV_SWITCH",
    "CopyRefusedError",
    "CopyRun",
    "CopySource",
    "Copier",
    "ProbeCell",
    "allowed",
    "host_memory",
]

logger = logging.getLogger(__name__)

ENV_SWITCH = "KVBRIDGE_LOCAL_COPY"
_IOV_MAX = 1024  # iovec entries per process_vm_readv call (Linux UIO_MAXIOV)
_PROBE_NBYTES = 16
#: Below this many bytes per thread a copy is not split (a thread hop costs ~50 us).
MIN_PART_NBYTES = 4 << 20
_UCX_SHM_TRANSPORTS = frozenset({"all", "sm", "shm", "cma", "posix", "sysv"})

IovArray = npt.NDArray[np.uint64]  # struct iovec[n]: (address, length) rows


class CopyRefusedError(TransferError):
    """The kernel would not let this process read the server's memory (EPERM)."""


def allowed(enabled: bool) -> bool:
    """Whether this process may use same-host copies at all (config, environment, OS)."""
    if not enabled or sys.platform != "linux":
        return False
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}:
        return False
    tls = os.environ.get("UCX_TLS", "").strip()
    if not tls:
        return True
    names = {name.strip().lower() for name in tls.removeprefix("^").split(",")}
    if tls.startswith("^"):  # an exclusion list
        return not names & {"sm", "shm", "cma"}
    return bool(names & _UCX_SHM_TRANSPORTS)


def host_memory(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor lives in this process's host memory."""
    return all(t.device.type == "cpu" for t in tensors)


def _host_identity() -> tuple[str, str]:
    """``(boot id, pid namespace)`` of this process: equal pairs share pids and a kernel."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    ns = os.stat("/proc/self/ns/pid")
    return boot_id, f"{ns.st_dev}:{ns.st_ino}"


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


_readv = _bind_readv() if sys.platform == "linux" else None


class ProbeCell:
    """The server's proof of identity: random bytes at an address it advertises."""

    def __init__(self) -> None:
        self._cell = np.frombuffer(bytearray(secrets.token_bytes(_PROBE_NBYTES)), dtype=np.uint8)

    def host_info(self) -> wire.HostInfo | None:
        """What the handshake offers, or None where this host cannot say who it is."""
        try:
            boot_id, pid_namespace = _host_identity()
        except OSError as exc:
            logger.info("no same-host copies: %s", exc)
            return None
        return wire.HostInfo(boot_id, pid_namespace, os.getpid(), self._cell.ctypes.data,
                             self._cell.tobytes())


class CopySource:
    """A server process this reader may copy from. Create with :meth:`open`."""

    def __init__(self, info: wire.HostInfo) -> None:
        self.pid = info.pid
        self._probe = info.probe
        self._probe_iov = np.array([[info.probe_address, len(info.probe)]], dtype=np.uint64)
        self._got = np.zeros(len(info.probe), dtype=np.uint8)
        self._got_iov = np.array([[self._got.ctypes.data, self._got.size]], dtype=np.uint64)
        self._iov_pointers = (self._got_iov.ctypes.data, self._probe_iov.ctypes.data)

    @classmethod
    def open(cls, info: wire.HostInfo | None, peer: str) -> CopySource | None:
        """Check that ``info`` names a process we can read; None (logged) when not."""
        if info is None or _readv is None:
            return None
        try:
            if (info.boot_id, info.pid_namespace) != _host_identity():
                return None  # another host (or pid namespace): the pid means nothing here
        except OSError:
            return None
        source = cls(info)
        try:
            source.check()
        except TransferError as exc:
            logger.info("no same-host copies from %s (pid %d): %s", peer, info.pid, exc)
            return None
        return source

    def check(self) -> None:
        """Copy the probe and compare: the pid still names the server that offered it.

        Raises:
            PeerClosedError: the process is gone or is another one now.
            CopyRefusedError: the kernel refuses the copy.
        """
        assert _readv is not None
        self._got[:] = 0
        got_iov, probe_iov = self._iov_pointers
        got = _readv(self.pid, got_iov, 1, probe_iov, 1, 0)
        if got != len(self._probe):
            code = ctypes.get_errno() if got < 0 else 0
            if code == errno.EPERM:
                raise CopyRefusedError(f"copy from pid {self.pid}: {os.strerror(code)}")
            raise PeerClosedError(f"pid {self.pid} is no longer the server "
                                  f"({os.strerror(code) if code else 'short probe'})")
        if self._got.tobytes() != self._probe:
            raise PeerClosedError(f"pid {self.pid} is no longer the server (probe differs)")

    def readv(self, local: IovArray, remote: IovArray) -> None:
        """Copy ``remote`` ranges of the server into ``local`` ones (same total, any split).

        Runs in whatever thread calls it; the GIL is released during each call.

        Raises:
            PeerClosedError: the process is gone (ESRCH).
            CopyRefusedError: not permitted (EPERM).
            ProtocolError: a remote range is not mapped in the server (EFAULT), or
                the copy came up short.
        """
        assert _readv is not None
        for start in range(0, max(len(local), len(remote)), _IOV_MAX):
            lo, re = local[start : start + _IOV_MAX], remote[start : start + _IOV_MAX]
            want = int(lo[:, 1].sum())
            got = _readv(self.pid, lo.ctypes.data, len(lo), re.ctypes.data, len(re), 0)
            if got == want:
                continue
            if got >= 0:
                raise ProtocolError(f"copy from pid {self.pid} moved {got} of {want} bytes")
            code = ctypes.get_errno()
            text = f"copy from pid {self.pid}: {os.strerror(code)}"
            if code == errno.ESRCH:
                raise PeerClosedError(text)
            if code == errno.EPERM:
                raise CopyRefusedError(text)
            if code == errno.EFAULT:
                raise ProtocolError(text + " (the server named memory it does not have)")
            raise TransferError(text)


class CopyRun:
    """A copy under way: the parts running in helper threads, and the first error."""

    def __init__(self, source: CopySource, parts: list[Future[None]],
                 error: BaseException | None) -> None:
        self.source, self.parts, self.error = source, parts, error


class Copier:
    """Runs copies, split over up to ``threads`` threads (the caller's is one of them)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def num_parts(self, nbytes: int) -> int:
        """How many threads a copy of ``nbytes`` is split over (1: the caller's alone)."""
        return max(1, min(self.threads, nbytes // MIN_PART_NBYTES))

    def start(
        self, source: CopySource, local: IovArray, remote: IovArray,
        meanwhile: Callable[[], object] | None = None,
    ) -> CopyRun:
        """Copy row for row (``local[i]`` and ``remote[i]`` have one length).

        Large copies are split: the other parts go to helper threads and the
        first runs here, before this returns. ``meanwhile`` is called between
        the two (while the helpers wake up); if it raises, the helpers are
        waited for and its error propagates. Pass the result to ``finish``, or
        to ``abandon``. Otherwise never raises: a copy error is kept for ``finish``.
        """
        rows = len(local)
        parts = min(rows, self.num_parts(int(local[:, 1].sum()) if rows else 0))
        bounds = [rows * k // parts for k in range(parts + 1)]
        others: list[Future[None]] = []
        if parts > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1,
                                                thread_name_prefix="kvbridge-local-copy")
            others = [self._pool.submit(source.readv, local[a:b], remote[a:b])
                      for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]
        if others:  # a helper needs the GIL to start its copy: let it have it now
            time.sleep(0)
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException:
                futures_wait(others)
                raise
        error: BaseException | None = None
        try:
            source.readv(local[: bounds[1]], remote[: bounds[1]])
        except Exception as exc:
            error = exc
        return CopyRun(source, others, error)

    async def finish(self, run: CopyRun) -> None:
        """Wait for every part of ``run``, then check the source.

        Returns only when every part has ended, also on failure or cancellation:
        no thread of ours writes into the local blocks after this returns or raises.

        Raises:
            The errors of ``CopySource.readv`` and ``CopySource.check``.
        """
        if run.parts:
            try:
                await asyncio.wait([asyncio.wrap_future(part) for part in run.parts])
            except asyncio.CancelledError:
                self.abandon(run)
                raise
        error = run.error
        for part in run.parts:
            if error is None:
                error = part.exception()
        if error is not None:
            raise error
        run.source.check()

    @staticmethod
    def abandon(run: CopyRun) -> None:
        """Wait (blocking) until no part of ``run`` still writes; ignore its outcome."""
        futures_wait(run.parts)

    async def copy(self, source: CopySource, local: IovArray, remote: IovArray) -> None:
        """``finish(start(...))``."""
        await self.finish(self.start(source, local, remote))

    def close(self) -> None:
        """Stop the helper threads (a copy under way finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
