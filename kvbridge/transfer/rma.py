"""One-sided UCX RMA (put/get) on a :class:`UcxWorker`, through ctypes on libucp.

ucxx exposes no RMA, but its objects hand out the raw UCP handles (context,
worker, endpoint). This module calls the libucp that ucxx itself loaded on
those handles: ``ucp_mem_map`` + ``ucp_rkey_pack`` to expose local memory,
``ucp_ep_rkey_unpack`` to reach a peer's, ``ucp_put_nbx`` / ``ucp_get_nbx`` to
move bytes and ``ucp_ep_flush_nbx`` to learn they landed. Meant for the
transfer agent's "D asks, P puts": the reader registers its destination
memory and sends the packed key; the server checks the grant and writes the
granted blocks straight from its cache into it. Event-loop thread only.

Completion rides on ``UcxWorker``'s progress driver: the puts of one call plus
the closing flush form one pseudo-request that the driver polls
(``ucp_request_check_status``) like a ucxx request, so it spins while bulk data
is in flight. A call returns only once every byte is at the target.

Transport: between processes on one host, puts of listener-made endpoints
(error handling off) go through CMA zero-copy (``process_vm_writev``); the
first operations, before wireup settles, may still use TCP loopback.

Peer input is checked before libucp sees it: ``ucp_ep_rkey_unpack`` takes no
length and follows the size bytes inside a key, so keys are parsed here first;
and every remote range must lie in the window the peer declared with its key
(CMA and shared memory have no per-range protection of their own). UCX itself
still trusts its peers' protocol messages, so none of this makes a hostile
but authenticated peer harmless; it keeps garbage away from libucp.

Hazards measured with this libucp (1.21), for whoever wires this in:

- Endpoints without peer error handling (ours, for CMA) make a peer's death in
  the middle of a CMA copy fatal: ``process_vm_writev`` fails and UCX aborts
  the process that issued it, here the writer. With error handling on, UCX
  uses no CMA for RMA (software emulation, < 0.5 GB/s).
- A context with the RMA feature answers UCX's software-RMA messages
  (``rma_sw.c``), which read or write any address a connected peer names, no
  key checked. The serving side should therefore not enable it: its puts over
  CMA work without it (over TCP they then never complete).

Packed remote key layout (UCX 1.x ``ucp_rkey_pack``, host memory)::

    [md_map : u64][mem_type : u8] then per set bit of md_map:
    [tl_rkey_nbytes : u8][tl_rkey : tl_rkey_nbytes] ... [sys_dev : u8, optional]
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import ucxx._lib.libucxx as ucx_api

from kvbridge.errors import ConfigError
from kvbridge.transfer.errors import PeerClosedError, PeerTimeoutError, ProtocolError
from kvbridge.transfer.ucp_lib import (
    MEMORY_TYPE_HOST,
    OP_MEMH,
    OP_MEMORY_TYPE,
    UCS_INPROGRESS,
    UCS_OK,
    MemMapParams,
    RequestParam,
    UcpError,
    UcpLibrary,
    ptr_status,
)
from kvbridge.transfer.ucx import UcxConnection, UcxWorker

__all__ = [
    "MAX_PACKED_RKEY_NBYTES",
    "OutOfRegionError",
    "RemoteKey",
    "Registration",
    "Rma",
    "RmaError",
    "RkeyError",
    "UcpLibrary",
    "parse_packed_rkey",
    "new_rma_worker",
    "plan_ranges",
]

logger = logging.getLogger(__name__)

MAX_PACKED_RKEY_NBYTES = 4096
_RKEY_HEADER = struct.Struct("<QB")  # md_map, memory type
_MAX_TRAILER_NBYTES = 1  # system device id
_RKEY_SLACK_NBYTES = 256  # zero tail: a transport's fixed-size unpack never reads past it
# ucp_mem_map_params_t field bits, flags and protections (ucp.h)
_MAP_ADDRESS, _MAP_LENGTH, _MAP_PROT, _MAP_MEMTYPE = 1 << 0, 1 << 1, 1 << 3, 1 << 4
_PROT_LOCAL_RW, _PROT_REMOTE_READ, _PROT_REMOTE_WRITE = 0b11, 1 << 8, 1 << 9

Offsets = npt.NDArray[np.int64]


RmaError = UcpError  # a libucp call failed (name kept for RMA callers)


class RkeyError(ProtocolError):
    """A peer's packed remote key is malformed, oversized or not host memory."""


