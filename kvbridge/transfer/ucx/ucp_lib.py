"""ctypes bindings of the libucp calls kvbridge makes itself, and their requests.

ucxx lacks IOV tag messages; and for the hot path (control frames,
progress) a direct call is several times cheaper than ucxx's wrappers. Every
call releases the GIL (``CDLL``): it may wait for the worker's lock, which
UCX's own thread can hold while it calls into Python (ucxx's listener
callback) — holding the GIL here would deadlock the process.

Shared by :mod:`.iov` (tagged messages gathered from / scattered into lists of
memory ranges), :mod:`.connection` (tagged sends, receives, control frames) and
:mod:`.worker` (progress). Every function here runs on the handles ucxx created, in the
same libucp ucxx loaded.

The structs below are written by hand from UCX's headers, which ctypes cannot
check: loading refuses a libucp outside ``SUPPORTED_UCP`` (``check_ucp_version``),
so a UCX whose layouts may differ fails at start with both versions named
instead of corrupting requests.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.transfer.errors import (
    PeerClosedError,
    PeerUnreachableError,
    ProtocolError,
    TransferError,
)

__all__ = [
    "CONN_CALLBACK",
    "DATATYPE_IOV",
    "EP_CLOSE_FORCE",
    "EP_CONN_REQUEST",
    "LISTENER_ATTR_SOCKADDR",
    "LISTENER_CONN_HANDLER",
    "LISTENER_SOCK_ADDR",
    "OP_DATATYPE",
    "OP_FLAGS",
    "STREAM_RECV_WAITALL",
    "EpParams",
    "ListenerAttr",
    "ListenerParams",
    "SUPPORTED_UCP",
    "UCS_INPROGRESS",
    "UCS_OK",
    "RequestParam",
    "TagRecvInfo",
    "UcpError",
    "UcpLibrary",
    "UcpRequest",
    "check_ucp_version",
    "ptr_status",
]

#: libucp versions ``[low, high)`` as (major, minor) that the structs below were
#: written for. ``RequestParam`` and ``TagRecvInfo`` follow UCX 1.21's ``ucp.h``
#: (tested with libucx 1.21.0); the range is what libucxx 0.52, the ucxx pinned in
#: pyproject.toml, accepts (libucx >= 1.19, < 1.22). UCX only appends fields to
#: ``ucp_request_param_t`` and reads one only when its ``op_attr_mask`` bit is set,
#: so a newer libucp would likely work too, but it is refused until checked.
SUPPORTED_UCP: tuple[tuple[int, int], tuple[int, int]] = ((1, 19), (1, 22))

UCS_OK, UCS_INPROGRESS = 0, 1
UCS_ERR_LAST = -100
UCS_ERR_MESSAGE_TRUNCATED, UCS_ERR_CANCELED = -9, -16
_LOST = (-24, -25)  # UCS_ERR_NOT_CONNECTED, UCS_ERR_CONNECTION_RESET
# ucp_request_param_t op_attr_mask bits
OP_DATATYPE = 1 << 3
OP_FLAGS = 1 << 4
DATATYPE_IOV = 2  # ucp_dt_make_iov()
STREAM_RECV_WAITALL = 1 << 0  # ucp_stream_recv_flags_t: complete only when full
EP_CLOSE_FORCE = 1 << 0  # ucp_ep_close_flags_t
# ucp_listener_params_t / ucp_ep_params_t field_mask bits, ucp_listener_attr_t's
LISTENER_SOCK_ADDR, LISTENER_CONN_HANDLER = 1 << 0, 1 << 2
EP_CONN_REQUEST = 1 << 6
LISTENER_ATTR_SOCKADDR = 1 << 0


class UcpError(TransferError):
    """A libucp call failed.

    Attributes:
        status: the ``ucs_status_t`` code (negative).
    """

    def __init__(self, what: str, status: int, name: str) -> None:
        super().__init__(f"{what}: {name} ({status})")
        self.status = status


class TagRecvInfo(ctypes.Structure):
    """``ucp_tag_recv_info_t``: what a completed tagged receive got."""

    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


class RequestParam(ctypes.Structure):
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class SockAddr(ctypes.Structure):
    """``ucs_sock_addr_t``."""

    _fields_ = [("addr", ctypes.c_void_p), ("addrlen", ctypes.c_uint32)]


class Handler(ctypes.Structure):
    """A ``{cb, arg}`` pair (``ucp_listener_conn_handler_t``, ``ucp_err_handler_t``)."""

    _fields_ = [("cb", ctypes.c_void_p), ("arg", ctypes.c_void_p)]


class ListenerParams(ctypes.Structure):
    """``ucp_listener_params_t``."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("sockaddr", SockAddr),
                ("accept_handler", Handler), ("conn_handler", Handler)]


