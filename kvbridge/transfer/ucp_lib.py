"""ctypes bindings of the few libucp calls ucxx does not expose (RMA, IOV tag messages).

Shared by :mod:`kvbridge.transfer.rma` (one-sided put/get) and
:mod:`kvbridge.transfer.iov` (tagged messages gathered from / scattered into
lists of memory ranges). Every function here runs on the handles ucxx created,
in the same libucp ucxx loaded.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from kvbridge.transfer.errors import TransferError

__all__ = [
    "DATATYPE_IOV",
    "MEMORY_TYPE_HOST",
    "OP_DATATYPE",
    "OP_MEMH",
    "OP_MEMORY_TYPE",
    "UCS_INPROGRESS",
    "UCS_OK",
    "IovEntry",
    "MemMapParams",
    "RequestParam",
    "TagRecvInfo",
    "UcpError",
    "UcpLibrary",
    "ptr_status",
]

UCS_OK, UCS_INPROGRESS = 0, 1
UCS_ERR_LAST = -100
MEMORY_TYPE_HOST = 0
# ucp_request_param_t op_attr_mask bits
OP_DATATYPE, OP_MEMORY_TYPE, OP_MEMH = 1 << 3, 1 << 6, 1 << 8
DATATYPE_IOV = 2  # ucp_dt_make_iov()


class UcpError(TransferError):
    """A libucp call failed.

    Attributes:
        status: the ``ucs_status_t`` code (negative).
    """

    def __init__(self, what: str, status: int, name: str) -> None:
        super().__init__(f"{what}: {name} ({status})")
        self.status = status


class IovEntry(ctypes.Structure):
    """``ucp_dt_iov_t``: one memory range of an IOV datatype."""

    _fields_ = [("buffer", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class TagRecvInfo(ctypes.Structure):
    """``ucp_tag_recv_info_t``: what a completed tagged receive got."""

    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


class MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


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


class UcpLibrary:
    """The libucp/libucs functions this module calls, with their C signatures.

    Args:
        ucp_path: libucp to load; default the one ucxx already loaded (it must be
            the same library: the handles are only meaningful to it).

    Raises:
        OSError: the library cannot be loaded.
    """

    def __init__(self, ucp_path: str | None = None) -> None:
        if ctypes.sizeof(ctypes.c_void_p) != 8:
            raise OSError("the libucp binding assumes a 64-bit process")
        # ucs_status_t is a packed enum: one signed byte.
        vp, sz, u64, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int8
        ucp = ctypes.CDLL(ucp_path or _find_library("libucp"))
        ucs = ctypes.CDLL(_find_library("libucs"))
        ptr = ctypes.POINTER
        self.mem_map = _fn(ucp.ucp_mem_map, st, vp, ptr(MemMapParams), ptr(vp))
        self.mem_unmap = _fn(ucp.ucp_mem_unmap, st, vp, vp)
        # ucp_rkey_pack, not ucp_memh_pack: the latter packs only exported handles
        # and aborts the process when asked for a plain remote key.
        self.rkey_pack = _fn(ucp.ucp_rkey_pack, st, vp, vp, ptr(vp), ptr(sz))
        self.rkey_buffer_release = _fn(ucp.ucp_rkey_buffer_release, None, vp)
        self.rkey_unpack = _fn(ucp.ucp_ep_rkey_unpack, st, vp, vp, ptr(vp))
        self.rkey_destroy = _fn(ucp.ucp_rkey_destroy, None, vp)
        rma_args = (vp, vp, sz, u64, vp, ptr(RequestParam))
        self.put_nbx = _fn(ucp.ucp_put_nbx, vp, *rma_args)
        self.get_nbx = _fn(ucp.ucp_get_nbx, vp, *rma_args)
        self.ep_flush_nbx = _fn(ucp.ucp_ep_flush_nbx, vp, vp, ptr(RequestParam))
        tag_args = (vp, vp, sz, u64)
        self.tag_send_nbx = _fn(ucp.ucp_tag_send_nbx, vp, *tag_args, ptr(RequestParam))
        self.tag_recv_nbx = _fn(ucp.ucp_tag_recv_nbx, vp, *tag_args, u64, ptr(RequestParam))
        self.tag_recv_request_test = _fn(ucp.ucp_tag_recv_request_test, st, vp, ptr(TagRecvInfo))
        self.request_check_status = _fn(ucp.ucp_request_check_status, st, vp)
        self.request_free = _fn(ucp.ucp_request_free, None, vp)
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
