"""kvbridge's control messages between SGLang's P and D schedulers, and their framing.

They ride SGLang's own ZMQ sockets (each scheduler's PULL socket, whose address
P registers with its bootstrap server), so anyone who reaches those ports can
send bytes there: every message is a ``msgspec.Struct`` of one tagged union,
decoded with range checks, and framed with an HMAC under the cluster secret.
A frame that fails either check is dropped (``MessageError``), never acted on.

Conversation for one request (room ``R``; D ranks read, P ranks serve)::

    D -> P   Registered(engine, endpoint, tp)       once per D rank and P rank
    D -> P   Wanted(R, endpoint, pages, dummy)      once per request and P rank
    P -> D   Ready(R, agent ports, grant, pages, tokens, aux rows)   last chunk
    D        reads the pages with its transfer agent; P's grant ends when done
    P -> D   Failed(R, reason)                      P gave up (abort, lease)
    D -> P   Done(R)                                D holds the KV: every P rank it
                                                    asked may free (also those it did
                                                    not read: MLA's other replicas)
    D -> P   Abort(R, endpoint)                     D gave up: P revokes

Frame: ``[TAG, body, mac]``; ``mac`` is HMAC-SHA256 over ``CONTEXT + body``
(empty when the deployment runs without a secret, which is logged at start).

P ranks' registrations with P's bootstrap server (SGLang's HTTP ``PUT /route``,
which tells every D where P's ranks listen) carry the same kind of MAC in the
``MAC_HEADER`` header (``registration_mac``): a stranger cannot list a rank of its
own for D to send requests to.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge.errors import KVBridgeError

__all__ = [
    "MAC_HEADER",
    "TAG",
    "Abort",
    "Done",
    "Failed",
    "Message",
    "MessageCodec",
    "MessageError",
    "Ready",
    "Registered",
    "Wanted",
    "page_ids_of",
    "registration_mac",
]

TAG = b"KVBRIDGE"
CONTEXT = b"kvbridge-sglang-v1\0"
REGISTRATION_CONTEXT = b"kvbridge-sglang-bootstrap-v1\0"
MAC_HEADER = "X-Kvbridge-Mac"
#: Pages one request may name: 2**24 pages of 1 token would be 16M tokens.
MAX_PAGES = 1 << 24
MAX_AUX_ROWS = 64
MAX_AUX_ROW_NBYTES = 1 << 20
MAX_FRAME_NBYTES = 4 * MAX_PAGES + MAX_AUX_ROWS * MAX_AUX_ROW_NBYTES + (1 << 16)

Room = Annotated[int, msgspec.Meta(ge=0)]  # uint64 (msgpack holds no more)
Rank = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
PageIds = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_PAGES)]  # int32, little endian
AuxRow = Annotated[bytes, msgspec.Meta(max_length=MAX_AUX_ROW_NBYTES)]
Reason = Annotated[str, msgspec.Meta(max_length=2000)]


class MessageError(KVBridgeError):
    """A frame that is not a well-formed, authentic kvbridge message."""


class _Msg(msgspec.Struct, tag_field="kind", forbid_unknown_fields=True):
    pass


class Registered(_Msg, tag="registered"):
    """A D rank introduces itself to a P rank (SGLang's once-per-peer registration)."""

    engine_id: Name
    endpoint: Host
    port: Port
    tp_size: Size
    tp_rank: Rank


class Wanted(_Msg, tag="wanted"):
    """D rank's part of a request: where to tell it the KV is ready, and how much it takes.

    ``num_pages`` is D's page count for the request past ``decode_prefix_len``
    tokens it already holds; ``num_wanted`` how many D ranks will ask this P rank
    for the room (SGLang's ``required_dst_info_num``).
    """

    room: Room
    engine_id: Name
    endpoint: Host
    port: Port
    tp_rank: Rank
    num_pages: Count
    num_wanted: Size
    decode_prefix_len: Count
    is_dummy: bool


class Ready(_Msg, tag="ready"):
    """P rank's KV for a request may be read: under ``grant``, from its agent.

    ``agent_ports[r]`` is the agent port of P's attention-TP rank ``r``; the
    page ids are P's, in token order, starting at the D's prefix.
    """

    room: Room
    engine_id: Name
    tp_rank: Rank
    agent_host: Host
    agent_ports: Annotated[list[Port], msgspec.Meta(min_length=1, max_length=1 << 12)]
    grant: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]
    page_ids: PageIds
    page_size: Size
    num_tokens: Count
    aux_rows: Annotated[list[AuxRow], msgspec.Meta(max_length=MAX_AUX_ROWS)]


class Failed(_Msg, tag="failed"):
    """P rank gave the request up (aborted, its grant ended unread, ...)."""

    room: Room
    tp_rank: Rank
    reason: Reason


class Abort(_Msg, tag="abort"):
    """D rank gave the request up: P may end its grant and free its pages."""

    room: Room
    endpoint: Host
    port: Port


class Done(_Msg, tag="done"):
    """D rank holds the room's KV: the P rank may free its pages."""

    room: Room
    tp_rank: Rank


Message = Registered | Wanted | Ready | Failed | Abort | Done


def registration_mac(secret: bytes, body: bytes) -> str:
    """Hex HMAC-SHA256 of a bootstrap registration's body (``MAC_HEADER``)."""
    return hmac.new(secret, REGISTRATION_CONTEXT + body, hashlib.sha256).hexdigest()


def page_ids_of(page_ids: bytes) -> npt.NDArray[np.int64]:
    """``Ready.page_ids`` as ints; raises ``MessageError`` for a length not of int32s."""
    if len(page_ids) % 4:
        raise MessageError(f"page ids of {len(page_ids)} bytes are not int32s")
    return np.frombuffer(page_ids, dtype="<i4").astype(np.int64)


class MessageCodec:
    """Encode and check frames under one secret (None: unauthenticated, MAC empty).

    ``encode`` may be called from any thread; ``decode`` from one thread at a time
    (each manager decodes on its control thread only).
    """

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self._decoder = msgspec.msgpack.Decoder(Message)

    def _mac(self, body: bytes) -> bytes:
        if self._secret is None:
            return b""
        return hmac.new(self._secret, CONTEXT + body, hashlib.sha256).digest()

    def encode(self, message: Message) -> list[bytes]:
        """The ZMQ frames of ``message``."""
        body = msgspec.msgpack.encode(message)
        return [TAG, body, self._mac(body)]

    @staticmethod
    def is_ours(frames: list[bytes]) -> bool:
        """Whether ``frames`` claim to be a kvbridge message (else SGLang's own)."""
        return bool(frames) and frames[0] == TAG

    def decode(self, frames: list[bytes]) -> Message:
        """The message of ``frames``.

        Raises:
            MessageError: not three frames, too large, a MAC that does not verify,
                or a body that is no well-formed message.
        """
        if not frames or frames[0] != TAG:
            raise MessageError("not a kvbridge frame (its first part is not the tag)")
        if len(frames) != 3:
            raise MessageError(f"a kvbridge frame has 3 parts, got {len(frames)}")
        _, body, mac = frames
        if len(body) > MAX_FRAME_NBYTES:
            raise MessageError(f"message of {len(body)} bytes > {MAX_FRAME_NBYTES}")
        if not hmac.compare_digest(self._mac(body), mac):
            raise MessageError("message MAC does not verify (another secret, or forged)")
        try:
            message: Message = self._decoder.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:  # deep nesting: RecursionError
            raise MessageError(f"malformed message: {exc}") from None
        return message