class OutOfRegionError(ValueError):
    """A range falls outside the registered or declared memory window."""



# ------------------------------------------------------------------------- peer keys
def parse_packed_rkey(packed: bytes) -> dict[int, int]:
    """Parse a peer's packed remote key before libucp does.

    ``ucp_ep_rkey_unpack`` takes no length: it follows the size bytes inside
    the key. Here every size byte must stay inside ``packed`` and end exactly
    at its last byte, and the memory must be host memory.

    Returns:
        The byte size of each memory domain's part of the key, by domain index.

    Raises:
        RkeyError: the key is shorter than its header, oversized, truncated,
            has trailing bytes or is not host memory.
    """
    if not _RKEY_HEADER.size <= len(packed) <= MAX_PACKED_RKEY_NBYTES:
        raise RkeyError(
            f"packed rkey of {len(packed)} bytes outside "
            f"[{_RKEY_HEADER.size}, {MAX_PACKED_RKEY_NBYTES}]"
        )
    # md_map may be 0: with no domain able to register (TCP only), UCX emulates
    # RMA with messages and the key carries nothing but its header.
    md_map, memory_type = _RKEY_HEADER.unpack_from(packed)
    if memory_type != MEMORY_TYPE_HOST:
        raise RkeyError(f"packed rkey is for memory type {memory_type}, not host memory")
    sizes, pos = {}, _RKEY_HEADER.size
    for md_index in (i for i in range(64) if md_map >> i & 1):
        if pos >= len(packed):
            raise RkeyError(f"packed rkey of {len(packed)} bytes ends before domain {md_index}")
        sizes[md_index] = packed[pos]
        pos += 1 + packed[pos]
    # Host keys end with at most the system-device byte; distance records (GPU
    # keys) index fixed tables inside libucp, so they are refused outright.
    if not 0 <= len(packed) - pos <= _MAX_TRAILER_NBYTES:
        raise RkeyError(f"packed rkey domains span {pos} bytes, the key has {len(packed)}")
    return sizes


# ------------------------------------------------------------------------- handles
class _Handle:
    """A UCP handle whose release waits for the operations still using it."""

    def __init__(self, value: int) -> None:
        self._value = value
        self._num_users = 0
        self._closing = False

    @property
    def handle(self) -> int:
        """The raw handle; 0 once ``close`` was called."""
        return 0 if self._closing else self._value

    def acquire(self) -> None:
        self._num_users += 1

    def release(self) -> None:
        self._num_users -= 1
        if self._closing and not self._num_users:
            self._destroy()

    def close(self) -> None:
        """Release the handle now, or once the operations using it ended. Idempotent."""
        if not self._closing:
            self._closing = True
            if not self._num_users:
                self._destroy()

    def _destroy(self) -> None:
        value, self._value = self._value, 0
        if value:
            self._free(value)

    def _free(self, value: int) -> None:
        raise NotImplementedError


class Registration(_Handle):
    """Local memory mapped with ``ucp_mem_map``. Create with :meth:`Rma.register`.

    Attributes:
        address: first byte.
        nbytes: length.
        packed_rkey: what a peer needs (with ``address`` and ``nbytes``) to reach
            it; empty when registered for local use only.
    """

    def __init__(
        self, lib: UcpLibrary, context: int, memh: int, address: int, nbytes: int,
        packed_rkey: bytes, owner: object,
    ) -> None:
        super().__init__(memh)
        self._lib, self._context = lib, context
        self.address, self.nbytes, self.packed_rkey = address, nbytes, packed_rkey
        self._owner: object = owner  # keeps the memory alive while mapped

    def _free(self, value: int) -> None:
        status = self._lib.mem_unmap(self._context, value)
        self._owner = None
        if status != UCS_OK:
            logger.warning("ucp_mem_unmap of %d bytes: %s", self.nbytes,
                           self._lib.status_name(status))


