"""Tagged UCX messages gathered from, or scattered into, lists of memory ranges.

The direct read path (``server.py`` / ``reader.py``) sends a chunk of KV blocks
as ONE tagged message whose bytes come straight from the server's cache blocks
and land straight in the reader's cache blocks: UCX's IOV datatype walks both
lists, so no staging buffer, pack or unpack is involved. The two lists may cut
the byte stream at different places; only the stream order and total length
must agree::

    server ranges   [ b7 L0 K ][ b7 L0 V ][ b2 L0 K ] ...      (its block ids)
    stream          ================================== ...
    reader ranges   [ b0 L0 K ][ b0 L0 V ][ b1 L0 K ] ...      (its block ids)

ucxx has no IOV API, so the calls go through :class:`UcpLibrary` (ctypes) on
the endpoint and worker ucxx created; completion is polled by the
``UcxWorker`` progress driver like any ucxx request. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging

import numpy as np
import numpy.typing as npt

from kvbridge.transfer.errors import ProtocolError
from kvbridge.transfer.ucp_lib import (
    DATATYPE_IOV,
    OP_DATATYPE,
    UCS_INPROGRESS,
    UCS_OK,
    RequestParam,
    TagRecvInfo,
    UcpError,
    UcpLibrary,
    ptr_status,
)
from kvbridge.transfer.ucx import UcxConnection

__all__ = ["IovRequest", "Ranges", "iov_array", "post_recv_iov", "send_iov"]

logger = logging.getLogger(__name__)

Ranges = tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]  # (addresses, lengths)
_TAG_MASK_FULL = (1 << 64) - 1


def iov_array(addresses: npt.ArrayLike, lengths: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """A ``ucp_dt_iov_t[n]`` array (``[n, 2]`` uint64: address, length), adjacent ranges merged.

    Raises:
        ValueError: no range, a length < 1, or shapes that differ.
    """
    addrs = np.asarray(addresses, dtype=np.uint64).reshape(-1)
    sizes = np.asarray(lengths, dtype=np.uint64).reshape(-1)
    if addrs.size == 0 or addrs.shape != sizes.shape or bool((sizes == 0).any()):
        raise ValueError(f"need >= 1 range of >= 1 byte: {addrs.size} addresses, "
                         f"{sizes.size} lengths")
    # a range continuing where the previous one ended joins it
    starts = np.flatnonzero(addrs[1:] != addrs[:-1] + sizes[:-1]) + 1
    starts = np.insert(starts, 0, 0)
    out = np.empty((starts.size, 2), dtype=np.uint64)
    out[:, 0] = addrs[starts]
    out[:, 1] = np.add.reduceat(sizes, starts)
    return out


class IovRequest:
    """One UCP tagged send or receive; quacks like a ucxx request for ``UcxWorker.track``.

    A receive checks that exactly ``expected_nbytes`` arrived: fewer bytes (an
    abandoned receive is completed with an empty message) or a truncated one
    is a :class:`ProtocolError`.
    """

    def __init__(
        self, lib: UcpLibrary, value: int | None, what: str, expected_nbytes: int | None,
    ) -> None:
        self._lib = lib
        self._what = what
        self._expected = expected_nbytes
        self._request: int | None = None
        self._error: Exception | None = None
        status = ptr_status(value)
        if status is None:
            self._request = value
        elif status != UCS_OK:
            self._error = UcpError(what, status, lib.status_name(status))

    @property
    def completed(self) -> bool:
        request = self._request
        if request is None:
            return True
        if self._expected is None:
            status = self._lib.request_check_status(request)
        else:
            info = TagRecvInfo()
            status = self._lib.tag_recv_request_test(request, ctypes.byref(info))
            if status == UCS_OK and info.length != self._expected:
                self._error = ProtocolError(
                    f"{self._what}: {info.length} bytes arrived, expected {self._expected}"
                )
        if status == UCS_INPROGRESS:
            return False
        self._lib.request_free(request)
        self._request = None
        if status != UCS_OK and self._error is None:
            self._error = UcpError(self._what, status, self._lib.status_name(status))
        return True

    def check_error(self) -> None:
        """Raise the failure of a completed request (``UcxWorker`` maps it)."""
        if self._error is not None:
            raise self._error


def _param() -> RequestParam:
    return RequestParam(op_attr_mask=OP_DATATYPE, datatype=DATATYPE_IOV)


def post_recv_iov(
    lib: UcpLibrary, conn: UcxConnection, iov: npt.NDArray[np.uint64], channel: int
) -> asyncio.Future[None]:
    """Post a receive on ``channel`` scattering into the ranges of ``iov`` (see ``iov_array``).

    The memory belongs to UCX until the future resolves; a caller giving up
    must ``conn.cancel_recv(channel)`` or abort the connection.

    Raises:
        PeerClosedError: the connection is closed.
        UcpError: UCX refused the receive.
    """
    nbytes = int(iov[:, 1].sum())
    tag = conn.incoming_tag(channel)
    value = lib.tag_recv_nbx(
        conn.worker_handle, iov.ctypes.data, iov.shape[0], tag, _TAG_MASK_FULL,
        ctypes.byref(_param()),
    )
    request = IovRequest(lib, value, f"iov recv from {conn.peer}", nbytes)
    logger.debug("iov recv peer=%s channel=%d ranges=%d nbytes=%d", conn.peer, channel,
                 iov.shape[0], nbytes)
    return conn.track_recv(channel, request, keep=iov)


async def send_iov(
    lib: UcpLibrary, conn: UcxConnection, iov: npt.NDArray[np.uint64], channel: int, *,
    timeout_s: float,
) -> None:
    """Send the ranges of ``iov`` as one message on ``channel``; return once UCX is done.

    Raises:
        PeerClosedError, PeerTimeoutError, UcpError: the send failed (a timeout
            aborts the connection).
    """
    value = lib.tag_send_nbx(
        conn.endpoint_handle, iov.ctypes.data, iov.shape[0], conn.outgoing_tag(channel),
        ctypes.byref(_param()),
    )
    request = IovRequest(lib, value, f"iov send to {conn.peer}", None)
    logger.debug("iov send peer=%s channel=%d ranges=%d", conn.peer, channel, iov.shape[0])
    await conn.wait(conn.track_send(request, keep=iov), timeout_s=timeout_s, what="iov send")
