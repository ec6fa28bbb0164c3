"""Control-message codec: round trips, and arbitrary bytes never escape as untyped errors."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.transfer.errors import ProtocolError
from kvbridge.transfer.protocol import wire

CODEC = wire.MessageCodec()

SAMPLES: list[wire.Message] = [
    wire.Challenge(b"n" * 32, 1),
    wire.Hello("decode", 3, 1, "ab" * 32, b"x" * 32, b"p" * 32),
    wire.Reject(wire.RejectReason.AUTH, "nope", 0),
    wire.ReadRequest(7, "tok" * 8, [1, 5, 9], 0, 4, 0, 2, 16),
    wire.DataHeader(7, 3, 1 << 30),
    wire.Credit(7, 2),
    wire.CopyGo(7, bytes(range(16)), 4096, 512, 1024, 10.0),
    wire.CopyDone(7, False),
    wire.ReadRequest(8, "tok" * 8, [2], 0, 4, 0, 2, 16, direct=True, local_copy=True),
    wire.ReadDone("tok" * 8, "decode:0", False),
    wire.RenewLease("tok" * 8, 30.0, 7),
    wire.LeaseRenewed("tok" * 8, 29.5, 7),
    wire.Reject(wire.RejectReason.EXPIRED_GRANT, "expired", 7, renewal=True),
    wire.Ping(1),
    wire.Pong(1),
    wire.Bye("closing"),
    wire.AgentMetadata(
        "prefill", 2, 1, 1, 0, 16, "NHD", 64, 4, 4, [4096] * 4, 8, 4, 64, "bfloat16", 2, False,
        host=wire.HostInfo("boot", "4:4026531836", 1234, 0x7F0000001000, b"p" * 16),
    ),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: wire.Message) -> None:
    assert CODEC.decode(CODEC.encode(msg)) == msg


@pytest.mark.parametrize(
    "payload",
    [
        msgspec.msgpack.encode({"kind": "teleport", "x": 1}),  # unknown kind
        msgspec.msgpack.encode({"kind": "ping"}),  # missing field
        msgspec.msgpack.encode({"kind": "ping", "seq": -1}),  # out of range
        msgspec.msgpack.encode({"kind": "ping", "seq": 1, "extra": 2}),  # unknown field
        msgspec.msgpack.encode({"kind": "read", "xfer_id": 0, "grant": "g", "block_ids": [1],
                                "head_start": 0, "head_end": 1, "layer_start": 0,
                                "layer_end": 1, "chunk_blocks": 1}),  # xfer id 0
        msgspec.msgpack.encode({"kind": "copy_go", "xfer_id": 1, "origins": b"",
                                "block_stride": 1, "span_offset": 0, "span_nbytes": 1,
                                "hold_s": 1.0}),  # no origins
        msgspec.msgpack.encode({"kind": "copy_go", "xfer_id": 1, "origins": bytes(8),
                                "block_stride": 1, "span_offset": 0, "span_nbytes": 1,
                                "hold_s": 0.0}),  # no hold
        msgspec.msgpack.encode({"kind": "renew", "grant": "g", "lease_s": 1.0}),  # no read
        msgspec.msgpack.encode({"kind": "renewed", "grant": "g", "remaining_s": 1.0,
                                "xfer_id": 0}),  # a renewal names its read (xfer id >= 1)
        CODEC.encode(wire.Ping(5))[:-1],  # truncated
        b"",
    ],
)
def test_bad_messages_raise_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        CODEC.decode(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_protocol_error(payload: bytes) -> None:
    try:
        msg = CODEC.decode(payload)
    except ProtocolError:
        return
    assert CODEC.decode(CODEC.encode(msg)) == msg
