"""A stranger connected to an agent's port cannot read or write its memory with UCX RMA.

Two ways UCX serves a peer's put or get by raw address, with no key checked and
before kvbridge's handshake runs, so that every peer reaching the port could
read or write the whole process:

- a context with the RMA feature answers UCX's software-RMA messages (a put or
  a get emulated with active messages): kvbridge's contexts never take it;
- the tcp transport's own zero-copy put writes wherever its header says, with
  or without the feature: kvbridge's workers turn it off (``TCP_PUT_ENABLE=n``,
  ``transfer/ucx/worker.py``).

Here a stranger (a raw ucxx context with the feature, TCP only, as from
another host) connects to a kvbridge worker's listener and puts into and gets
from a buffer of this process by its address. The worker must serve neither,
and keep serving. The controls run the same attack against a worker whose
context has the feature and one with the tcp put left on: there it lands, so
the attack is real and the test can fail. Why one-sided reads are not UCX RMA
on CPU: docs/design.md, "One-sided reads".
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import ucxx._lib.libucxx as ucx_api

from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.ucp_lib import UCS_INPROGRESS, RequestParam, _find_library, ptr_status
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.transfer.inproc import HOST

NBYTES = 4096
TCP_ONLY = {"TLS": "tcp", "NET_DEVICES": "lo"}  # one lane, as between two hosts
WIREUP_S = 0.5  # the stranger's endpoint connects its lanes before it attacks
ATTACK_S = 1.0  # how long the stranger's requests get to complete
_NONE = ctypes.byref(RequestParam(op_attr_mask=0))


class _MemMapParams(ctypes.Structure):
    """``ucp_mem_map_params_t`` (UCX 1.21), the fields used here."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p),
                ("length", ctypes.c_size_t), ("flags", ctypes.c_uint), ("prot", ctypes.c_uint),
                ("memory_type", ctypes.c_int), ("exported_memh_buffer", ctypes.c_void_p)]


def _rma_calls() -> ctypes.CDLL:
    """libucp (the one ucxx loaded) with the RMA calls' signatures set."""
    ucp = ctypes.CDLL(_find_library("libucp"))
    vp, sz, u64, st, ptr = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int8,
                            ctypes.POINTER)
    for name, res, args in (
        ("ucp_mem_map", st, (vp, ptr(_MemMapParams), ptr(vp))),
        ("ucp_mem_unmap", st, (vp, vp)),
        ("ucp_rkey_pack", st, (vp, vp, ptr(vp), ptr(sz))),
        ("ucp_rkey_buffer_release", None, (vp,)),
        ("ucp_ep_rkey_unpack", st, (vp, vp, ptr(vp))),
        ("ucp_rkey_destroy", None, (vp,)),
        ("ucp_put_nbx", vp, (vp, vp, sz, u64, vp, ptr(RequestParam))),
        ("ucp_get_nbx", vp, (vp, vp, sz, u64, vp, ptr(RequestParam))),
        ("ucp_ep_flush_nbx", vp, (vp, ptr(RequestParam))),
        ("ucp_request_check_status", st, (vp,)),
        ("ucp_request_cancel", None, (vp, vp)),
        ("ucp_request_free", None, (vp,)),
    ):
        func = getattr(ucp, name)
        func.restype, func.argtypes = res, list(args)
    return ucp


class Stranger:
    """A UCX peer with the RMA feature, connected to ``port`` over TCP (no handshake)."""

    def __init__(self, port: int) -> None:
        self.ucp = _rma_calls()
        self.context = ucx_api.UCXContext(
            TCP_ONLY, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.RMA))
        self.worker = ucx_api.UCXWorker(self.context)
        self.endpoint = ucx_api.UCXEndpoint.create(self.worker, HOST, port, False)
        self.local = np.zeros(NBYTES, dtype=np.uint8)  # what it puts from and gets into
        self._memh, self._rkey = ctypes.c_void_p(), ctypes.c_void_p()
        self._requests: list[int] = []
        # A key of its own memory: over TCP it names no memory domain, and UCX's
        # software RMA then carries the raw remote address only.
        params = _MemMapParams(field_mask=0b11011, address=self.local.ctypes.data,
                               length=NBYTES, prot=0b11 | 1 << 8 | 1 << 9)
        assert self.ucp.ucp_mem_map(self.context.handle, ctypes.byref(params),
                                    ctypes.byref(self._memh)) == 0
        packed, size = ctypes.c_void_p(), ctypes.c_size_t()
        assert self.ucp.ucp_rkey_pack(self.context.handle, self._memh, ctypes.byref(packed),
                                      ctypes.byref(size)) == 0
        self._key = ctypes.create_string_buffer(
            ctypes.string_at(packed.value or 0, size.value), 512)
        self.ucp.ucp_rkey_buffer_release(packed)

    def post(self, op: str, remote_address: int) -> None:
        """Put our bytes to, or get into them from, ``remote_address`` of the peer; flush.

        Call once the endpoint's lanes are connected: a key unpacked before that
        names lanes the endpoint no longer has.
        """
        assert self.ucp.ucp_ep_rkey_unpack(self.endpoint.handle, self._key,
                                           ctypes.byref(self._rkey)) == 0
        call = self.ucp.ucp_put_nbx if op == "put" else self.ucp.ucp_get_nbx
        for value in (call(self.endpoint.handle, self.local.ctypes.data, NBYTES,
                           remote_address, self._rkey, _NONE),
                      self.ucp.ucp_ep_flush_nbx(self.endpoint.handle, _NONE)):
            status = ptr_status(value)
            if status is None:
                self._requests.append(value)
            else:
                assert status == 0, f"{op} refused at once: status {status}"

    def statuses(self) -> list[int]:
        """Each posted request's status (``UCS_INPROGRESS`` while it runs)."""
        self.worker.progress()
        return [self.ucp.ucp_request_check_status(r) for r in self._requests]

    def served(self) -> bool:
        """Every request posted completed, successfully."""
        return all(status == 0 for status in self.statuses())

    def close(self) -> None:
        for request in self._requests:
            self.ucp.ucp_request_cancel(self.worker.handle, request)
        deadline = time.monotonic() + 2.0
        while UCS_INPROGRESS in self.statuses() and time.monotonic() < deadline:
            pass
        for request in self._requests:
            self.ucp.ucp_request_free(request)
        if self._rkey.value:
            self.ucp.ucp_rkey_destroy(self._rkey)
        self.ucp.ucp_mem_unmap(self.context.handle, self._memh)
        self.endpoint.close()


