"""Tagged UCX messages gathered from, or scattered into, lists of memory ranges.

The direct read path (``serving/direct.py`` / ``reading/direct.py``) sends a
chunk of KV blocks as ONE tagged message whose bytes come straight from the
server's cache blocks and land straight in the reader's cache blocks: UCX's IOV datatype walks both
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

from kvbridge.transfer.ucx.connection import TAG_MASK_FULL, UcxConnection
from kvbridge.transfer.ucx.ucp_lib import (
    DATATYPE_IOV,
    OP_DATATYPE,
    RequestParam,
    UcpLibrary,
    UcpRequest,
)

__all__ = ["Ranges", "iov_array", "post_recv_iov", "post_send_iov", "send_iov"]

logger = logging.getLogger(__name__)

Ranges = tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]  # (addresses, lengths)


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
    out = np.empty((addrs.size, 2), dtype=np.uint64)
    # a range continuing where the previous one ended joins it
    joins = addrs[1:] == addrs[:-1] + sizes[:-1]
    if not joins.any():  # scattered blocks: nothing to merge
        out[:, 0], out[:, 1] = addrs, sizes
        return out
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = out[: starts.size]
    merged[:, 0] = addrs[starts]
    merged[:, 1] = np.add.reduceat(sizes, starts)
    return merged.copy()


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
        conn.worker_handle, iov.ctypes.data, iov.shape[0], tag, TAG_MASK_FULL,
        ctypes.byref(_param()),
    )
    request = UcpRequest(lib, value, f"iov recv from {conn.peer}", nbytes)
    logger.debug("iov recv peer=%s channel=%d ranges=%d nbytes=%d", conn.peer, channel,
                 iov.shape[0], nbytes)
    return conn.track_recv(channel, request, keep=iov)


def post_send_iov(
    lib: UcpLibrary, conn: UcxConnection, iov: npt.NDArray[np.uint64], channel: int
) -> asyncio.Future[None]:
    """Post the ranges of ``iov`` as one message on ``channel``; the future ends with it.

    The memory must stay untouched until the future resolves.

    Raises:
        PeerClosedError: the connection is closed.
        UcpError: UCX refused the send.
    """
    value = lib.tag_send_nbx(
        conn.endpoint_handle, iov.ctypes.data, iov.shape[0], conn.outgoing_tag(channel),
        ctypes.byref(_param()),
    )
    request = UcpRequest(lib, value, f"iov send to {conn.peer}", None)
    logger.debug("iov send peer=%s channel=%d ranges=%d", conn.peer, channel, iov.shape[0])
    return conn.track_send(request, keep=iov)


async def send_iov(
    lib: UcpLibrary, conn: UcxConnection, iov: npt.NDArray[np.uint64], channel: int, *,
    timeout_s: float,
) -> None:
    """Send the ranges of ``iov`` as one message on ``channel``; return once UCX is done.

    Raises:
        PeerClosedError, PeerTimeoutError, UcpError: the send failed (a timeout
            aborts the connection).
    """
    sent = post_send_iov(lib, conn, iov, channel)
    await conn.wait(sent, timeout_s=timeout_s, what="iov send")
