"""Control messages of the transfer protocol and their typed codec.

Every control message is a ``msgspec.Struct`` tagged with its kind, and the whole
set forms one tagged union decoded by a single typed ``msgspec.msgpack.Decoder``:
a peer's bytes either become one of these classes, every field type- and
range-checked, or raise :class:`ProtocolError`. Only these messages and raw KV
bytes cross the wire (no pickle). Used by the agent's server and reader halves.

Conversation on one connection (reader R, server S)::

    S -> R  Challenge(nonce, protocol_version)
    R -> S  Hello(engine id, rank, version, compat hash, nonce, proof, topology)
    S -> R  AgentMetadata(..., proof)          or Reject(reason) and close
    R -> S  ReadRequest(xfer_id, grant, block ids, heads, layers, chunking)
    S -> R  DataHeader(xfer_id, chunks)        or Reject(xfer_id, reason)
    R -> S  Credit(xfer_id, k)     receives for chunks < k are posted
    S => R  chunk i < k on data channel (xfer_id, i) (raw bytes, no framing)
    R -> S  ReadDone(grant, reader id, ok)      (also sent by notify-only readers)

Same host (``reading/same_host.py``; offered in ``AgentMetadata.host``)::

    R -> S  ReadRequest(..., direct, local_copy)
    S -> R  CopyGo(xfer_id, where the blocks are, hold_s)   or Reject(xfer_id, reason)
    R       copies the blocks out of S's memory itself (process_vm_readv)
    R -> S  CopyDone(xfer_id, ok)          S unpins (or at hold_s, whichever first);
                                           before the go: S never pins (the reader
                                           copied on the board's word meanwhile)

    or, when S's board of grants (``grant_board.py``, offered in ``HostInfo``) says
    the grant is live and holds the blocks, and an earlier CopyGo of the same shape
    said where they are, without asking:
    R       reads the board, copies, reads the board again (the grant stayed live)
    R -> S  ReadDone(..., copied_nbytes)   the bytes so copied, for S's counters

    R -> S  RenewLease(grant, lease_s, xfer_id)    renews the grant of read xfer_id
    S -> R  LeaseRenewed(grant, remaining_s, xfer_id)   (never past that read's deadline)
            or Reject(xfer_id, reason, renewal=True): the link goes on; reason
               expired_grant / unknown_grant: the grant is gone, that read fails
               no_read: S serves no read xfer_id of that grant (nothing extended);
               the read's own outcome stands
    either  Ping(seq) / Pong(seq)         heartbeats on idle connections
    either  Bye(reason)                   graceful close
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import msgspec

from kvbridge.transfer.errors import ProtocolError

__all__ = [
    "AgentMetadata",
    "Bye",
    "Challenge",
    "channel_of",
    "CopyDone",
    "CopyGo",
    "Credit",
    "DataHeader",
    "Hello",
    "HostInfo",
    "LeaseRenewed",
    "Message",
    "MessageCodec",
    "Ping",
    "Pong",
    "ReadDone",
    "ReadRequest",
    "Reject",
    "RejectReason",
    "RenewLease",
    "TopologyInfo",
]

MAX_BLOCKS_PER_READ = 1 << 16
MAX_XFER_ID = (1 << 20) - 1
MAX_CHUNKS = 1 << 16
_MAX_ID_LEN = 256
_MAX_BYTES_LEN = 64

Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=1 << 31)]
XferId = Annotated[int, msgspec.Meta(ge=1, le=MAX_XFER_ID)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_ID_LEN)]
Blob = Annotated[bytes, msgspec.Meta(max_length=_MAX_BYTES_LEN)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)]
Address = Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
#: Plane addresses one CopyGo may carry (8 bytes each): 4096 layers' K and V.
MAX_COPY_ORIGINS = 8192


def channel_of(xfer_id: int, chunk: int) -> int:
    """UCX channel of one data chunk: ``[xfer_id : 20][chunk : 16]``.

    Both ends compute it: the server sends chunk ``chunk`` of read ``xfer_id``
    on it, the reader posts that chunk's receive on it.
    """
    return (xfer_id << 16) | chunk


class RejectReason(StrEnum):
    """Why a server refused a handshake or a read."""

    VERSION = "version"
    COMPAT = "compat"
    AUTH = "auth"
    NOT_READY = "not_ready"  # a read before the handshake
    UNKNOWN_GRANT = "unknown_grant"
    EXPIRED_GRANT = "expired_grant"
    NOT_GRANTED = "not_granted"  # block ids outside the grant
    PROMPT_MISMATCH = "prompt_mismatch"  # the grant holds another prompt's KV
    BAD_REQUEST = "bad_request"
    INTERNAL = "internal"
    BUSY = "busy"  # the server serves AgentConfig.max_sessions connections already
    # A lease renewal naming no read of its grant that the server serves (protocol 10).
    NO_READ = "no_read"


class _Msg(msgspec.Struct, tag_field="kind", forbid_unknown_fields=True):
    pass


class TopologyInfo(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A reader engine's parallel and cache shape, sent in its ``Hello``.

    The server needs it to count the readers it must hear from before it may
    free a request's blocks (``kvbridge.topology.num_expected_readers``).
    Defaults are left out on the wire, so a server of an older protocol reads
    a non-fused, non-split reader's ``Hello`` far enough to reject it for its
    version.
    """

    tp_size: Positive
    pp_size: Positive
    block_size: Positive
    num_kv_heads: Positive
    is_mla: bool
    layout: Annotated[str, msgspec.Meta(max_length=8)]
    num_layers: Positive
    fused_kv: bool = False  # one fused K/V plane per layer (vLLM CPU; EngineTopology)
    split_kv: bool = False  # one K or V plane per layer entry (SGLang; EngineTopology)


