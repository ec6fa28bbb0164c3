"""One UCX worker progressed by an asyncio loop: its context, listener and connects.

Used only by the transfer agent, from the agent's own event-loop thread (every
method must be called on that loop). It turns UCX requests into asyncio futures,
maps UCX failures onto :mod:`kvbridge.transfer.errors` (ucxx's by their
``ucxx.exceptions`` type, libucp's by status code in ``ucp_lib``), and hands
each connection it accepts or opens over as a :class:`UcxConnection`
(``connection.py``: tags, sends, receives, control frames).

Why the low-level API: endpoints here are created with UCX *peer error handling
off*, because with it on UCX refuses shared memory / CMA zero-copy between
processes and falls back to TCP (far slower on one host). ucxx's asyncio
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

Tagged sends and receives, the greetings (stream) and the listener go through
libucp directly (``ucp_lib``, ``listener.py``: cheaper per call than ucxx's
wrappers, which matters on the per-request path, and a listener that binds one
address); ucxx still creates the context, the worker and outgoing endpoints.

Stray messages: UCX keeps a tagged message that no posted receive matches until
one does, for ever. Every ``_DRAIN_EVERY_S`` the driver receives and drops those
that nothing will ask for (see ``_drain_stray``), so a peer sending junk tags
cannot grow this process's memory.

Connection keys (``connection.py``): 64 bits from ``secrets`` per connection end,
the top ``ID_BITS`` unique in this worker. Nothing here draws from ``random``,
which engines seed (vLLM seeds it with 0), so no peer can predict them.

The listener (``listener.py``) binds the address it is given, not every interface.

The progress driver, the stray drain, request tracking and connection keys all
work on the worker's pending list and key set, which only this class touches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
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
from kvbridge.transfer.ucx.connection import (
    CHANNEL_BITS,
    ID_BITS,
    MAGIC,
    UcxConnection,
    ignore_outcome,
)
from kvbridge.transfer.ucx.listener import UcpListener
from kvbridge.transfer.ucx.ucp_lib import UcpLibrary, UcpRequest

__all__ = ["SAFE_TLS", "UcxWorker"]

logger = logging.getLogger(__name__)

_DRAIN_EVERY_S = 0.25
_BUSY_SLICE_S = 0.0002  # longest tight polling run while bulk data is in flight
_MAX_DRAIN = 4096  # stray messages dropped per pass
_SCRATCH_NBYTES = 64  # stray messages land here, truncated
#: Every transport but the cross-memory-attach ones. With peer error handling off
#: (see above), a peer that dies while UCX copies its memory with
#: process_vm_readv/writev (cma; knem and xpmem alike) makes UCX abort THIS
#: process. Shared memory (posix/sysv) copies through segments both sides mapped,
#: so a dead peer only stops the flow and our deadlines take over; measured as
#: fast as cma for multi-MB messages on one host (docs/benchmarks.md).
SAFE_TLS = "^cma,knem,xpmem"

ConnectHandler = Callable[[UcxConnection], Awaitable[None]]

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
            multi-MB messages between processes on one host than ``auto``, unless
            they or the environment (``UCX_RNDV_SCHEME``) name one.
        gpu_memory: messages go to and from GPU memory (an agent's CUDA caches):
            the default scheme is then UCX's own (``auto``), several times faster
            there than ``get_zcopy`` (docs/benchmarks.md, "GPU"). And
            the driver polls without sleeping while bulk data is in flight: UCX's
            GPU transport (cuda_ipc) raises no event when a copy completes, so a
            sleep on the event fd lasted ``busy_poll_s`` per chunk. The
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
        gpu_memory: bool = False,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        # CM_REUSEADDR: a restarted agent must get its port back at once, although
        # the connections of the agent it replaces (crashed or not) sit in TIME_WAIT
        # for a minute; without SO_REUSEADDR the listen fails with "Device is busy".
        # TCP_PUT_ENABLE=n: UCX's tcp transport writes an incoming put wherever its
        # header says, with no key checked, for any peer connected to the worker, before
        # any handshake of ours; off, a stranger cannot write this process's memory
        # (docs/security.md; tests/transfer/test_no_rma.py).
        defaults = {"TLS": SAFE_TLS, "RNDV_SCHEME": "auto" if gpu_memory else "get_zcopy",
                    "CM_REUSEADDR": "y", "TCP_PUT_ENABLE": "n"}
        options = dict(config or {})
        for name, value in defaults.items():  # the caller's, else the environment's, else ours
            if name not in options and f"UCX_{name}" not in os.environ:
                options[name] = value
        put_enable = options.get("TCP_PUT_ENABLE", os.environ.get("UCX_TCP_PUT_ENABLE", "n"))
        if put_enable.strip().lower() not in ("n", "no", "0", "off", "false"):
            logger.warning("UCX_TCP_PUT_ENABLE=%s: every peer that reaches this agent's port "
                           "over TCP can write any byte of this process (docs/security.md)",
                           put_enable)
        self.options = options  # what the context was made with (besides the environment)
        self._context = ucx_api.UCXContext(
            options,
            feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.STREAM, ucx_api.Feature.WAKEUP),
        )
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self.ucp = UcpLibrary()
        self._gpu_memory = gpu_memory
        self._spin_s = spin_s
        self._busy_poll_s = busy_poll_s
        self._idle_poll_s = idle_poll_s
        self._last_event = 0.0
        self._stop_spin = False
        self._pending: list[_Pending] = []
        self._num_busy = 0
        self._keys_in_use: dict[int, int] = {}  # id (key >> CHANNEL_BITS) -> key
        self._next_drain = 0.0
        self._num_stray_dropped = 0
        self._wakeup = asyncio.Event()
        self._epoll_fd: int = self._worker.epoll_file_descriptor
        self._loop.add_reader(self._epoll_fd, self._wakeup.set)
        self._listener: UcpListener | None = None
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
            spinning = self._gpu_memory and self._num_busy  # no events from GPU copies
            if spinning or (not self._stop_spin and loop.time() - self._last_event < self._spin_s):
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
        thread only after the switch interval (``sys.getswitchinterval``) or
        when the holder blocks: a wait that showed in a 1-block read's latency.
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
            except ucx_exc.UCXError as exc:  # ucxx's base class (``ucxx.exceptions``)
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
            if self._keys_in_use.get(tag >> CHANNEL_BITS) == tag:  # channel 0 of a connection
                break
            taken = self._worker.tag_probe(head.sender_tag, ucx_api.UCXXTagMaskFull, remove=True)
            if not taken.matched:
                break
            scratch = Array(np.empty(_SCRATCH_NBYTES, dtype=np.uint8))
            request = self._worker.tag_recv_with_handle(scratch, taken)
            # truncated on purpose: the error is expected and not worth reporting
            self.track(request, scratch, busy=False).add_done_callback(ignore_outcome)
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
        self.track(request, empty, busy=False).add_done_callback(ignore_outcome)

    def wake(self) -> None:
        """Make the driver look at the requests now (one completed outside progress)."""
        self._wakeup.set()

    @property
    def handle(self) -> int:
        """The ``ucp_worker_h`` (for libucp calls made outside ucxx)."""
        handle: int = self._worker.handle
        return handle

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
        """Connection keys in use (connections not yet closed or aborted)."""
        return len(self._keys_in_use)

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
        """A fresh connection key: 64 random bits whose top ``ID_BITS`` are unused here."""
        while True:
            key = secrets.randbits(ID_BITS + CHANNEL_BITS)
            conn_id = key >> CHANNEL_BITS
            if conn_id and conn_id not in self._keys_in_use:
                self._keys_in_use[conn_id] = key
                return key

    def release_id(self, key: int) -> None:
        """Forget a closed connection's key so its id can be drawn again."""
        if self._keys_in_use.get(key >> CHANNEL_BITS) == key:
            del self._keys_in_use[key >> CHANNEL_BITS]

    def listen(self, host: str, port: int, on_connect: ConnectHandler, *,
               timeout_s: float) -> int:
        """Accept connections on ``host:port`` (port 0: any free port); return the bound port.

        Args:
            host: address to bind: one of this host's addresses, the one peers are
                told to connect to; ``"0.0.0.0"`` / ``"::"`` binds every interface
                (for an address translated on the way, NAT or a container's port map).
            port: TCP port for UCX's socket connection manager.
            on_connect: coroutine run (as its own task) for each accepted connection
                once the keys are swapped; it owns the connection from then on.
            timeout_s: deadline for a new peer to complete the key swap.

        Raises:
            PeerUnreachableError: the address could not be bound.
        """

        def on_request(conn_request: int) -> None:
            # Inside ucp_worker_progress, on this loop's thread (or UCX's async
            # thread): create the endpoint later, from the loop.
            self._loop.call_soon_threadsafe(self._on_request, conn_request, on_connect,
                                            timeout_s)

        if self._listener is not None:
            raise PeerUnreachableError(f"already listening on port {self._listener.port}")
        self._listener = UcpListener(self.ucp, self.handle, host, port, on_request)
        logger.debug("listening on %s:%d", host, self._listener.port)
        return self._listener.port

    def _on_request(self, conn_request: int, on_connect: ConnectHandler, timeout_s: float
                    ) -> None:
        listener = self._listener
        if self._closed or listener is None:
            return
        try:
            endpoint = listener.accept(conn_request, self._track_close)
        except TransferError as exc:
            logger.info("dropping incoming connection: %s", exc)
            return
        self.spawn(self._accept(endpoint, on_connect, timeout_s))

    def _track_close(self, request: UcpRequest) -> None:
        if not self._closed:
            self.track(request, None, busy=False).add_done_callback(ignore_outcome)

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
        if magic != MAGIC or not remote_id >> CHANNEL_BITS:
            logger.info("dropping incoming connection: bad greeting %r (a kvbridge agent "
                        "greets with %r)", magic, MAGIC)
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
        except ucx_exc.UCXError as exc:  # e.g. a host name that does not resolve
            raise PeerUnreachableError(f"cannot reach {host}:{port}: {exc}") from exc
        conn = UcxConnection(self, endpoint, f"{host}:{port}", self._new_id())
        try:
            magic, remote_id = await conn.swap_ids(listener_side=False, timeout_s=timeout_s)
            if magic != MAGIC or not remote_id >> CHANNEL_BITS:
                raise ProtocolError(
                    f"{host}:{port} greets with {magic!r}, not {MAGIC!r}: not a kvbridge agent, "
                    f"or one of another version (run the same kvbridge on P and D)")
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
        if self._listener is not None:
            self._listener.close()
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
        self._forget_unexpected()

    def _forget_unexpected(self) -> None:
        """Take every unexpected tagged message off the worker, without receiving it.

        ucxx's worker destructor receives each one and progresses until that
        receive completes. A rendezvous message whose sender gave up (a send
        deadline, a dead peer; peer error handling is off) never completes: the
        destructor, run by the garbage collector at any later point, would spin
        for ever. Messages taken off here are not received (their descriptors
        go with the worker).
        """
        anything = ucx_api.UCXXTagMask(0)
        for _ in range(_MAX_DRAIN * 64):
            if not self._worker.tag_probe(ucx_api.UCXXTag(0), anything, remove=True).matched:
                return
        logger.warning("UCX worker closed with more than %d unexpected messages",
                       _MAX_DRAIN * 64)