class RemoteKey(_Handle):
    """A peer's unpacked key on one connection, with the window the peer declared.

    Create with :meth:`Rma.unpack_rkey`. Remote offsets used with it count from
    ``base`` and must stay inside ``nbytes``.
    """

    def __init__(
        self, lib: UcpLibrary, conn: UcxConnection, rkey: int, base: int, nbytes: int
    ) -> None:
        super().__init__(rkey)
        self._lib, self.conn = lib, conn
        self.base, self.nbytes = base, nbytes

    def _free(self, value: int) -> None:
        self._lib.rkey_destroy(value)


@dataclass(slots=True)
class _Batch:
    """The UCP requests of one call, polled by the progress driver until all ended.

    Quacks like a ucxx request (``completed``, ``check_error``) for
    ``UcxWorker.track``. A request is freed once seen complete, even after the
    waiter gave up; the handles the batch uses are released after the last one.
    """

    lib: UcpLibrary
    users: tuple[_Handle, ...]
    pending: list[int] = field(default_factory=list)
    status: int = UCS_OK
    what: str = ""
    ended: bool = False

    def __post_init__(self) -> None:
        for user in self.users:
            user.acquire()

    def add(self, value: int | None, what: str) -> None:
        status = ptr_status(value)
        if status is None:
            assert value is not None
            self.pending.append(value)
        elif status != UCS_OK:
            self._fail(status, what)

    def _fail(self, status: int, what: str) -> None:
        if self.status == UCS_OK:
            self.status, self.what = status, what

    @property
    def completed(self) -> bool:
        still = []
        for request in self.pending:
            status = self.lib.request_check_status(request)
            if status == UCS_INPROGRESS:
                still.append(request)
                continue
            self.lib.request_free(request)
            if status != UCS_OK:
                self._fail(status, "rma request")
        self.pending = still
        if not still and not self.ended:
            self.ended = True
            for user in self.users:
                user.release()
        return not still

    def check_error(self) -> None:
        """No-op: ``raise_if_failed`` raises with the UCX status instead."""

    def raise_if_failed(self) -> None:
        if self.status != UCS_OK:
            raise RmaError(self.what, self.status, self.lib.status_name(self.status))


def _endpoint_handle(conn: UcxConnection) -> int:
    """The ``ucp_ep_h`` of an open connection (ucx.py keeps the endpoint private)."""
    if conn.closed:
        raise PeerClosedError(f"RMA on closed connection to {conn.peer}")
    handle: int = conn._endpoint.handle
    return handle


