"""``KVBridgeKVManager``: one SGLang scheduler's transfer agent, grants and reads.

SGLang builds one manager per TP rank's scheduler process (P and D alike) and
calls it from its scheduler thread; kvbridge adds two threads per manager:

- the *control* thread reads kvbridge's messages from SGLang's ZMQ socket
  (``messages.py``: P hears ``Wanted``/``Abort``, D hears ``Ready``/``Failed``);
- the *outcome* thread turns the agent's news into SGLang states: on P a grant
  released (every reader done: Success; lease ended or revoked: Failed), on D a
  read ended (Success, or Failed with the read's error).

kvbridge pulls where SGLang's own backends push::

    P scheduler      send(chunk) .. send(last) -> grant the pages, Ready -> D ranks
    D control        Ready from every P rank it asked -> aux row into its slot,
                     start_read(P's pages -> its own pages)
    D outcome        read ended -> Success (or Failed)      P outcome: grant released

A state becomes terminal only when no byte of the request can move any more:
on P once its grant is released (so SGLang frees pages no reader still copies),
on D once its read ended (so SGLang reuses pages no read still writes).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import requests
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.distributed.parallel_state import get_attn_tp_group
from sglang.srt.utils.network import NetworkAddress

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.integrations.sglang.caches import find_tensors, sglang_caches
from kvbridge.integrations.sglang.messages import (
    MAC_HEADER,
    Abort,
    Done,
    Failed,
    Message,
    MessageCodec,
    MessageError,
    Ready,
    Registered,
    Wanted,
    page_ids_of,
    registration_mac,
)
from kvbridge.integrations.sglang.settings import SglangSettings
from kvbridge.transfer.agent import TransferAgent

__all__ = ["KVBridgeKVManager"]

logger = logging.getLogger(__name__)

_POLL_S = 0.2


@dataclass(slots=True)
class _Target:
    """A D rank that asked this P rank for a room (read by SGLang's Common code too)."""

    endpoint: str
    dst_port: int
    is_dummy: bool


@dataclass(slots=True)
class _Outgoing:
    """P: a room's pages so far, and whether its grant is held."""

    pages: list[npt.NDArray[np.int64]] = field(default_factory=list)
    num_tokens: int = 0
    granted: bool = False
    num_done: int = 0  # D ranks that said Done (their reads ended well)


@dataclass(slots=True)
class _Incoming:
    """D: where a room's KV lands, and P's readiness per P rank."""

    page_ids: npt.NDArray[np.int64]
    aux_index: int
    prefill_ranks: list[tuple[str, int]]  # the control endpoints of the P ranks asked
    readies: dict[int, Ready] = field(default_factory=dict)
    reading: bool = False
    ended: bool = False


class KVBridgeKVManager(CommonKVManager):
    """SGLang's transfer manager on kvbridge (see the module docstring).

    Raises:
        ConfigError: a deployment the backend does not serve (named with what to
            change), or a pool it cannot register.
    """

    def __init__(self, args: Any, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._refuse_unsupported()
        self.is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        self.settings = SglangSettings.from_env(server_args.host, self.local_ip)
        model_id = server_args.served_model_name or server_args.model_path
        caches = sglang_caches(args, is_mla=bool(is_mla_backend),
                               attn_tp_size=self.attn_tp_size, model_id=str(model_id))
        self.page_size = caches.topology.block_size
        self._aux = self._aux_views(args)
        role = "prefill" if self.is_prefill else "decode"
        self.engine_id = (f"sglang-{role}-{self.local_ip}-{server_args.port}"
                          f"-dp{self.attn_dp_rank}")
        self.codec = MessageCodec(self.settings.secret)
        self._news = threading.Event()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.agent = TransferAgent(
            self.engine_id, caches.topology, self.attn_tp_rank, 0, caches.compat,
            secret=self.settings.secret, config=self.settings.agent, on_event=self._news.set,
        )
        self.agent.register_kv_caches(caches.planes)
        port = self.agent.start()
        self._outgoing: dict[int, _Outgoing] = {}
        self._incoming: dict[int, _Incoming] = {}
        if self.is_prefill:
            # Every P rank serves its heads; a reader needs every rank's port, and the
            # ranks derive one grant per room from rank 0's key (no message needed).
            mine = (port, secrets.token_bytes(32))
            gathered = (get_attn_tp_group().all_gather_object(mine)
                        if self.attn_tp_size > 1 else [mine])
            self.agent_ports = [int(p) for p, _ in gathered]
            self._grant_key: bytes = gathered[0][1]
            self._start(self._serve_prefill, "control")
            self._start(self._prefill_outcomes, "outcomes")
        else:
            self._start(self._serve_decode, "control")
            self._start(self._decode_outcomes, "outcomes")
            self._start_heartbeat_checker_thread()
        logger.info("kvbridge %s rank %d: agent on %s:%d, %d pages of %d tokens", role,
                    self.attn_tp_rank, self.settings.host, port, caches.num_pages,
                    self.page_size)

    # ------------------------------------------------------------------ set-up
    def _refuse_unsupported(self) -> None:
        unsupported = {
            "pipeline parallel (--pp-size)": self.pp_size > 1,
            "context parallel attention": self.attn_cp_size > 1 or self.dcp_size > 1,
            "KV cache sharding": self.kv_shard_size > 1,
            "--disaggregation-decode-allocation-policy prefill_complete":
                self.defer_decode_allocation,
        }
        named = [name for name, on in unsupported.items() if on]
        if named:
            raise ConfigError(f"the kvbridge transfer backend does not serve "
                              f"{', '.join(named)} yet: turn it off, or use another "
                              f"--disaggregation-transfer-backend")

    @staticmethod
    def _aux_views(args: Any) -> list[torch.Tensor]:
        """The metadata buffers (first token, logprobs, ...) as ``[slots, row bytes]``."""
        lens, items = list(args.aux_data_lens), list(args.aux_item_lens)
        tensors = find_tensors(list(args.aux_data_ptrs), lens)
        views = []
        for tensor, nbytes, item in zip(tensors, lens, items, strict=True):
            if tensor.device.type != "cpu" or item < 1 or nbytes % item:
                raise ConfigError(f"SGLang metadata buffer on {tensor.device} of {nbytes} "
                                  f"bytes in rows of {item}: kvbridge moves CPU rows only")
            views.append(tensor.view(torch.uint8).view(-1)[:nbytes].view(nbytes // item, item))
        return views

    def _register_topology_row(self, url: str, payload: dict[str, Any]) -> None:
        """SGLang's registration with P's bootstrap server, with kvbridge's MAC."""
        body = json.dumps(payload).encode()
        headers = {"content-type": "application/json"}
        secret = SglangSettings.from_env(self.server_args.host, self.local_ip).secret
        if secret is not None:
            headers[MAC_HEADER] = registration_mac(secret, body)
        for attempt in range(5):
            try:
                response = requests.put(url, data=body, headers=headers, timeout=5)
                if response.status_code == 200:
                    return
                logger.warning("kvbridge: bootstrap registration answered %d: %s",
                               response.status_code, response.text[:200])
            except requests.RequestException as exc:
                logger.warning("kvbridge: bootstrap registration failed: %s", exc)
            time.sleep(min(2.0 ** attempt, 8.0))
        logger.error("kvbridge: this prefill rank could not register with %s", url)

    def _start(self, target: Any, name: str) -> None:
        def guarded() -> None:
            try:
                target()
            except Exception:
                if not self._closed.is_set():
                    logger.exception("kvbridge %s thread died; requests will time out", name)
                    raise

        threading.Thread(target=guarded, name=f"kvbridge-sglang-{name}", daemon=True).start()

    def teardown(self) -> None:
        """Stop the agent (the threads end with the process)."""
        self._closed.set()
        self.agent.close()

    def _send(self, endpoint: str, port: int, message: Message) -> None:
        address = NetworkAddress(endpoint, port)
        try:
            self._send_multipart_locked(address.to_tcp(), self.codec.encode(message),
                                        is_ipv6=address.is_ipv6)
        except Exception as exc:  # a dead peer: its own deadlines end its side
            logger.warning("kvbridge: could not send %s to %s:%d: %s",
                           type(message).__name__, endpoint, port, exc)

    def _receive(self) -> Message | None:
        frames = self.server_socket.recv_multipart()
        if not self.codec.is_ours(frames):
            logger.warning("kvbridge: dropped a message that is not kvbridge's (%d frames, "
                           "first %r)", len(frames), frames[0][:16] if frames else b"")
            return None
        try:
            return self.codec.decode(frames)
        except MessageError as exc:
            logger.warning("kvbridge: dropped a control message: %s", exc)
            return None

    def fail(self, room: int, reason: str) -> None:
        """Record ``reason`` for ``room`` (the first one stays) and mark it Failed."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
        self.update_status(room, KVPoll.Failed)

    # ------------------------------------------------------------------ prefill
    def _serve_prefill(self) -> None:
        while not self._closed.is_set():
            self._handle(self._receive(), self._on_prefill_message)

    def _handle(self, message: Message | None, handler: Any) -> None:
        """Run ``handler``; a message it cannot handle fails its room, not the thread."""
        if message is None:
            return
        try:
            handler(message)
        except Exception as exc:
            logger.exception("kvbridge: handling %s failed", type(message).__name__)
            room = getattr(message, "room", None)
            if room is not None and room in self.request_status:
                self.fail(room, f"kvbridge: handling {type(message).__name__} failed: {exc}")

    def _on_prefill_message(self, message: Message) -> None:
        match message:
            case Wanted() as msg:
                self._on_wanted(msg)
            case Abort() as msg:
                self.end_grant(msg.room, "aborted by the decode server")
            case Done() as msg:
                self._on_done(msg)
            case Registered() as msg:
                logger.debug("kvbridge: decode %s rank %d/%d registered", msg.engine_id,
                             msg.tp_rank, msg.tp_size)
            case msg:
                logger.warning("kvbridge: prefill got an unexpected %s", type(msg).__name__)

    def _on_wanted(self, msg: Wanted) -> None:
        infos = self.transfer_infos.setdefault(msg.room, {})
        infos[f"{msg.engine_id}:{msg.tp_rank}"] = _Target(msg.endpoint, msg.port, msg.is_dummy)
        if len(infos) >= msg.num_wanted:
            self.req_to_decode_prefix_len[msg.room] = msg.decode_prefix_len
            self.update_status(msg.room, KVPoll.WaitingForInput)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: npt.NDArray[np.int32],
                             index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: Any = None,
                             num_kv_tokens: int | None = None, **_: Any) -> None:
        """Called by the sender per prefilled chunk: keep its pages; on the last, grant
        them and tell every D rank of the room where to read."""
        room = bootstrap_room
        targets = self.transfer_infos.get(room)
        if not targets:  # cleared, or a dummy rank
            return
        with self._lock:
            out = self._outgoing.setdefault(room, _Outgoing())
            out.pages.append(np.asarray(kv_indices, dtype=np.int64))
            out.num_tokens += (num_kv_tokens if num_kv_tokens is not None
                               else len(kv_indices) * self.page_size)
            if not is_last_chunk:
                return
            pages = np.concatenate(out.pages)
            out.granted = True
        self.update_status(room, KVPoll.Transferring)
        grant = self._grant_of(room)
        try:
            aux_rows = self._aux_rows(aux_index)  # before the grant: nothing held if it fails
            self.agent.issue_grant(str(room), pages.tolist(), None, grant=grant)
        except (KVBridgeError, ValueError, IndexError) as exc:
            with self._lock:
                out.granted = False
            self.fail(room, f"kvbridge could not hold request {room}'s KV: {exc}")
            self._tell_failed(room)
            return
        ready = Ready(
            room=room, engine_id=self.engine_id, tp_rank=self.attn_tp_rank,
            agent_host=self.settings.host, agent_ports=self.agent_ports, grant=grant,
            page_ids=pages.astype("<i4").tobytes(), page_size=self.page_size,
            num_tokens=out.num_tokens, aux_rows=aux_rows,
        )
        for endpoint, port in {(t.endpoint, t.dst_port) for t in list(targets.values())}:
            self._send(endpoint, port, ready)

    def _grant_of(self, room: int) -> str:
        digest = hashlib.blake2b(str(room).encode(), key=self._grant_key, digest_size=18)
        return base64.urlsafe_b64encode(digest.digest()).decode()

    def _aux_rows(self, aux_index: int | None) -> list[bytes]:
        if aux_index is None:
            return []
        return [bytes(view[aux_index].numpy()) for view in self._aux]

    def _on_done(self, msg: Done) -> None:
        """A D rank holds the KV: once every D rank that asked said so, the grant ends
        (a P rank no reader chose, e.g. another replica of an MLA latent, frees now
        rather than at its lease's end)."""
        targets = self.transfer_infos.get(msg.room) or {}
        with self._lock:
            out = self._outgoing.get(msg.room)
            if out is None or not out.granted:
                return
            out.num_done += 1
            if out.num_done < len(targets):
                return
        self.agent.grants.revoke(str(msg.room))  # a grant its readers released: a no-op

    def end_grant(self, room: int, reason: str) -> bool:
        """End ``room`` on P for ``reason``: revoke its grant (Failed once released:
        reads in flight finish first) or, with none held, fail it now.

        Returns:
            True when a grant was held (the room turns Failed at its release).
        """
        with self._lock:
            out = self._outgoing.get(room)
            held = out is not None and out.granted
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
        if held and self.agent.grants.revoke(str(room)):
            return True
        if room in self.request_status and self.request_status[room] != KVPoll.Success:
            self.update_status(room, KVPoll.Failed)
        return False

    def grant_held(self, room: int) -> bool:
        """Whether ``room``'s grant is issued and not yet released."""
        with self._lock:
            out = self._outgoing.get(room)
            return out is not None and out.granted

    def forget(self, room: int) -> None:
        """The sender cleared ``room``: drop its pages (a held grant is revoked)."""
        if self.is_prefill and self.grant_held(room):
            self.agent.grants.revoke(str(room))
            return  # dropped at its release
        with self._lock:
            self._outgoing.pop(room, None)
            self._incoming.pop(room, None)

    def _prefill_outcomes(self) -> None:
        while not self._closed.is_set():
            self._news.wait(_POLL_S)
            self._news.clear()
            for release in self.agent.grants.drain_released():
                room = int(release.request_id)
                targets = self.transfer_infos.get(room) or {}
                with self._lock:
                    out = self._outgoing.pop(room, None)
                    all_done = bool(targets) and out is not None and out.num_done >= len(targets)
                if release.reason == "done" or all_done:
                    self.update_status(room, KVPoll.Success)
                    continue
                self.fail(room, f"kvbridge grant {release.reason}: the decode server did not "
                                f"read request {room}'s KV in time"
                          if release.reason == "expired" else
                          f"kvbridge grant {release.reason}")
                self._tell_failed(room)

    def _tell_failed(self, room: int) -> None:
        with self.failure_lock:
            reason = self.failure_records.get(room, "prefill failed")
        msg = Failed(room=room, tp_rank=self.attn_tp_rank, reason=reason[:2000])
        for endpoint, port in self._room_notify_targets(room):
            self._send(endpoint, port, msg)

    def send_kv_status_message(self, *, targets: list[tuple[str, int]], bootstrap_room: int,
                               status: Any, failure_reason: str | None = None) -> None:
        """SGLang's status push to D, as kvbridge's authenticated ``Failed`` (D learns
        success from its own read, never from a message)."""
        if status != KVPoll.Failed:
            return
        msg = Failed(room=bootstrap_room, tp_rank=self.attn_tp_rank,
                     reason=(failure_reason or "prefill failed")[:2000])
        for endpoint, port in targets:
            self._send(endpoint, port, msg)

    # ------------------------------------------------------------------ decode
    def build_receiver_registration_message(self) -> list[bytes]:
        return self.codec.encode(Registered(
            engine_id=self.engine_id, endpoint=self.local_ip, port=self.rank_port,
            tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank))

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: npt.NDArray[np.int32],
                                        aux_index: int | None, state_indices: Any,
                                        decode_prefix_len: int | None, is_dummy: bool,
                                        **_: Any) -> list[bytes]:
        return self.codec.encode(Wanted(
            room=bootstrap_room, engine_id=self.engine_id, endpoint=self.local_ip,
            port=self.rank_port, tp_rank=self.attn_tp_rank, num_pages=len(kv_indices),
            num_wanted=required_dst_info_num, decode_prefix_len=int(decode_prefix_len or 0),
            is_dummy=is_dummy))

    def expect(self, room: int, page_ids: npt.NDArray[np.int32], aux_index: int | None,
               prefill_ranks: list[tuple[str, int]]) -> None:
        """D: the room's KV lands in ``page_ids`` once every P rank asked (their control
        endpoints) said Ready."""
        if aux_index is None:
            raise ConfigError(f"request {room}: SGLang gave no metadata slot")
        with self._lock:
            self._incoming[room] = _Incoming(np.asarray(page_ids, dtype=np.int64).copy(),
                                             int(aux_index), list(prefill_ranks))

    def _serve_decode(self) -> None:
        while not self._closed.is_set():
            self._handle(self._receive(), self._on_decode_message)

    def _on_decode_message(self, message: Message) -> None:
        match message:
            case Ready() as msg:
                self._on_ready(msg)
            case Failed() as msg:
                self._on_failed(msg)
            case msg:
                logger.warning("kvbridge: decode got an unexpected %s", type(msg).__name__)

    def _on_ready(self, msg: Ready) -> None:
        with self._lock:
            incoming = self._incoming.get(msg.room)
            if incoming is None or incoming.reading or incoming.ended:
                return  # cleared, or a repeat
            incoming.readies[msg.tp_rank] = msg
            if len(incoming.readies) < len(incoming.prefill_ranks):
                return
            incoming.reading = True
        problem = self._ready_problem(incoming)
        if problem is None:
            problem = self._write_aux(incoming)
        if problem is None:
            first = next(iter(incoming.readies.values()))
            try:
                self.agent.start_read(
                    str(msg.room), engine_id=first.engine_id, host=first.agent_host,
                    port=first.agent_ports,
                    remote_block_ids=page_ids_of(first.page_ids).tolist(),
                    local_block_ids=incoming.page_ids.tolist(), grant=first.grant,
                    num_tokens=first.num_tokens)
            except (KVBridgeError, MessageError) as exc:
                problem = f"kvbridge could not start the read: {exc}"
        if problem is not None:
            with self._lock:
                incoming.reading, incoming.ended = False, True
            self.fail(msg.room, problem)
            return
        self.update_status(msg.room, KVPoll.Transferring)

    def _ready_problem(self, incoming: _Incoming) -> str | None:
        readies = list(incoming.readies.values())
        first = readies[0]
        keys = {(r.engine_id, r.grant, r.page_ids, r.num_tokens, tuple(r.agent_ports),
                 r.agent_host, r.page_size) for r in readies}
        if len(keys) != 1:
            return "prefill ranks disagree on the request's pages, grant or agents"
        if first.page_size != self.page_size:
            return (f"prefill page size {first.page_size} != decode page size "
                    f"{self.page_size}")
        if first.num_tokens > len(incoming.page_ids) * self.page_size:
            return (f"prefill sends {first.num_tokens} tokens; decode allotted "
                    f"{len(incoming.page_ids)} pages of {self.page_size}")
        return None

    def _write_aux(self, incoming: _Incoming) -> str | None:
        rows = next(iter(incoming.readies.values())).aux_rows
        if len(rows) != len(self._aux):
            self.check_peer_aux_buffer_count("prefill", len(rows))
        for view, row in zip(self._aux, rows, strict=False):
            if len(row) != view.shape[1] or not 0 <= incoming.aux_index < view.shape[0]:
                return (f"prefill metadata row of {len(row)} bytes for slot "
                        f"{incoming.aux_index}; decode rows are {view.shape[1]} bytes x "
                        f"{view.shape[0]}")
            view[incoming.aux_index].copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))
        return None

    def _on_failed(self, msg: Failed) -> None:
        reason = f"prefill rank {msg.tp_rank}: {msg.reason}"
        with self._lock:
            incoming = self._incoming.get(msg.room)
            reading = incoming is not None and incoming.reading and not incoming.ended
        if reading:  # the read ends failed by itself; Failed then (its pages stay ours)
            with self.failure_lock:
                self.failure_records.setdefault(msg.room, reason)
            self.agent.cancel_reads([str(msg.room)])
            return
        if msg.room in self.request_status:
            self.fail(msg.room, reason)

    def read_in_flight(self, room: int) -> bool:
        """Whether a read of ``room`` may still write its pages."""
        with self._lock:
            incoming = self._incoming.get(room)
            return incoming is not None and incoming.reading and not incoming.ended

    def stop_read(self, room: int, wait_s: float = 2.0) -> bool:
        """Cancel ``room``'s read; True once nothing of it writes (within ``wait_s``)."""
        if not self.read_in_flight(room):
            return True
        future = self.agent.cancel_reads([str(room)], quiesce_s=wait_s)
        try:
            return str(room) in future.result(wait_s + 1.0)
        except Exception:
            return False

    def _decode_outcomes(self) -> None:
        while not self._closed.is_set():
            self.agent.wait_finished(_POLL_S)
            _, done = self.agent.get_finished()
            if not done:
                continue
            failed = self.agent.get_failed_block_ids()
            errors = {s.request_id: s.error for s in self.agent.get_stats()}
            for request_id in done:
                room = int(request_id)
                with self._lock:
                    incoming = self._incoming.get(room)
                    if incoming is not None:
                        incoming.reading, incoming.ended = False, True
                if request_id in failed:
                    self.fail(room, f"kvbridge read of request {room} failed: "
                                    f"{errors.get(request_id) or 'unknown error'}")
                    continue
                self.update_status(room, KVPoll.Success)
                notice = Done(room=room, tp_rank=self.attn_tp_rank)
                for endpoint, port in incoming.prefill_ranks if incoming is not None else []:
                    self._send(endpoint, port, notice)
