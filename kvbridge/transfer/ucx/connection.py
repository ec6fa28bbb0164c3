"""One UCX connection: its tags, tagged sends and receives, and control frames.

Created by :class:`~kvbridge.transfer.ucx.worker.UcxWorker` (``listen`` accepts,
``connect`` opens); used from the agent's event-loop thread only. Every wait
has a deadline; a wait that times out aborts the connection (its tag sequence
is out of step), and ``abort`` completes every receive still posted, so no
buffer stays lent to UCX. One debug line per operation (peer, channel, bytes).

Tags are worker-global in UCX: a receive matches any message with its tag,
whichever endpoint it came by. So each connection end draws a 64-bit key from
``secrets`` (its *id*, the top 28 bits, unique in its worker) and the two ends
swap keys over the endpoint's stream channel on connect; a message to an end
on channel ``c`` carries the tag ``key ^ c``::

    key (64 bits)   = [ id : 28 ][ mask : 36 ]          (random, never sent to a third party)
    tag (64 bits)   = [ id : 28 ][ mask ^ channel : 36 ] = key ^ channel
    channel 0 carries control frames; the agent numbers data channels from 1.

Another peer connected to the same worker may send any tag, but to complete a
receive posted for this connection it must guess 64 random bits (the channel
numbers themselves are predictable), so it cannot inject bytes into a read
(tests/transfer/test_tag_injection.py).

Control frames carry ``[payload nbytes : u32][crc32 : u32][payload]`` and are
at most ``max_frame_nbytes``; a bigger, shorter or corrupted frame is a
:class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import struct
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
import ucxx._lib.libucxx as ucx_api
import ucxx.exceptions as ucx_exc

from kvbridge.transfer.errors import PeerClosedError, PeerTimeoutError, ProtocolError, TransferError
from kvbridge.transfer.ucx.ucp_lib import OP_FLAGS, STREAM_RECV_WAITALL, RequestParam, UcpRequest

if TYPE_CHECKING:
    from kvbridge.transfer.ucx.worker import UcxWorker

__all__ = [
    "CHANNEL_BITS", "ID_BITS", "MAGIC", "MAX_CHANNEL", "TAG_MASK_FULL", "UcxConnection",
    "ignore_outcome",
]

logger = logging.getLogger(__name__)

ID_BITS = 28
CHANNEL_BITS = 36
MAX_CHANNEL = (1 << CHANNEL_BITS) - 1
TAG_MASK_FULL = (1 << 64) - 1
#: First bytes of the greeting each end sends on connect. 02: 64-bit keys (01 sent
#: 28-bit ids drawn from ``random``).
MAGIC = b"KVBUCX02"
_HELLO = struct.Struct("<8sQ")  # magic, connection key
_FRAME_HEADER = struct.Struct("<II")  # payload nbytes, crc32
_CONTIG = ctypes.byref(RequestParam(op_attr_mask=0))  # contiguous bytes, no callback
_WAITALL = ctypes.byref(RequestParam(op_attr_mask=OP_FLAGS, flags=STREAM_RECV_WAITALL))

#: contiguous uint8 memory: a numpy array, or a tensor (a CUDA one too: UCX finds
#: the memory type from the address)
Bytes = npt.NDArray[np.uint8] | torch.Tensor


def _address(buf: Bytes) -> int:
    return buf.data_ptr() if isinstance(buf, torch.Tensor) else int(buf.ctypes.data)


def ignore_outcome(future: asyncio.Future[None]) -> None:
    """Done callback for an operation nobody awaits any more: its error is not news.

    Retrieving the exception keeps asyncio from logging it as never retrieved.
    """
    if not future.cancelled():
        future.exception()


class UcxConnection:
    """One UCX endpoint plus the tag ids both ends agreed on.

    Attributes:
        peer: human-readable peer name for logs.
        local_id: key of the tags of messages sent TO this end (64 random bits).
        remote_id: key of the tags of messages this end sends (the peer's).
    """

    def __init__(self, worker: UcxWorker, endpoint: Any, peer: str, local_id: int) -> None:
        self._worker = worker
        self._endpoint = endpoint
        self.peer = peer
        self.local_id = local_id
        self.remote_id = 0
        self._closed = False
        self._frame_buf: npt.NDArray[np.uint8] | None = None
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
        """Exchange connection keys over the stream channel (used by ``UcxWorker``)."""
        mine = np.frombuffer(_HELLO.pack(MAGIC, self.local_id), dtype=np.uint8).copy()
        theirs = np.zeros(_HELLO.size, dtype=np.uint8)
        lib, handle = self._worker.ucp, self._endpoint.handle
        steps = ("recv", "send") if listener_side else ("send", "recv")
        for step in steps:
            if step == "send":
                value = lib.stream_send_nbx(handle, _address(mine), mine.nbytes, _CONTIG)
                keep: object = mine
            else:
                length = ctypes.c_size_t()
                value = lib.stream_recv_nbx(handle, _address(theirs), theirs.nbytes,
                                            ctypes.byref(length), _WAITALL)
                keep = (theirs, length)
            request = UcpRequest(lib, value, f"greeting {step} {self.peer}", None)
            await self._wait(self._worker.track(request, keep, busy=False), timeout_s, "greeting")
        magic, remote_id = _HELLO.unpack(theirs.tobytes())
        return bytes(magic), int(remote_id)

    def _tag(self, conn_id: int, channel: int) -> Any:
        return ucx_api.UCXXTag(self._tag_value(conn_id, channel))

    @staticmethod
    def _tag_value(conn_id: int, channel: int) -> int:
        if not 0 <= channel <= MAX_CHANNEL:
            raise ValueError(f"channel {channel} outside [0, {MAX_CHANNEL}]")
        return conn_id ^ channel  # the key's top ID_BITS stay; its mask hides the channel

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
        return self._worker.handle

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

    def withdraw_recv(self, channel: int) -> bool:
        """Withdraw the receives posted on ``channel`` that no message has matched yet.

        ``ucp_request_cancel`` takes such a receive off UCX's expected queue and
        completes it at once (canceled: its future fails with ``PeerClosedError``
        on the worker's next pass). A receive a message already matched cannot be
        withdrawn: UCX goes on landing that message in its buffer until it is
        whole (its future then resolves).

        Returns:
            True when no receive of ``channel`` can write into its buffer any more.
        """
        value = self._tag_value(self.local_id, channel)
        quiet = True
        for tag, request in self._recvs:
            if tag.value != value or request.completed:
                continue
            if isinstance(request, UcpRequest) and not self._closed:
                request.cancel(self._worker.handle)
            quiet = quiet and request.completed
        self._worker.wake()  # the futures of what completed resolve on its next pass
        return quiet

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
        value = lib.tag_send_nbx(self._endpoint.handle, _address(buf), buf.nbytes,
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
        value = lib.tag_recv_nbx(self.worker_handle, _address(buf), buf.nbytes,
                                 self._tag_value(self.local_id, channel), TAG_MASK_FULL, _CONTIG)
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
        except ucx_exc.UCXError as exc:  # ucxx's base class (``ucxx.exceptions``)
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