# -------------------------------------------------------------------------- ranges
def plan_ranges(
    local_offsets: npt.ArrayLike, remote_offsets: npt.ArrayLike, nbytes: npt.ArrayLike,
    local_nbytes: int, remote_nbytes: int,
) -> tuple[Offsets, Offsets, Offsets]:
    """Check copies against both windows; merge runs adjacent on both sides.

    Copy ``i`` moves ``nbytes[i]`` bytes between local offset ``local_offsets[i]``
    and remote offset ``remote_offsets[i]``. Copy ``i + 1`` joins copy ``i`` when
    it starts where ``i`` ended on both sides::

        local   [ i ][i+1]      [ j ]        -> ops: (i, i+1) merged, j alone
        remote     [ i ][i+1]         [ j ]

    Args:
        local_offsets, remote_offsets: 1-D integer byte offsets into each window.
        nbytes: bytes per copy: one value for all, or one per copy.
        local_nbytes, remote_nbytes: window sizes.

    Returns:
        ``(local_offsets, remote_offsets, nbytes)`` of the merged operations.

    Raises:
        OutOfRegionError: no copy, lengths differ, a size < 1, or a range leaves
            its window (the message names the first bad copy and its numbers).
    """
    local = np.asarray(local_offsets, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_offsets, dtype=np.int64).reshape(-1)
    sizes = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    if sizes.size == 1 and local.size > 1:
        sizes = np.repeat(sizes, local.size)
    if local.size == 0 or remote.shape != local.shape or sizes.shape != local.shape:
        raise OutOfRegionError(
            f"need >= 1 copy and equal counts: {local.size} local offsets, "
            f"{remote.size} remote offsets, {sizes.size} sizes"
        )
    local_end, remote_end = local + sizes, remote + sizes
    bad = (sizes < 1) | (local < 0) | (remote < 0)
    bad |= (local_end > local_nbytes) | (remote_end > remote_nbytes)
    if bad.any():
        i = int(np.argmax(bad))
        raise OutOfRegionError(
            f"copy {i} of {sizes[i]} bytes: local [{local[i]}, {local_end[i]}) or remote "
            f"[{remote[i]}, {remote_end[i]}) leaves its window ({local_nbytes} / "
            f"{remote_nbytes} bytes)"
        )
    if local.size == 1:
        return local, remote, sizes
    starts = np.flatnonzero((local[1:] != local_end[:-1]) | (remote[1:] != remote_end[:-1]))
    starts = np.insert(starts + 1, 0, 0)
    return local[starts], remote[starts], np.add.reduceat(sizes, starts)


# ----------------------------------------------------------------------------- RMA
_OPS_PER_YIELD = 128  # post this many operations, then let the loop run other work
_PROBE_NBYTES = 4096
_INLINE_SLICE_S = 0.0005  # longest stretch of inline worker progress between loop turns


def new_rma_worker(config: dict[str, str] | None = None, **kwargs: Any) -> UcxWorker:
    """A :class:`UcxWorker` whose UCX context has the RMA feature.

    Stopgap until ``UcxWorker`` takes feature flags: its constructor runs with
    ``UCXContext`` briefly wrapped to add ``Feature.RMA`` (this libucp does RMA
    without it, but the UCP API requires the feature).

    Args:
        config, kwargs: passed to ``UcxWorker``.
    """
    real = ucx_api.UCXContext

    def with_rma(options: dict[str, str], feature_flags: tuple[Any, ...]) -> Any:
        return real(options, feature_flags=(*feature_flags, ucx_api.Feature.RMA))

    ucx_api.UCXContext = with_rma
    try:
        return UcxWorker(config=config, **kwargs)
    finally:
        ucx_api.UCXContext = real


