"""SGLang's per-request sender (P) and receiver (D), and P's bootstrap server.

Thin subclasses of SGLang's ``Common*`` classes: the state machine, timeouts,
rank mapping and bootstrap are SGLang's; what kvbridge changes is when a
request may end. An abort on either side stops kvbridge's part first (P
revokes its grant, D cancels its read) and the request turns Failed only when
nothing of it can touch its pages any more (``manager.py``).
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import numpy as np
import numpy.typing as npt
from aiohttp import web
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVReceiver,
    CommonKVSender,
)

from kvbridge.integrations.sglang.manager import KVBridgeKVManager
from kvbridge.integrations.sglang.messages import MAC_HEADER, Abort, registration_mac
from kvbridge.integrations.sglang.settings import SglangSettings

__all__ = ["KVBridgeKVBootstrapServer", "KVBridgeKVReceiver", "KVBridgeKVSender"]

logger = logging.getLogger(__name__)


class KVBridgeKVSender(CommonKVSender):
    """P's side of one request: SGLang's sender; its grant outlives an abort until
    the reads in flight end."""

    kv_mgr: KVBridgeKVManager
    _draining = False

    def poll(self) -> Any:
        if self._draining:
            if self.kv_mgr.grant_held(self.bootstrap_room):
                return KVPoll.Transferring
            self._draining = False
            self.conclude_state = KVPoll.Failed
        return super().poll()

    def abort(self) -> None:
        if self.kv_mgr.end_grant(self.bootstrap_room, "Aborted by AbortReq."):
            self._draining = True  # Failed once the grant is released
            return
        super().abort()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)


class KVBridgeKVReceiver(CommonKVReceiver):
    """D's side of one request: SGLang's receiver; its pages are read into by
    kvbridge's agent, and an abort cancels that read before they go back."""

    kv_mgr: KVBridgeKVManager
    _draining = False

    def send_metadata(self, kv_indices: npt.NDArray[np.int32], aux_index: int | None = None,
                      state_indices: Any = None, decode_prefix_len: int | None = None,
                      *args: Any, **kwargs: Any) -> None:
        if self.bootstrap_infos:
            self.kv_mgr.expect(self.bootstrap_room, kv_indices, aux_index,
                               [(str(info["rank_ip"]), int(info["rank_port"]))
                                for info in self.bootstrap_infos])
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len,
                              *args, **kwargs)

    def _poll(self) -> Any:
        if self._draining:
            if self.kv_mgr.read_in_flight(self.bootstrap_room):
                return KVPoll.Transferring
            self._draining = False
        return super()._poll()

    def abort(self) -> None:
        if not self.kv_mgr.stop_read(self.bootstrap_room):
            logger.warning("kvbridge: request %s's read did not stop in time; its pages "
                           "stay held until it ends", self.bootstrap_room)
            self._draining = True
        super().abort()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        """SGLang's abort notice to P, as kvbridge's authenticated ``Abort``."""
        message = self.kv_mgr.codec.encode(Abort(
            room=self.bootstrap_room, endpoint=self.kv_mgr.local_ip, port=self.kv_mgr.rank_port))
        for info in self.bootstrap_infos or []:
            try:
                sock, lock = self._connect_to_bootstrap_server(info)
                with lock:
                    sock.send_multipart(message)
            except Exception as exc:  # best effort, as SGLang's own: P's lease ends it
                logger.debug("kvbridge: abort notice for %s not sent: %s",
                             self.bootstrap_room, exc)


class KVBridgeKVBootstrapServer(CommonKVBootstrapServer):
    """P's bootstrap registry (SGLang's HTTP ``/route``), which accepts a rank's
    registration only with the MAC P's ranks make under the cluster secret.

    Raises:
        ConfigError: no usable secret (as the agents: ``settings.py``).
    """

    def __init__(self, host: str, port: int) -> None:
        # Before SGLang's __init__, which starts serving.
        self._secret = SglangSettings.from_env(host, host).secret
        super().__init__(host, port)

    async def _handle_route_put(self, request: web.Request) -> web.Response:
        body = await request.read()  # kept by aiohttp for SGLang's handler
        mac = request.headers.get(MAC_HEADER, "")
        if self._secret is not None and not hmac.compare_digest(
                registration_mac(self._secret, body), mac):
            logger.warning("kvbridge: refused a bootstrap registration from %s without a "
                           "valid %s", request.remote, MAC_HEADER)
            return web.Response(status=403, text="registration not authenticated (kvbridge)")
        try:
            response: web.Response = await super()._handle_route_put(request)
        except (KeyError, TypeError, ValueError) as exc:
            return web.Response(status=400, text=f"bad registration: {exc!r}"[:300])
        return response
