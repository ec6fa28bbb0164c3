"""Asyncio layer over ucxx's low-level API: one UCX worker, its listener, connections.

Used only by the transfer agent, from the agent's own event-loop thread (every
method must be called on that loop). It turns UCX requests into asyncio futures,
puts a deadline on every network wait, maps UCX failures onto
:mod:`kvbridge.transfer.errors` (ucxx's by their ``ucxx.exceptions`` type,
libucp's by status code in ``ucp_lib``), and logs one debug line per operation.

Why the low-level API: endpoints here are created with UCX *peer error handling
off*, because with it on UCX refuses shared memory / CMA zero-copy between
processes and falls back to TCP (about 20x slower on one host). ucxx's asyncio
listener forces error handling on, so the listener and endpoints are built by
hand. The price: UCX never tells us a peer died. Failure detection is therefore
the application's: every wait has a deadline, idle connections exchange
heartbeats (agent), and a timed-out connection is aborted and re-handshaked.

Progress: a single driver task calls ``ucp_worker_progress``. While any *busy*
request (bulk data) is in flight it polls in tight slices of ``_BUSY_SLICE_S``
(shared-memory transfers move only as fast as both ends poll), yielding to the
loop between slices; for a short grace period after a completion it spins with
``asyncio.sleep(0)`` (so request/reply round trips stay sub-millisecond),
unless ``stop_spinning`` said another thread of the process needs the GIL;
otherwise it arms the worker and sleeps on its epoll file descriptor, with a
short safety timeout in case a transport misses a wakeup.

Tagged sends and receives go through libucp directly (``ucp_lib``: cheaper per
call than ucxx's wrappers, which matters on the per-request path); ucxx still
creates the context, worker, listener and endpoints and swaps the greetings.

Stray messages: UCX keeps a tagged message that no posted receive matches until
one does, for ever. Every ``_DRAIN_EVERY_S`` the driver receives and drops those
that nothing will ask for (see ``_drain_stray``), so a peer sending junk tags
cannot grow this process's memory.

Tags are worker-global in UCX, so each connection end draws a random id and the
two ends swap ids over the endpoint's stream channel on connect::

    tag (64 bits) = [ receiver's connection id : 28 ][ channel : 36 ]
    channel 0 carries control frames; the agent numbers data channels from 1.

Control frames carry ``[payload nbytes : u32][crc32 : u32][payload]`` and are
at most ``max_frame_nbytes``; a bigger, shorter or corrupted frame is a
:class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import random
import struct
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import ucxx._lib.libucxx as ucx_api
import ucxx.exceptions as ucx_exc
from ucxx._lib.arr import Array

from kvbridge.transfer.errors import (
    PeerClosedError,
    PeerTimeoutError,
    PeerUnreachableError,
    ProtocolError,
    TransferError,
)
from kvbridge.transfer.ucp_lib import RequestParam, UcpLibrary, UcpRequest

__all__ = ["MAX_CHANNEL", "SAFE_TLS", "UcxConnection", "UcxWorker"]

logger = logging.getLogger(__name__)

_ID_BITS = 28
_CHANNEL_BITS = 36
MAX_CHANNEL = (1 << _CHANNEL_BITS) - 1
_HELLO = struct.Struct("<8sQ")  # magic, connection id
_MAGIC = b"KVBUCX01"
_FRAME_HEADER = struct.Struct("<II")  # payload nbytes, crc32
_DRAIN_EVERY_S = 0.25
_BUSY_SLICE_S = 0.0002  # longest tight polling run while bulk data is in flight
_MAX_DRAIN = 4096  # stray messages dropped per pass
_SCRATCH_NBYTES = 64  # stray messages land here, truncated
_TAG_MASK_FULL = (1 << 64) - 1
_CONTIG = ctypes.byref(RequestParam(op_attr_mask=0))  # contiguous bytes, no callback
#: Every transport but the cross-memory-attach ones. With peer error handling off
#: (see above), a peer that dies while UCX copies its memory with
#: process_vm_readv/writev (cma; knem and xpmem alike) makes UCX abort THIS
#: process. Shared memory (posix/sysv) copies through segments both sides mapped,
#: so a dead peer only stops the flow and our deadlines take over; measured as
#: fast as cma for multi-MB messages on one host (docs/benchmarks.md).
SAFE_TLS = "^cma,knem,xpmem"

Bytes = npt.NDArray[np.uint8]
ConnectHandler = Callable[["UcxConnection"], Awaitable[None]]


#: ucxx's exception types (``ucxx.exceptions``, one per UCS status) -> ours, first match.
_UCX_ERRORS: tuple[tuple[tuple[type[Exception], ...], type[TransferError], str], ...] = (
    ((ucx_exc.UCXCanceledError,), PeerClosedError, "canceled"),
    ((ucx_exc.UCXMessageTruncatedError,), ProtocolError, "message larger than the posted buffer"),
    ((ucx_exc.UCXConnectionResetError, ucx_exc.UCXNotConnectedError, ucx_exc.UCXCloseError,
      ucx_exc.UCXFirstEndpointFailureError, ucx_exc.UCXLastEndpointFailureError,
      ucx_exc.UCXFirstLinkFailureError, ucx_exc.UCXLastLinkFailureError),
     PeerClosedError, "connection lost"),
    ((ucx_exc.UCXUnreachableError, ucx_exc.UCXRejectedError), PeerUnreachableError,
     "peer unreachable"),
    ((ucx_exc.UCXTimedOutError, ucx_exc.UCXEndpointTimeoutError), PeerTimeoutError, "timed out"),
)


def _map_ucx_error(exc: Exception, what: str) -> TransferError:
    """Our typed error for an exception ucxx raised (by type; anything else: TransferError)."""
    for kinds, error, text in _UCX_ERRORS:
        if isinstance(exc, kinds):
            return error(f"{what}: {text} ({type(exc).__name__}: {exc})")
    return TransferError(f"{what}: {type(exc).__name__}: {exc}")


def _ignore_outcome(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass(slots=True)
class _Pending:
    request: Any
    future: asyncio.Future[None]
    busy: bool
    keep: object  # the buffer UCX reads or writes: alive until the request ends


class UcxWorker:
    """A UCX context + worker progressed by this event loop, with an optional listener.

    Args:
        spin_s: keep polling this long after the last UCX event before sleeping.
        busy_poll_s: longest sleep on the epoll fd while bulk data is in flight.
        idle_poll_s: longest sleep on the epoll fd otherwise (a missed wakeup costs
            at most this).
        config: extra UCX options (``UCX_`` prefix dropped). Unless they or the
            environment name ``TLS``, the transports are ``SAFE_TLS``. The rendezvous scheme
            defaults to ``get_zcopy``, which measured several times faster for
            multi-MB messages between processes on one host than ``auto``. The
            listener reuses its address (``CM_REUSEADDR``) so a restart keeps its port.

    Must be created inside the running event loop that will use it.
    """

    def __init__(
        self,
        *,
        spin_s: float = 0.0002,
        busy_poll_s: float = 0.001,
        idle_poll_s: float = 1.0,
        config: dict[str, str] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        # CM_REUSEADDR: a restarted agent must get its port back at once, although
        # the connections of the agent it replaces (crashed or not) sit in TIME_WAIT
        # for a minute; without SO_REUSEADDR the listen fails with "Device is busy".
        options = {"RNDV_SCHEME": "get_zcopy", "CM_REUSEADDR": "y", **(config or {})}
        if "TLS" not in options and "UCX_TLS" not in os.environ:
            options["TLS"] = SAFE_TLS
        self._context = ucx_api.UCXContext(
            options,
            feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.STREAM, ucx_api.Feature.WAKEUP),
        )
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self.ucp = UcpLibrary()
        self._spin_s = spin_s
        self._busy_poll_s = busy_poll_s
        self._idle_poll_s = idle_poll_s
        self._last_event = 0.0
        self._stop_spin = False
        self._pending: list[_Pending] = []
        self._num_busy = 0
        self._ids_in_use: set[int] = set()
        self._next_drain = 0.0
        self._num_stray_dropped = 0
        self._wakeup = asyncio.Event()
        self._epoll_fd: int = self._worker.epoll_file_descriptor
        self._loop.add_reader(self._epoll_fd, self._wakeup.set)
        self._listener: Any = None
        self._self_endpoint: Any = None  # to this worker: completes abandoned receives
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._driver = self._loop.create_task(self._drive())

    # ----------------------------------------------------------------- progress
    async def _drive(self) -> None:
        # Spin only briefly after the last event: on a host with fewer cores than
        # busy threads, spinning would steal the very CPU the peer needs to answer.
        loop = self._loop
        progress, handle = self.ucp.worker_progress, self._worker.handle
        while not self._closed:
            # While bulk data moves, poll UCX in a tight loop for a slice before
            # letting other tasks run: shared-memory transfers advance only as
            # fast as both ends poll.
            busy_until = time.perf_counter() + _BUSY_SLICE_S if self._num_busy else 0.0
            while True:
                while progress(handle):
                    self._last_event = loop.time()
                if self._reap() or self._num_busy == 0 or time.perf_counter() >= busy_until:
                    break
            if loop.time() >= self._next_drain:
                self._drain_stray()
                self._next_drain = loop.time() + _DRAIN_EVERY_S
            if not self._stop_spin and loop.time() - self._last_event < self._spin_s:
                await asyncio.sleep(0)
                continue
            self._wakeup.clear()
            if not self._worker.arm():
                await asyncio.sleep(0)
                continue
            self._stop_spin = False
            timeout_s = self._busy_poll_s if self._num_busy else self._idle_poll_s
            try:
                async with asyncio.timeout(timeout_s):
                    await self._wakeup.wait()
            except TimeoutError:
                continue  # a guard against a missed wakeup, not an event: no spin after it
            self._last_event = loop.time()

    def stop_spinning(self) -> None:
        """Make the driver sleep at its next chance instead of spinning.

        For when another thread of this process is about to need the GIL (an
        outcome or release it is told of). A spinning driver releases the GIL
        only for an instant per loop pass, and CPython hands it to a waiting
        thread only after the switch interval (5 ms) or when the holder blocks;
        measured on the 1-block read, that wait was ~0.2 ms of a 1.1 ms read.
        Any thread may call it.
        """
        self._stop_spin = True

    def _reap(self) -> bool:
        """Resolve the futures of completed requests; True if any completed."""
        if not self._pending:
            return False
        still: list[_Pending] = []
        for item in self._pending:
            if not item.request.completed:
                still.append(item)
                continue
            self._last_event = self._loop.time()
            if item.busy:
                self._num_busy -= 1
            if item.future.done():  # the waiter gave up (timeout); nothing to report
                continue
            try:
                item.request.check_error()
            except TransferError as exc:  # ours (iov.py): already typed
                item.future.set_exception(exc)
            except Exception as exc:  # ucxx raises its own untyped hierarchy
                item.future.set_exception(_map_ucx_error(exc, "ucx request"))
            else:
                item.future.set_result(None)
        num_done = len(self._pending) - len(still)
        self._pending = still
        return num_done > 0

    def _drain_stray(self) -> None:
        """Receive and drop unexpected tagged messages that no receive will ever match.

        UCX keeps a message that arrives before a matching receive is posted, for
        ever. Receives of data chunks are always posted before the sender may send
        (credits), so the only unexpected messages that will still be wanted are
        control frames (channel 0) of open connections. Anything else, sent by a
        confused or hostile peer (any peer may send any tag, even before the
        handshake), or arriving late for a closed connection, would otherwise pile
        up in this process's memory. Messages are taken oldest first; a wanted
        frame at the head ends the pass (it is received within moments).
        """
        anything = ucx_api.UCXXTagMask(0)
        num_dropped = 0
        while num_dropped < _MAX_DRAIN:
            head = self._worker.tag_probe(ucx_api.UCXXTag(0), anything, remove=False)
            if not head.matched:
                break
            tag: int = head.sender_tag.value
            if tag & MAX_CHANNEL == 0 and tag >> _CHANNEL_BITS in self._ids_in_use:
                break
            taken = self._worker.tag_probe(head.sender_tag, ucx_api.UCXXTagMaskFull, remove=True)
            if not taken.matched:
                break
            scratch = Array(np.empty(_SCRATCH_NBYTES, dtype=np.uint8))
            request = self._worker.tag_recv_with_handle(scratch, taken)
            # truncated on purpose: the error is expected and not worth reporting
            self.track(request, scratch, busy=False).add_done_callback(_ignore_outcome)
            num_dropped += 1
        if num_dropped:
            self._num_stray_dropped += num_dropped
            logger.info("dropped %d stray UCX messages (%d in all)", num_dropped,
                        self._num_stray_dropped)

    def complete_abandoned(self, tag: Any) -> None:
        """Complete a posted receive nobody waits for any more, with an empty message.

        UCX has no way to cancel one posted tag receive, and closing the endpoint
        leaves it posted (with its buffer) for ever. Sending zero bytes to its tag
        from this worker to itself ends it. Called by ``UcxConnection.abort``.
        """
        if self._closed:
            return
        if self._self_endpoint is None:
            self._self_endpoint = ucx_api.UCXEndpoint.create_from_worker_address(
                self._worker, self._worker.address, False
            )
        empty = Array(np.zeros(0, dtype=np.uint8))
        request = self._self_endpoint.tag_send(empty, tag)
        self.track(request, empty, busy=False).add_done_callback(_ignore_outcome)

    @property
    def num_stray_dropped(self) -> int:
        """Unexpected messages no receive would match, dropped since start."""
        return self._num_stray_dropped

    @property
    def num_requests(self) -> int:
        """UCX requests in flight (posted, not yet completed)."""
        return len(self._pending)

    @property
    def num_connections(self) -> int:
        """Connection ids in use (connections not yet closed or aborted)."""
        return len(self._ids_in_use)

    @property
    def num_tasks(self) -> int:
        """Tasks this worker owns (accepted connections being served)."""
        return len(self._tasks)

    def track(self, request: Any, keep: object, *, busy: bool) -> asyncio.Future[None]:
        """Return a future resolved when ``request`` completes (internal to this module)."""
        future: asyncio.Future[None] = self._loop.create_future()
        self._pending.append(_Pending(request, future, busy, keep))
        if busy:
            self._num_busy += 1
        self._wakeup.set()
        return future

    # ---------------------------------------------------------------- connections
    def _new_id(self) -> int:
        while True:
            conn_id = random.getrandbits(_ID_BITS)
            if conn_id and conn_id not in self._ids_in_use:
                self._ids_in_use.add(conn_id)
                return conn_id

    def release_id(self, conn_id: int) -> None:
        """Forget a closed connection's id so it can be drawn again."""
        self._ids_in_use.discard(conn_id)

    def listen(self, port: int, on_connect: ConnectHandler, *, timeout_s: float) -> int:
        """Accept connections on ``port`` (0: any free port); return the bound port.

        Args:
            port: TCP port for UCX's socket connection manager, all interfaces.
            on_connect: coroutine run (as its own task) for each accepted connection
                once the ids are swapped; it owns the connection from then on.
            timeout_s: deadline for a new peer to complete the id swap.

        Raises:
            PeerUnreachableError: the port could not be bound.
        """

        def on_request(conn_request: int) -> None:
            endpoint = ucx_api.UCXEndpoint.create_from_conn_request(
                self._listener, conn_request, False
            )
            self.spawn(self._accept(endpoint, on_connect, timeout_s))

        try:
            self._listener = ucx_api.UCXListener.create(
                self._worker, port, on_request, deliver_endpoint=False
            )
        except Exception as exc:  # ucxx raises its own untyped hierarchy
            raise PeerUnreachableError(f"cannot listen on port {port}: {exc}") from exc
        bound: int = self._listener.port
        logger.debug("listening on port %d", bound)
        return bound

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` as a task owned by this worker (cancelled on close)."""

        async def run() -> None:
            await coro

        task = self._loop.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, endpoint: Any, on_connect: ConnectHandler, timeout_s: float) -> None:
        conn = UcxConnection(self, endpoint, "incoming", self._new_id())
        try:
            magic, remote_id = await conn.swap_ids(listener_side=True, timeout_s=timeout_s)
        except TransferError as exc:
            logger.info("dropping incoming connection: %s", exc)
            conn.abort()
            return
        if magic != _MAGIC or not 0 < remote_id < (1 << _ID_BITS):
            logger.info("dropping incoming connection: bad greeting %r/%#x", magic, remote_id)
            conn.abort()
            return
        conn.remote_id = remote_id
        await on_connect(conn)

    async def connect(self, host: str, port: int, *, timeout_s: float) -> UcxConnection:
        """Open a connection to a listening ``UcxWorker``.

        Raises:
            PeerUnreachableError: UCX could not create the endpoint, or it never
                connected (e.g. nobody listens on ``port``).
            PeerTimeoutError: the peer did not answer within ``timeout_s``.
            ProtocolError: the peer is not a kvbridge UCX listener.
        """
        try:
            endpoint = ucx_api.UCXEndpoint.create(self._worker, host, port, False)
        except Exception as exc:  # ucxx raises its own untyped hierarchy
            raise PeerUnreachableError(f"cannot reach {host}:{port}: {exc}") from exc
        conn = UcxConnection(self, endpoint, f"{host}:{port}", self._new_id())
        try:
            magic, remote_id = await conn.swap_ids(listener_side=False, timeout_s=timeout_s)
            if magic != _MAGIC or not 0 < remote_id < (1 << _ID_BITS):
                raise ProtocolError(f"{host}:{port} is not a kvbridge agent (greeting {magic!r})")
        except PeerClosedError as exc:  # e.g. nobody listens there: never connected
            conn.abort()
            raise PeerUnreachableError(f"cannot reach {host}:{port}: {exc}") from exc
        except TransferError:
            conn.abort()
            raise
        conn.remote_id = remote_id
        return conn

    async def close(self) -> None:
        """Stop progress, cancel owned tasks and release UCX resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        self._loop.remove_reader(self._epoll_fd)
        self._driver.cancel()
        await asyncio.gather(self._driver, *self._tasks, return_exceptions=True)
        self._listener = None
        self._self_endpoint = None
        # Requests posted through libucp directly are ours to cancel and free
        # (ucxx cleans up its own); a cancelled request completes on progress.
        handle = self._worker.handle
        for item in self._pending:
            if isinstance(item.request, UcpRequest):
                item.request.cancel(handle)
        self.ucp.worker_progress(handle)
        for item in self._pending:
            item.request.completed  # frees what completed  # noqa: B018
            if not item.future.done():
                item.future.set_exception(PeerClosedError("UCX worker closed"))
        self._pending.clear()


class UcxConnection:
    """One UCX endpoint plus the tag ids both ends agreed on.

    Attributes:
        peer: human-readable peer name for logs.
        local_id: id in the tags of messages sent TO this end.
        remote_id: id in the tags of messages this end sends.
    """

    def __init__(self, worker: UcxWorker, endpoint: Any, peer: str, local_id: int) -> None:
        self._worker = worker
        self._endpoint = endpoint
        self.peer = peer
        self.local_id = local_id
        self.remote_id = 0
        self._closed = False
        self._frame_buf: Bytes | None = None
        self._recvs: list[tuple[Any, Any]] = []  # (tag, UCX request) of posted receives

    @property
    def closed(self) -> bool:
        """True once ``close`` or ``abort`` ran."""
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise PeerClosedError(f"{what} on closed connection to {self.peer}")

    async def _wait(self, future: asyncio.Future[Any], timeout_s: float, what: str) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await future
        except TimeoutError:
            # The UCX request may still complete later into its buffer, and its tag
            # sequence is now out of step: the connection cannot be used again.
            self.abort()
            raise PeerTimeoutError(
                f"{what} to/from {self.peer}: no completion in {timeout_s}s"
            ) from None

    async def swap_ids(self, *, listener_side: bool, timeout_s: float) -> tuple[bytes, int]:
        """Exchange connection ids over the stream channel (used by ``UcxWorker``)."""
        mine = np.frombuffer(_HELLO.pack(_MAGIC, self.local_id), dtype=np.uint8).copy()
        theirs = np.zeros(_HELLO.size, dtype=np.uint8)
        steps = ("recv", "send") if listener_side else ("send", "recv")
        for step in steps:
            if step == "send":
                arr = Array(mine)
                request = self._endpoint.stream_send(arr)
            else:
                arr = Array(theirs)
                request = self._endpoint.stream_recv(arr)
            await self._wait(self._worker.track(request, arr, busy=False), timeout_s, "greeting")
        magic, remote_id = _HELLO.unpack(theirs.tobytes())
        return bytes(magic), int(remote_id)

    def _tag(self, conn_id: int, channel: int) -> Any:
        return ucx_api.UCXXTag(self._tag_value(conn_id, channel))

    @staticmethod
    def _tag_value(conn_id: int, channel: int) -> int:
        if not 0 <= channel <= MAX_CHANNEL:
            raise ValueError(f"channel {channel} outside [0, {MAX_CHANNEL}]")
        return (conn_id << _CHANNEL_BITS) | channel

    # Raw access for operations ucxx lacks (iov.py posts them through libucp).
    def incoming_tag(self, channel: int) -> int:
        """The 64-bit UCX tag of messages sent to this end on ``channel``."""
        return self._tag_value(self.local_id, channel)

    def outgoing_tag(self, channel: int) -> int:
        """The 64-bit UCX tag of messages this end sends on ``channel``."""
        return self._tag_value(self.remote_id, channel)

    @property
    def endpoint_handle(self) -> int:
        """The ``ucp_ep_h`` (raises ``PeerClosedError`` once closed)."""
        self._check_open("send")
        handle: int = self._endpoint.handle
        return handle

    @property
    def worker_handle(self) -> int:
        """The ``ucp_worker_h`` of this connection's worker (raises once closed)."""
        self._check_open("recv")
        handle: int = self._worker._worker.handle
        return handle

    def track_send(self, request: Any, keep: object) -> asyncio.Future[None]:
        """Future of a send posted outside this class; ``keep`` lives until it ends."""
        return self._worker.track(request, keep, busy=True)

    def track_recv(self, channel: int, request: Any, keep: object) -> asyncio.Future[None]:
        """Like ``post_recv`` for a receive posted outside this class on ``channel``."""
        self._recvs = [(t, r) for t, r in self._recvs if not r.completed]
        self._recvs.append((self._tag(self.local_id, channel), request))
        return self._worker.track(request, keep, busy=True)

    def cancel_recv(self, channel: int) -> None:
        """End a posted receive nobody will send to (it completes with 0 bytes)."""
        if not self._closed:
            self._worker.complete_abandoned(self._tag(self.local_id, channel))

    def post_send(self, buf: Bytes, channel: int, *, busy: bool = True) -> asyncio.Future[None]:
        """Post a send of a contiguous uint8 buffer on ``channel``; return its future.

        For callers that need not wait (a control frame whose answer, or whose
        link's heartbeat, has its own deadline). ``buf`` is kept alive until the
        send ends.

        Raises:
            PeerClosedError: the connection is closed.
        """
        self._check_open("send")
        logger.debug("send peer=%s channel=%d nbytes=%d", self.peer, channel, buf.nbytes)
        lib = self._worker.ucp
        value = lib.tag_send_nbx(self._endpoint.handle, buf.ctypes.data, buf.nbytes,
                                 self._tag_value(self.remote_id, channel), _CONTIG)
        request = UcpRequest(lib, value, f"send to {self.peer}", None)
        return self._worker.track(request, buf, busy=busy)

    async def send(self, buf: Bytes, channel: int, *, timeout_s: float, busy: bool = True) -> None:
        """Send a contiguous uint8 buffer on ``channel``.

        Raises:
            PeerTimeoutError, PeerClosedError, TransferError: the send failed.
        """
        await self._wait(self.post_send(buf, channel, busy=busy), timeout_s, "send")

    def post_recv(
        self, buf: Bytes, channel: int, *, busy: bool = True, exact: bool = True
    ) -> asyncio.Future[None]:
        """Post a receive of exactly ``buf.nbytes`` bytes; await the result with ``wait``.

        A message of any other length fails the future with ``ProtocolError``.
        That includes the empty message ``abort`` sends to end the receives
        still posted on this connection (``complete_abandoned``): unchecked, it
        would look like data that arrived, and the buffer's old contents (a
        staging buffer's last chunk: another request's KV) would be used as it.
        ``exact=False`` accepts up to ``buf.nbytes`` (control frames, which
        carry their own length and CRC).

        The buffer belongs to UCX until the future resolves; if the caller gives
        up waiting it must abort the connection and never reuse the buffer.
        """
        self._check_open("recv")
        logger.debug("recv peer=%s channel=%d nbytes=%d", self.peer, channel, buf.nbytes)
        lib = self._worker.ucp
        value = lib.tag_recv_nbx(self.worker_handle, buf.ctypes.data, buf.nbytes,
                                 self._tag_value(self.local_id, channel), _TAG_MASK_FULL, _CONTIG)
        request = UcpRequest(lib, value, f"recv from {self.peer}", buf.nbytes if exact else None)
        self._recvs = [(t, r) for t, r in self._recvs if not r.completed]
        self._recvs.append((self._tag(self.local_id, channel), request))
        return self._worker.track(request, buf, busy=busy)

    async def wait(self, future: asyncio.Future[Any], *, timeout_s: float, what: str) -> None:
        """Await a posted operation with a deadline (raises ``PeerTimeoutError``)."""
        await self._wait(future, timeout_s, what)

    async def recv(
        self, buf: Bytes, channel: int, *, timeout_s: float, busy: bool = True, exact: bool = True
    ) -> None:
        """Receive exactly ``buf.nbytes`` bytes on ``channel`` into ``buf`` (see ``post_recv``)."""
        await self._wait(self.post_recv(buf, channel, busy=busy, exact=exact), timeout_s, "recv")

    def post_frame(self, payload: bytes) -> asyncio.Future[None]:
        """Post one control frame (length and CRC prepended) on channel 0; see ``post_send``."""
        header = _FRAME_HEADER.pack(len(payload), zlib.crc32(payload))
        frame = np.frombuffer(header + payload, dtype=np.uint8)
        return self.post_send(frame, 0, busy=False)

    async def send_frame(self, payload: bytes, *, timeout_s: float) -> None:
        """Send one control frame (length and CRC prepended) on channel 0."""
        await self._wait(self.post_frame(payload), timeout_s, "send")

    async def recv_frame(self, *, max_nbytes: int, timeout_s: float) -> bytes:
        """Receive one control frame on channel 0 and return its checked payload.

        Raises:
            ProtocolError: the frame is larger than ``max_nbytes``, truncated or corrupt.
            PeerTimeoutError, PeerClosedError: nothing usable arrived in time.
        """
        if self._frame_buf is None or self._frame_buf.nbytes != max_nbytes + _FRAME_HEADER.size:
            self._frame_buf = np.empty(max_nbytes + _FRAME_HEADER.size, dtype=np.uint8)
        buf = self._frame_buf
        buf[: _FRAME_HEADER.size] = 0
        await self.recv(buf, 0, timeout_s=timeout_s, busy=False, exact=False)
        nbytes, crc = _FRAME_HEADER.unpack(buf[: _FRAME_HEADER.size].tobytes())
        if nbytes > max_nbytes:
            raise ProtocolError(f"frame from {self.peer} claims {nbytes} bytes > {max_nbytes}")
        payload = buf[_FRAME_HEADER.size : _FRAME_HEADER.size + nbytes].tobytes()
        if zlib.crc32(payload) != crc:
            raise ProtocolError(f"frame from {self.peer} of {nbytes} bytes fails its CRC")
        return payload

    def stop_spinning(self) -> None:
        """Nothing is due here soon: let the worker sleep at once (``UcxWorker.stop_spinning``)."""
        self._worker.stop_spinning()

    def abort(self) -> None:
        """Close the endpoint now; in-flight operations fail. Idempotent."""
        if self._closed:
            return
        self._closed = True
        logger.debug("abort peer=%s id=%#x", self.peer, self.local_id)
        try:
            self._endpoint.close()
        except Exception as exc:  # ucxx raises its own untyped hierarchy
            logger.debug("closing endpoint to %s: %s", self.peer, exc)
        for tag, request in self._recvs:  # else they stay posted, buffers and all
            if not request.completed:
                self._worker.complete_abandoned(tag)
        self._recvs.clear()
        self._worker.release_id(self.local_id)

    async def close(self, goodbye: bytes | None = None, *, timeout_s: float = 1.0) -> None:
        """Gracefully close: optionally send a last control frame, then close. Idempotent."""
        if self._closed:
            return
        if goodbye is not None:
            try:
                await self.send_frame(goodbye, timeout_s=timeout_s)
            except TransferError as exc:
                logger.debug("goodbye to %s not delivered: %s", self.peer, exc)
        self.abort()