class Rma:
    """RMA through the UCX context and worker of a :class:`UcxWorker`.

    Args:
        worker: whose handles and progress driver to use; its context should
            have the RMA feature (see :func:`new_rma_worker`).
        lib: the loaded libucp (default: load the one ucxx uses).
        require_feature: refuse a context without the RMA feature, as the UCP
            API asks. ``False`` lets a serving side that only puts over CMA keep
            the feature off (see the module's hazards).

    Raises:
        ConfigError: the context lacks the RMA feature and ``require_feature``.
        OSError: libucp cannot be loaded.
    """

    def __init__(
        self, worker: UcxWorker, lib: UcpLibrary | None = None, *, require_feature: bool = True
    ) -> None:
        context = worker._context  # ucx.py keeps the ucxx objects private
        if require_feature and not int(context.feature_flags) & ucx_api.Feature.RMA.value:
            raise ConfigError("the UcxWorker's UCX context was created without the RMA feature")
        self._worker = worker
        self._lib = lib or UcpLibrary()
        self._context: int = context.handle
        self._handles: list[_Handle] = []
        self._op_param = RequestParam(
            op_attr_mask=OP_MEMORY_TYPE | OP_MEMH, memory_type=MEMORY_TYPE_HOST
        )
        self._flush_param = RequestParam(op_attr_mask=0)
        # What this host's own keys look like: a peer's key must name the same
        # memory domains with the same part sizes (see ``unpack_rkey``).
        probe = self.register_tensor(np.zeros(_PROBE_NBYTES, dtype=np.uint8), remote_write=True)
        self._key_layout = parse_packed_rkey(probe.packed_rkey)
        probe.close()

    def _own(self, handle: _Handle) -> None:
        self._handles = [h for h in self._handles if h.handle]  # forget closed ones
        self._handles.append(handle)

    # ---------------------------------------------------------------------- memory
    def register(
        self, address: int, nbytes: int, owner: object, *,
        remote_write: bool = False, remote_read: bool = False,
    ) -> Registration:
        """Map ``[address, address + nbytes)`` of host memory for RMA.

        Args:
            address: first byte.
            nbytes: length (> 0).
            owner: the object owning the memory; held until the mapping ends.
            remote_write, remote_read: let peers holding the packed key write or
                read it. With neither, the memory is only a local source or
                destination and no key is packed.

        Raises:
            ValueError: ``address`` or ``nbytes`` out of range.
            RmaError: UCX refused the mapping.
        """
        if address <= 0 or nbytes < 1 or address + nbytes > 1 << 64:
            raise ValueError(f"cannot register {nbytes} bytes at {address:#x}")
        prot = _PROT_LOCAL_RW
        prot |= _PROT_REMOTE_WRITE if remote_write else 0
        prot |= _PROT_REMOTE_READ if remote_read else 0
        params = MemMapParams(
            field_mask=_MAP_ADDRESS | _MAP_LENGTH | _MAP_PROT | _MAP_MEMTYPE,
            address=address, length=nbytes, prot=prot, memory_type=MEMORY_TYPE_HOST,
        )
        lib, memh = self._lib, ctypes.c_void_p()
        lib.check(lib.mem_map(self._context, ctypes.byref(params), ctypes.byref(memh)),
                  f"ucp_mem_map of {nbytes} bytes")
        assert memh.value
        try:
            packed = self._pack(memh.value) if remote_write or remote_read else b""
        except BaseException:
            lib.mem_unmap(self._context, memh.value)
            raise
        registration = Registration(lib, self._context, memh.value, address, nbytes, packed, owner)
        self._own(registration)
        logger.debug("registered %d bytes at %#x, rkey %d bytes", nbytes, address, len(packed))
        return registration

    def register_tensor(
        self, tensor: torch.Tensor | npt.NDArray[Any], *,
        remote_write: bool = False, remote_read: bool = False,
    ) -> Registration:
        """Register a contiguous, non-empty CPU tensor or array (see :meth:`register`).

        Raises:
            ValueError: not contiguous, empty or not on the CPU.
            RmaError: UCX refused the mapping.
        """
        if isinstance(tensor, torch.Tensor):
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(f"need a contiguous CPU tensor, got one on {tensor.device} "
                                 f"(contiguous: {tensor.is_contiguous()})")
            address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        else:
            if not tensor.flags.c_contiguous:
                raise ValueError(f"need a C-contiguous array, got strides {tensor.strides}")
            address, nbytes = tensor.ctypes.data, tensor.nbytes
        return self.register(address, nbytes, tensor,
                             remote_write=remote_write, remote_read=remote_read)

    def _pack(self, memh: int) -> bytes:
        lib, buffer, size = self._lib, ctypes.c_void_p(), ctypes.c_size_t()
        lib.check(lib.rkey_pack(self._context, memh, ctypes.byref(buffer), ctypes.byref(size)),
                  "ucp_rkey_pack")
        try:
            return ctypes.string_at(buffer.value or 0, size.value)
        finally:
            lib.rkey_buffer_release(buffer)

    def unpack_rkey(
        self, conn: UcxConnection, packed: bytes, base: int, nbytes: int, *, strict: bool = True
    ) -> RemoteKey:
        """Unpack a peer's key for RMA over ``conn``, limited to the window it declared.

        Args:
            conn: the connection to the peer (the key is bound to its endpoint).
            packed: the peer's ``Registration.packed_rkey``.
            base, nbytes: the peer's ``Registration.address`` and ``nbytes``.
            strict: the key must name the memory domains this host's own keys
                name, with the same part sizes. Keys of shared-memory domains
                make UCX map the peer's segment into this process, where a lying
                window would let writes stray; an honest peer with the same UCX
                and devices always passes. Turn off only for peers on other
                hardware.

        Raises:
            RkeyError: malformed or unexpected key, or bad window (nothing
                reached libucp).
            PeerClosedError: ``conn`` is closed.
            RmaError: UCX rejected the key.
        """
        if base <= 0 or nbytes < 1 or base + nbytes > 1 << 64:
            raise RkeyError(f"peer window of {nbytes} bytes at {base:#x} is invalid")
        layout = parse_packed_rkey(packed)
        if strict and any(self._key_layout.get(md) != size for md, size in layout.items()):
            raise RkeyError(
                f"packed rkey has domain parts {layout} (index: bytes); keys of this host "
                f"have {self._key_layout}"
            )
        # Zero tail: a transport unpacks its fixed-size record whatever the size byte says.
        buffer = ctypes.create_string_buffer(packed, len(packed) + _RKEY_SLACK_NBYTES)
        lib, rkey = self._lib, ctypes.c_void_p()
        lib.check(lib.rkey_unpack(_endpoint_handle(conn), buffer, ctypes.byref(rkey)),
                  f"ucp_ep_rkey_unpack from {conn.peer}")
        assert rkey.value
        key = RemoteKey(lib, conn, rkey.value, base, nbytes)
        self._own(key)
        return key

    # ------------------------------------------------------------------- transfers
    async def put(
        self, src: Registration, dst: RemoteKey, src_offsets: npt.ArrayLike,
        dst_offsets: npt.ArrayLike, nbytes: npt.ArrayLike, *, timeout_s: float,
    ) -> int:
        """Write local ranges into the peer's memory; return once they are there.

        Ends with ``ucp_ep_flush_nbx``: when this returns, every byte is in the
        peer's memory, so a control message sent next may announce it.

        Args:
            src: local source memory.
            dst: the peer's key (its connection carries the writes).
            src_offsets, dst_offsets, nbytes: the copies, see :func:`plan_ranges`.
            timeout_s: deadline for the whole call.

        Returns:
            The number of UCX put operations (after merging adjacent copies).

        Raises:
            OutOfRegionError: a range leaves ``src`` or the peer's window.
            PeerClosedError: the connection, ``src`` or ``dst`` is closed.
            PeerTimeoutError: not done in time (the connection is aborted; late
                writes may still land in the peer's memory).
            RmaError: UCX reported a failure.
        """
        return await self._transfer("put", src, dst, src_offsets, dst_offsets, nbytes, timeout_s)

    async def get(
        self, dst: Registration, src: RemoteKey, dst_offsets: npt.ArrayLike,
        src_offsets: npt.ArrayLike, nbytes: npt.ArrayLike, *, timeout_s: float,
    ) -> int:
        """Read the peer's ranges into local memory; the mirror of :meth:`put`."""
        return await self._transfer("get", dst, src, dst_offsets, src_offsets, nbytes, timeout_s)

    async def _transfer(
        self, op: str, local: Registration, remote: RemoteKey, local_offsets: npt.ArrayLike,
        remote_offsets: npt.ArrayLike, nbytes: npt.ArrayLike, timeout_s: float,
    ) -> int:
        conn, lib = remote.conn, self._lib
        local_at, remote_at, sizes = plan_ranges(
            local_offsets, remote_offsets, nbytes, local.nbytes, remote.nbytes
        )
        if not local.handle or not remote.handle:
            raise PeerClosedError(f"{op} with a closed registration or key ({conn.peer})")
        post = lib.put_nbx if op == "put" else lib.get_nbx
        local_addrs = [local.address + offset for offset in local_at.tolist()]
        remote_addrs = [remote.base + offset for offset in remote_at.tolist()]
        op_sizes = sizes.tolist()
        param, num_ops = ctypes.byref(self._op_param), int(sizes.size)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        logger.debug("%s peer=%s ops=%d nbytes=%d", op, conn.peer, num_ops, int(sizes.sum()))
        batch = _Batch(lib, (local, remote))
        try:
            for first in range(0, num_ops, _OPS_PER_YIELD):
                if first:  # keep control messages and other reads moving
                    await asyncio.sleep(0)
                ep = _endpoint_handle(conn)  # re-read: the connection may have died
                self._op_param.memh = local.handle
                rkey = remote.handle
                for i in range(first, min(first + _OPS_PER_YIELD, num_ops)):
                    batch.add(post(ep, local_addrs[i], op_sizes[i], remote_addrs[i], rkey, param),
                              op)
                if batch.status != UCS_OK:
                    break
            else:
                batch.add(lib.ep_flush_nbx(ep, ctypes.byref(self._flush_param)),
                          "ucp_ep_flush_nbx")
        except BaseException:
            if not batch.completed:  # posted requests still use the memory
                self._worker.track(batch, local, busy=True)
            raise
        await self._await(batch, conn, max(0.0, deadline - loop.time()), op)
        return num_ops

    async def flush(self, conn: UcxConnection, *, timeout_s: float) -> None:
        """Wait until every RMA issued on ``conn`` completed at the peer.

        Raises:
            PeerClosedError, PeerTimeoutError, RmaError: as :meth:`put`.
        """
        batch = _Batch(self._lib, ())
        batch.add(self._lib.ep_flush_nbx(_endpoint_handle(conn), ctypes.byref(self._flush_param)),
                  "ucp_ep_flush_nbx")
        await self._await(batch, conn, timeout_s, "flush")

    def _progress_inline(self, batch: _Batch) -> tuple[bool, bool]:
        """Progress the worker here for one time slice: ``(completed, progressed)``.

        Shared-memory transports copy inside worker progress, a segment per
        call, so driving it here avoids an event-loop trip per segment. The
        driver is woken afterwards: events consumed here may have completed
        other requests that it must reap.
        """
        progress = self._worker._worker.progress_once
        progressed = False
        give_up = time.perf_counter() + _INLINE_SLICE_S
        while not batch.completed:
            if not progress():
                break
            progressed = True
            if time.perf_counter() > give_up:
                break
        if progressed:
            self._worker._wakeup.set()
        return batch.completed, progressed

    async def _await(self, batch: _Batch, conn: UcxConnection, timeout_s: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            completed, progressed = self._progress_inline(batch)
            if completed:
                break
            if not progressed or loop.time() >= deadline:  # waiting on the peer: park it
                await self._park(batch, conn, max(0.0, deadline - loop.time()), what)
                break
            await asyncio.sleep(0)  # between slices, let the loop run other work
        batch.raise_if_failed()

    async def _park(self, batch: _Batch, conn: UcxConnection, timeout_s: float, what: str) -> None:
        future = self._worker.track(batch, batch.users, busy=True)
        try:
            async with asyncio.timeout(timeout_s):
                await future
        except TimeoutError:
            # Writes may still land later; the connection cannot be trusted again.
            conn.abort()
            raise PeerTimeoutError(f"{what} to {conn.peer}: not done in {timeout_s}s") from None

    # ---------------------------------------------------------------------- teardown
    def close(self) -> None:
        """Destroy every key and unmap every registration made here. Idempotent.

        Handles still used by an operation are released when it ends. Call
        before closing the ``UcxWorker``.
        """
        for handle in self._handles:
            handle.close()
        self._handles.clear()