class Challenge(_Msg, tag="challenge"):
    nonce: Blob
    protocol_version: Count


class Hello(_Msg, tag="hello"):
    engine_id: Name
    rank: Count
    protocol_version: Count
    compat_hash: Annotated[str, msgspec.Meta(max_length=128)]
    nonce: Blob
    proof: Blob | None = None
    topology: TopologyInfo | None = None  # None: an old reader; the server assumes 1 reader


class HostInfo(msgspec.Struct, forbid_unknown_fields=True):
    """Who a server is on its host, for same-host copies (``protocol/host.py``).

    A reader on the same host (same boot, same pid namespace) copies ``probe``
    from ``probe_address`` of process ``pid`` and compares before it trusts
    ``pid`` with its reads.
    """

    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    pid_namespace: Annotated[str, msgspec.Meta(max_length=64)]
    pid: Positive
    probe_address: Address
    probe: Blob
    board_address: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0  # 0: no board
    board_slots: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    # The board's memfd in the server (a reader maps ``/proc/<pid>/fd/<board_fd>``); -1: none.
    board_fd: Annotated[int, msgspec.Meta(ge=-1, le=1 << 30)] = -1
    # The memfds the caches at ``place`` are in (``transfer/host_memory.py``): u64 quads
    # (address, nbytes, fd, inode), one per mapping. Empty: not offered.
    regions: Annotated[bytes, msgspec.Meta(max_length=32 * MAX_COPY_ORIGINS)] = b""
    # Where the caches were at the handshake, as a ``CopyGo`` says it for one read: the
    # address of block 0 of every plane of every held layer (u64 each, in ``CopyGo``'s
    # plane order), the bytes from one block to the next, and ``LocalKV.place``. A
    # reader copies by them on the grant board's word before any go (``reading/inline.py``).
    # Empty / 0: not offered.
    origins: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_COPY_ORIGINS)] = b""
    block_stride: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    place: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0


class AgentMetadata(_Msg, tag="metadata"):
    """What a reader must know about a server rank to plan and size reads."""

    engine_id: Name
    tp_size: Positive
    pp_size: Positive
    tp_rank: Count
    pp_rank: Count
    block_size: Positive
    layout: Annotated[str, msgspec.Meta(max_length=8)]
    num_blocks: Count
    num_layers: Positive  # layers this rank holds
    num_model_layers: Positive
    layer_block_nbytes: list[Count]  # bytes of one block in each held layer (K+V)
    num_kv_heads: Positive  # model-wide
    num_heads: Positive  # in this rank's cache tensor
    head_dim: Positive
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    elem_nbytes: Positive
    is_mla: bool
    proof: Blob | None = None
    host: HostInfo | None = None  # None: no same-host copies from this server
    # One fused K/V plane per layer (vLLM CPU): head_dim is its 2 * head_size row.
    fused_kv: bool = False
    # One plane, K or V alone, per layer entry (SGLang): num_layers and
    # num_model_layers count planes, layer_block_nbytes is one plane's block.
    split_kv: bool = False