class ListenerAttr(ctypes.Structure):
    """``ucp_listener_attr_t`` (``struct sockaddr_storage`` is 128 bytes, 8-aligned)."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("sockaddr", ctypes.c_ubyte * 128)]


class EpParams(ctypes.Structure):
    """``ucp_ep_params_t`` (UCX 1.21 ``ucp_def.h``)."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("err_mode", ctypes.c_int),
        ("err_handler", Handler),
        ("user_data", ctypes.c_void_p),
        ("flags", ctypes.c_uint),
        ("sockaddr", SockAddr),
        ("conn_request", ctypes.c_void_p),
        ("name", ctypes.c_char_p),
        ("local_sockaddr", SockAddr),
    ]


#: ``ucp_listener_conn_callback_t``: ``void (*)(ucp_conn_request_h, void *arg)``
CONN_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


def _find_library(stem: str) -> str:
    """Path of the ``stem`` (libucp/libucs) this process already mapped, else libucx's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if Path(path).name.startswith(f"{stem}.so"):
                    return path
    except OSError:
        pass
    import libucx  # the libucx-cu12 wheel that ucxx loads

    return str(Path(libucx.__file__).parent / "lib" / f"{stem}.so")


def check_ucp_version(
    found: tuple[int, int, int],
    supported: tuple[tuple[int, int], tuple[int, int]] = SUPPORTED_UCP,
) -> None:
    """Refuse a libucp whose version is outside ``supported`` (``[low, high)``, major.minor).

    Args:
        found: ``(major, minor, release)`` as ``ucp_get_version`` reports it.
        supported: the range to accept; default the one the structs were written for.

    Raises:
        ConfigError: outside the range; the message names both versions.
    """
    low, high = supported
    if not low <= found[:2] < high:
        raise ConfigError(
            f"libucp {'.'.join(map(str, found))} is outside [{low[0]}.{low[1]}, "
            f"{high[0]}.{high[1]}), the versions kvbridge's hand-written libucp structs "
            f"(kvbridge/transfer/ucx/ucp_lib.py) were written for: install a libucx-cu12 in that "
            f"range (the one the pinned ucxx-cu12 asks for), or check the structs against the "
            f"new ucp.h and widen SUPPORTED_UCP"
        )


class UcpLibrary:
    """The libucp/libucs functions this module calls, with their C signatures.

    Args:
        ucp_path: libucp to load; default the one ucxx already loaded (it must be
            the same library: the handles are only meaningful to it).

    Attributes:
        version: ``(major, minor, release)`` of the loaded libucp.

    Raises:
        OSError: the library cannot be loaded.
        ConfigError: its version is outside ``SUPPORTED_UCP``.
    """

    def __init__(self, ucp_path: str | None = None) -> None:
        if ctypes.sizeof(ctypes.c_void_p) != 8:
            raise OSError("the libucp binding assumes a 64-bit process")
        # ucs_status_t is a packed enum: one signed byte.
        vp, sz, u64, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int8
        ucp = ctypes.CDLL(ucp_path or _find_library("libucp"))
        ucs = ctypes.CDLL(_find_library("libucs"))
        ptr = ctypes.POINTER
        uint = ctypes.c_uint
        get_version = _fn(ucp.ucp_get_version, None, ptr(uint), ptr(uint), ptr(uint))
        parts = [uint(), uint(), uint()]
        get_version(*(ctypes.byref(part) for part in parts))
        major, minor, release = (part.value for part in parts)
        self.version = (major, minor, release)
        check_ucp_version(self.version)
        tag_args = (vp, vp, sz, u64)
        self.tag_send_nbx = _fn(ucp.ucp_tag_send_nbx, vp, *tag_args, ptr(RequestParam))
        self.tag_recv_nbx = _fn(ucp.ucp_tag_recv_nbx, vp, *tag_args, u64, ptr(RequestParam))
        self.tag_recv_request_test = _fn(ucp.ucp_tag_recv_request_test, st, vp, ptr(TagRecvInfo))
        self.request_check_status = _fn(ucp.ucp_request_check_status, st, vp)
        self.request_free = _fn(ucp.ucp_request_free, None, vp)
        self.request_cancel = _fn(ucp.ucp_request_cancel, None, vp, vp)
        self.worker_progress = _fn(ucp.ucp_worker_progress, ctypes.c_uint, vp)
        self.stream_send_nbx = _fn(ucp.ucp_stream_send_nbx, vp, vp, vp, sz, ptr(RequestParam))
        self.stream_recv_nbx = _fn(ucp.ucp_stream_recv_nbx, vp, vp, vp, sz, ptr(sz),
                                   ptr(RequestParam))
        self.listener_create = _fn(ucp.ucp_listener_create, st, vp, ptr(ListenerParams), ptr(vp))
        self.listener_query = _fn(ucp.ucp_listener_query, st, vp, ptr(ListenerAttr))
        self.listener_reject = _fn(ucp.ucp_listener_reject, st, vp, vp)
        self.listener_destroy = _fn(ucp.ucp_listener_destroy, None, vp)
        self.ep_create = _fn(ucp.ucp_ep_create, st, vp, ptr(EpParams), ptr(vp))
        self.ep_close_nbx = _fn(ucp.ucp_ep_close_nbx, vp, vp, ptr(RequestParam))
        self.status_string = _fn(ucs.ucs_status_string, ctypes.c_char_p, st)

    def status_name(self, status: int) -> str:
        """UCX's text for a status code."""
        text = self.status_string(status)
        return text.decode() if text else f"status {status}"

    def check(self, status: int, what: str) -> None:
        """Raise :class:`UcpError` unless ``status`` is UCS_OK."""
        if status != UCS_OK:
            raise UcpError(what, status, self.status_name(status))