@contextmanager
def context_features(monkeypatch: pytest.MonkeyPatch, rma: bool) -> Iterator[None]:
    """Workers made inside get kvbridge's own context (``rma=False``) or one with RMA."""
    if rma:
        real = ucx_api.UCXContext

        def with_rma(options: dict[str, str], feature_flags: tuple[object, ...]) -> object:
            return real(options, feature_flags=(*feature_flags, ucx_api.Feature.RMA))

        monkeypatch.setattr(ucx_api, "UCXContext", with_rma)
    try:
        yield
    finally:
        monkeypatch.undo()


async def _attack(port: int, op: str, victim: np.ndarray) -> tuple[bool, np.ndarray]:
    """The stranger's ``op`` on ``victim``'s address: whether it was served (every
    request completed without error), and the stranger's own bytes after it (what a
    get brought)."""
    stranger = Stranger(port)
    try:
        wired = time.monotonic() + WIREUP_S  # the endpoint's lanes connect first
        while time.monotonic() < wired:
            stranger.worker.progress()
            await asyncio.sleep(0.002)
        if op == "put":
            stranger.local[:] = 0xAB
        stranger.post(op, victim.ctypes.data)
        deadline = time.monotonic() + ATTACK_S
        while UCS_INPROGRESS in stranger.statuses() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)  # the server's driver progresses its worker
        return stranger.served(), stranger.local.copy()
    finally:
        stranger.close()


async def _still_serves(server_port: int) -> None:
    """A kvbridge peer connects to the same listener and is greeted as ever."""
    client = UcxWorker(config=TCP_ONLY)
    try:
        conn = await client.connect(HOST, server_port, timeout_s=5.0)
        conn.abort()
    finally:
        await client.close()


#: (context with the RMA feature, extra options of the attacked worker, whether the put
#: and the get are served). The controls show the attack is real: a context with the
#: feature serves both (UCX's software RMA), and the tcp transport's own put writes
#: wherever it is told unless kvbridge's default turns it off.
CASES = {
    "kvbridge": (False, {}, False, False),
    "control-rma": (True, {}, True, True),
    "control-tcp-put": (False, {"TCP_PUT_ENABLE": "y"}, True, False),
}


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_strangers_rma_is_not_served(op: str, case: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    rma, extra, put_served, get_served = CASES[case]
    victim = np.arange(NBYTES, dtype=np.uint64).astype(np.uint8)  # 0, 1, ..., 255, 0, ...
    before = victim.copy()

    async def on_connect(conn: UcxConnection) -> None:
        await asyncio.sleep(ATTACK_S + 3.0)  # no handshake: hold the connection open

    async def run() -> tuple[bool, np.ndarray]:
        with context_features(monkeypatch, rma):
            server = UcxWorker(config={**TCP_ONLY, **extra})
        try:
            port = server.listen(HOST, 0, on_connect, timeout_s=5.0)
            served, brought = await _attack(port, op, victim)
            await _still_serves(port)
            return served, brought
        finally:
            await server.close()

    served, brought = asyncio.run(run())
    if op == "put":
        assert (victim == 0xAB).all() if put_served else (victim == before).all(), (
            f"{case}: a stranger's put {'did not land' if put_served else 'changed memory'}")
        assert served == put_served
    else:
        assert (brought == before).all() == get_served, (
            f"{case}: a stranger's get {'brought nothing' if get_served else 'read memory'}")
        assert served == get_served


@pytest.mark.parametrize(("environ", "config", "enabled"), [
    ({}, {}, False),
    ({"UCX_TCP_PUT_ENABLE": "y"}, {}, True),
    ({"UCX_TCP_PUT_ENABLE": "y"}, {"TCP_PUT_ENABLE": "n"}, False),
], ids=["default", "environment", "config-over-environment"])
def test_the_tcp_put_is_off_unless_asked_for_and_then_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    environ: dict[str, str], config: dict[str, str], enabled: bool,
) -> None:
    monkeypatch.delenv("UCX_TCP_PUT_ENABLE", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)

    async def run() -> str:
        worker = UcxWorker(config=config)
        try:  # ours or the caller's, else the environment's
            return worker.options.get("TCP_PUT_ENABLE", os.environ.get("UCX_TCP_PUT_ENABLE", ""))
        finally:
            await worker.close()

    with caplog.at_level("WARNING", logger="kvbridge.transfer.ucx.worker"):
        value = asyncio.run(run())
    assert value == ("y" if enabled else "n")
    warned = [r for r in caplog.records if "UCX_TCP_PUT_ENABLE" in r.getMessage()]
    assert bool(warned) == enabled
