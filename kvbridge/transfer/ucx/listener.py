"""A UCX listener bound to one address, and the endpoints it accepts (libucp via ctypes).

Used by :class:`~kvbridge.transfer.ucx.worker.UcxWorker` only, on its event-loop
thread. ucxx's listener takes a port and binds every interface (``INADDR_ANY``):
an agent that advertises ``10.0.0.1`` would also answer on every other address
of the host (a public NIC, a container bridge). This one binds the address it
is given (``"0.0.0.0"`` / ``"::"`` still mean every interface, for deployments
behind NAT that advertise an address the host does not have).

Endpoints accepted here are libucp ``ucp_ep_h`` handles (:class:`UcpEndpoint`),
created like ucxx's, with peer error handling off (see ``worker.py`` for why);
the connection drives them through the same libucp calls as ucxx's endpoints.
"""

from __future__ import annotations

import ctypes
import socket
import struct
from collections.abc import Callable

from kvbridge.transfer.errors import PeerUnreachableError
from kvbridge.transfer.ucx.ucp_lib import (
    CONN_CALLBACK,
    EP_CLOSE_FORCE,
    EP_CONN_REQUEST,
    LISTENER_ATTR_SOCKADDR,
    LISTENER_CONN_HANDLER,
    LISTENER_SOCK_ADDR,
    OP_FLAGS,
    UCS_OK,
    EpParams,
    Handler,
    ListenerAttr,
    ListenerParams,
    RequestParam,
    SockAddr,
    UcpLibrary,
    UcpRequest,
)

__all__ = ["UcpEndpoint", "UcpListener", "sockaddr"]

_FORCE = RequestParam(op_attr_mask=OP_FLAGS, flags=EP_CLOSE_FORCE)


def sockaddr(host: str, port: int) -> bytes:
    """The ``struct sockaddr_in`` / ``sockaddr_in6`` of ``host`` (a name is resolved).

    Raises:
        PeerUnreachableError: ``host`` does not resolve or ``port`` is no port.
    """
    if not 0 <= port <= 65535:
        raise PeerUnreachableError(f"cannot listen on port {port}: not a TCP port")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise PeerUnreachableError(f"cannot listen on {host!r}: {exc}") from exc
    family, _, _, _, address = infos[0]
    ip = str(address[0])
    if family == socket.AF_INET:
        return (struct.pack("=H", socket.AF_INET) + struct.pack("!H", port)
                + socket.inet_pton(socket.AF_INET, ip) + bytes(8))
    if family == socket.AF_INET6:
        scope_id = int(address[3]) if len(address) > 3 else 0
        return (struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0)
                + socket.inet_pton(socket.AF_INET6, ip) + struct.pack("=I", scope_id))
    raise PeerUnreachableError(f"cannot listen on {host!r}: address family {family}")


class UcpEndpoint:
    """An endpoint the listener accepted: the ``ucp_ep_h`` and how to close it.

    Duck-types the part of ucxx's ``UCXEndpoint`` that ``UcxConnection`` uses
    (``handle``, ``close``). ``close`` forces the endpoint closed; the request
    it returns, if any, goes to ``on_close_request`` (the worker tracks it).
    """

    def __init__(self, lib: UcpLibrary, handle: int,
                 on_close_request: Callable[[UcpRequest], None]) -> None:
        self._lib = lib
        self._handle: int | None = handle
        self._on_close_request = on_close_request

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise ValueError("endpoint closed")
        return self._handle

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            value = self._lib.ep_close_nbx(handle, ctypes.byref(_FORCE))
            self._on_close_request(UcpRequest(self._lib, value, "endpoint close", None))


class UcpListener:
    """Accepts UCX connection requests on ``host:port`` (``port`` 0: any free port).

    Args:
        lib: libucp.
        worker_handle: the ``ucp_worker_h`` whose progress delivers requests.
        host: address to bind (``"0.0.0.0"`` / ``"::"``: every interface).
        port: TCP port.
        on_request: called with each ``ucp_conn_request_h``, from within the
            worker's progress (``ucp_worker_progress``): it must not progress
            the worker itself; it may call :meth:`accept` or :meth:`reject`.

    Attributes:
        port: the port bound.

    Raises:
        PeerUnreachableError: the address cannot be bound (taken, not ours).
    """

    def __init__(self, lib: UcpLibrary, worker_handle: int, host: str, port: int,
                 on_request: Callable[[int], None]) -> None:
        self._lib, self._worker_handle = lib, worker_handle
        self.host = host
        address = ctypes.create_string_buffer(sockaddr(host, port))

        def callback(conn_request: int | None, _arg: int | None) -> None:
            if conn_request:
                on_request(conn_request)

        self._callback = CONN_CALLBACK(callback)  # alive as long as the listener
        params = ListenerParams(
            field_mask=LISTENER_SOCK_ADDR | LISTENER_CONN_HANDLER,
            sockaddr=SockAddr(ctypes.addressof(address), len(address.raw)),
            conn_handler=Handler(ctypes.cast(self._callback, ctypes.c_void_p), None),
        )
        handle = ctypes.c_void_p()
        status = lib.listener_create(worker_handle, ctypes.byref(params), ctypes.byref(handle))
        if status != UCS_OK:
            raise PeerUnreachableError(
                f"cannot listen on {host}:{port}: {lib.status_name(status)} (is the address "
                f"one of this host's, and the port free?)")
        self._handle: int | None = handle.value
        attr = ListenerAttr(field_mask=LISTENER_ATTR_SOCKADDR)
        lib.check(lib.listener_query(self._handle, ctypes.byref(attr)), "listener query")
        self.port: int = struct.unpack("!H", bytes(attr.sockaddr[2:4]))[0]

    def accept(self, conn_request: int, on_close_request: Callable[[UcpRequest], None]
               ) -> UcpEndpoint:
        """An endpoint for ``conn_request`` (peer error handling off, as ucxx's).

        Raises:
            PeerUnreachableError: UCX could not create it (the peer went away).
        """
        params = EpParams(field_mask=EP_CONN_REQUEST, conn_request=conn_request)
        handle = ctypes.c_void_p()
        status = self._lib.ep_create(self._worker_handle, ctypes.byref(params),
                                     ctypes.byref(handle))
        if status != UCS_OK or not handle.value:
            raise PeerUnreachableError(f"accepting a connection: {self._lib.status_name(status)}")
        return UcpEndpoint(self._lib, handle.value, on_close_request)

    def reject(self, conn_request: int) -> None:
        """Refuse ``conn_request`` (the peer's connect fails); errors are ignored."""
        if self._handle is not None:
            self._lib.listener_reject(self._handle, conn_request)

    def close(self) -> None:
        """Stop listening (the port is released). Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.listener_destroy(handle)