def _fn(func: Any, restype: Any, *argtypes: Any) -> Any:
    func.restype = restype
    func.argtypes = list(argtypes)
    return func


def ptr_status(value: int | None) -> int | None:
    """None for a request pointer; else the status a UCS_PTR carries (NULL = OK)."""
    if value is None:
        return UCS_OK
    if value >= (1 << 64) + UCS_ERR_LAST:
        return value - (1 << 64)
    return None


class UcpRequest:
    """One UCP tagged send or receive; quacks like a ucxx request for ``UcxWorker.track``.

    Args:
        lib: the library that posted it.
        value: what the ``*_nbx`` call returned (request pointer or status).
        what: names the operation in errors.
        expected_nbytes: for a receive that must be filled exactly; None otherwise.

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
            self._error = _status_error(lib, what, status)

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
            self._error = _status_error(self._lib, self._what, status)
        return True

    def cancel(self, worker_handle: int) -> None:
        """Ask UCX to end the request; it completes (canceled) on the next progress."""
        if self._request is not None:
            self._lib.request_cancel(worker_handle, self._request)

    def check_error(self) -> None:
        """Raise the failure of a completed request (``UcxWorker`` maps it)."""
        if self._error is not None:
            raise self._error

def _status_error(lib: UcpLibrary, what: str, status: int) -> TransferError:
    """The typed error of a failed request: truncation is the peer's protocol fault,
    cancellation a closed connection, anything else a :class:`UcpError`."""
    if status == UCS_ERR_MESSAGE_TRUNCATED:
        return ProtocolError(f"{what}: message larger than the posted buffer")
    if status == UCS_ERR_CANCELED:
        return PeerClosedError(f"{what}: canceled")
    if status in _LOST or -89 <= status <= -40:  # link and endpoint failures
        return PeerClosedError(f"{what}: connection lost ({lib.status_name(status)})")
    if status in (-6, -23):  # UNREACHABLE, REJECTED
        return PeerUnreachableError(f"{what}: peer unreachable ({lib.status_name(status)})")
    return UcpError(what, status, lib.status_name(status))