class Reject(_Msg, tag="reject"):
    """A refusal: of the handshake or connection (``xfer_id`` 0), of read ``xfer_id``,
    or (``renewal``) of the lease renewal read ``xfer_id`` asked for.

    Only ``xfer_id`` 0 without ``renewal`` ends the connection. Protocol 5 answered
    a refused renewal with ``xfer_id`` 0, which the reader had to take as the end
    of the link (every read on it failed); protocol 6 names the read instead.
    """

    reason: RejectReason
    message: Annotated[str, msgspec.Meta(max_length=4096)]
    xfer_id: Count = 0  # 0: the handshake/connection, else the read concerned
    renewal: bool = False  # True: refuses read xfer_id's RenewLease, not the read itself


class ReadRequest(_Msg, tag="read"):
    xfer_id: XferId
    grant: Name
    block_ids: Annotated[list[Count], msgspec.Meta(min_length=1, max_length=MAX_BLOCKS_PER_READ)]
    head_start: Count
    head_end: Positive
    layer_start: Count
    layer_end: Positive
    chunk_blocks: Positive  # blocks per data chunk
    # True: the server sends each chunk straight from its cache blocks (no Credit,
    # no DataHeader); the reader posted receives straight into its own blocks.
    direct: bool = False
    prompt_digest: Blob = b""  # the reader's prompt (security.prompt_digest); b"": none
    # True (with direct): the reader copies the blocks itself (same host, CopyGo).
    local_copy: bool = False


class DataHeader(_Msg, tag="data"):
    xfer_id: XferId
    num_chunks: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNKS)]
    total_nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]


class CopyGo(_Msg, tag="copy_go"):
    """The grant is pinned for ``hold_s``: copy the read's blocks from here.

    Block ``b`` of plane ``p`` (planes in the order of ``direct.block_ranges``)
    holds the read's heads at ``origins[p] + b * block_stride + span_offset``,
    ``span_nbytes`` long.
    """

    xfer_id: XferId
    origins: Annotated[bytes, msgspec.Meta(min_length=8, max_length=8 * MAX_COPY_ORIGINS)]
    block_stride: Positive
    span_offset: Count
    span_nbytes: Positive
    hold_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)]
    # ``LocalKV.place`` when the origins were taken; the grant board's slots carry
    # it too, and a copy on the board's word needs the two equal. 0: unknown.
    place: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0


class CopyDone(_Msg, tag="copy_done"):
    """The reader is done copying (``ok=False``: it gave up); the server unpins, or,
    before it pinned, never pins for that read (withdrawn: the reader copied on the
    grant board's word while the server waited for the grant)."""

    xfer_id: XferId
    ok: bool = True


class Credit(_Msg, tag="credit"):
    """The reader has posted receives for every chunk below ``num_chunks``."""

    xfer_id: XferId
    num_chunks: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNKS)]


class ReadDone(_Msg, tag="done"):
    grant: Name
    reader_id: Name
    ok: bool = True
    # Bytes the reader copied on the grant board's word (no CopyGo): counters only.
    copied_nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)] = 0


# Wire compatibility of the renewal ids (protocol 6): messages are decoded with
# forbid_unknown_fields and every field is sent, so a peer of protocol 5 could not
# decode these messages, nor a 6 peer its RenewLease without ``xfer_id``. That is
# fine because they never meet: the handshake refuses a Hello of another
# version (``security.PROTOCOL_VERSION``) before any read or renewal is sent.
class RenewLease(_Msg, tag="renew"):
    """Extend ``grant``'s lease for read ``xfer_id`` of this link (which the answer names)."""

    grant: Name
    lease_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)]
    xfer_id: XferId


class LeaseRenewed(_Msg, tag="renewed"):
    """The renewal read ``xfer_id`` asked for went through: ``remaining_s`` left."""

    grant: Name
    remaining_s: Seconds
    xfer_id: XferId


class Ping(_Msg, tag="ping"):
    seq: Count


class Pong(_Msg, tag="pong"):
    seq: Count


class Bye(_Msg, tag="bye"):
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""


Message = (
    Challenge
    | Hello
    | AgentMetadata
    | Reject
    | ReadRequest
    | DataHeader
    | CopyGo
    | CopyDone
    | Credit
    | ReadDone
    | RenewLease
    | LeaseRenewed
    | Ping
    | Pong
    | Bye
)


class MessageCodec:
    """Encode and decode :data:`Message` values (one instance per thread or loop)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    def encode(self, message: Message) -> bytes:
        """Return the msgpack bytes of ``message``."""
        return self._encoder.encode(message)

    def decode(self, payload: bytes) -> Message:
        """Decode one message.

        Raises:
            ProtocolError: not msgpack, unknown kind, missing/extra fields, wrong
                types or values out of range. The message says which.
        """
        try:
            message: Message = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"bad control message ({len(payload)} bytes): {exc}") from None
        return message
