"""The SGLang backend's control messages and their frames (``integrations/sglang/messages.py``).

Every frame a P or D scheduler receives on its ZMQ socket goes through
``MessageCodec.decode``: anything that is not a well-formed message under the
same secret must come out as ``MessageError`` (dropped by the manager), never
as another exception (that would end the manager's control thread). No SGLang
process is needed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.integrations.sglang.messages import (
    MAX_AUX_ROW_NBYTES,
    MAX_AUX_ROWS,
    MAX_FRAME_NBYTES,
    MAX_PAGES,
    TAG,
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
)

SECRET = b"a cluster secret of 32 bytes...."
OTHER_SECRET = b"another secret, also 32 bytes..."
MAX_ROOM = 2**64 - 1

EXAMPLES: list[Message] = [
    Registered(engine_id="d-engine", endpoint="10.0.0.2", port=5757, tp_size=2, tp_rank=1),
    Wanted(room=MAX_ROOM, engine_id="d-engine", endpoint="10.0.0.2", port=5757, tp_rank=0,
           num_pages=12, num_wanted=2, decode_prefix_len=32, is_dummy=False),
    Ready(room=7, engine_id="p-engine", tp_rank=1, agent_host="10.0.0.1",
          agent_ports=[6001, 6002], grant="g" * 16,
          page_ids=(b"\x05\x00\x00\x00\xff\xff\xff\x7f"), page_size=16, num_tokens=20,
          aux_rows=[b"", b"\x01" * 64]),
    Failed(room=0, tp_rank=0, reason="aborted on the prefill server"),
    Abort(room=123456789, endpoint="::1", port=65535),
    Done(room=MAX_ROOM, tp_rank=3),
]


def fields(message: Message) -> dict[str, Any]:
    """``message`` as the plain fields a peer could send (its ``kind`` included)."""
    return {"kind": type(message).__struct_config__.tag, **msgspec.structs.asdict(message)}


def frame(raw: dict[str, Any], codec: MessageCodec | None = None) -> list[bytes]:
    """The frames of ``raw`` (any fields, not checked), MAC'd by ``codec``."""
    body = msgspec.msgpack.encode(raw)
    return [TAG, body, (codec or MessageCodec(None))._mac(body)]


def refused(codec: MessageCodec, frames: list[bytes], match: str) -> None:
    with pytest.raises(MessageError, match=match):
        codec.decode(frames)


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "insecure"])
@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips(message: Message, secret: bytes | None) -> None:
    codec = MessageCodec(secret)
    frames = codec.encode(message)
    assert frames[0] == TAG and len(frames) == 3
    assert len(frames[2]) == (32 if secret else 0)  # HMAC-SHA256, or empty
    decoded = codec.decode(frames)
    assert type(decoded) is type(message) and decoded == message
    assert MessageCodec(secret).decode(frames) == message  # another process, same secret


def test_page_ids_are_little_endian_int32s() -> None:
    ready = EXAMPLES[2]
    assert isinstance(ready, Ready)
    assert page_ids_of(ready.page_ids).tolist() == [5, 2**31 - 1]
    assert page_ids_of(b"").tolist() == []
    for nbytes in (1, 2, 3, 5, 7):
        with pytest.raises(MessageError, match=f"{nbytes} bytes"):
            page_ids_of(b"\0" * nbytes)


@pytest.mark.parametrize(
    ("sender", "receiver"),
    [(OTHER_SECRET, SECRET), (None, SECRET), (SECRET, None)],
    ids=["other-secret", "unsigned-to-secured", "signed-to-insecure"],
)
def test_a_frame_under_another_secret_is_refused(sender: bytes | None,
                                                 receiver: bytes | None) -> None:
    for message in EXAMPLES:
        refused(MessageCodec(receiver), MessageCodec(sender).encode(message), "MAC")


@pytest.mark.parametrize("position", [0, 1, 7, -1])
def test_a_flipped_body_byte_fails_the_mac(position: int) -> None:
    codec = MessageCodec(SECRET)
    tag, body, mac = codec.encode(EXAMPLES[1])
    flipped = bytearray(body)
    flipped[position] ^= 0x01
    refused(codec, [tag, bytes(flipped), mac], "MAC")
    refused(codec, [tag, body, mac[:-1]], "MAC")  # a truncated MAC
    refused(codec, [tag, body, b""], "MAC")


@pytest.mark.parametrize(
    "frames",
    [[], [TAG], [TAG, b""], [TAG, b"", b"", b""], [b"", b"", b""], [b"KVBRIDGX", b"", b""],
     [TAG.lower(), b"\x80", b""]],
    ids=["none", "one", "two", "four", "empty-tag", "other-tag", "lowercase-tag"],
)
def test_wrong_frame_counts_and_tags_are_refused(frames: list[bytes]) -> None:
    for secret in (SECRET, None):
        with pytest.raises(MessageError):
            MessageCodec(secret).decode(frames)


def test_an_oversized_body_is_refused_before_its_mac() -> None:
    body = bytes(MAX_FRAME_NBYTES + 1)
    refused(MessageCodec(None), [TAG, body, b""], f"{MAX_FRAME_NBYTES + 1} bytes")
    refused(MessageCodec(SECRET), [TAG, body, b"x" * 32], "bytes >")


def test_a_message_at_the_page_and_aux_limits_fits_a_frame() -> None:
    codec = MessageCodec(None)
    big = Ready(room=1, engine_id="p", tp_rank=0, agent_host="h", agent_ports=[1],
                grant="g" * 128, page_ids=bytes(4 * MAX_PAGES),
                page_size=1, num_tokens=1,
                aux_rows=[bytes(MAX_AUX_ROW_NBYTES)] * MAX_AUX_ROWS)
    assert codec.decode(codec.encode(big)) == big


@pytest.mark.parametrize(
    "body",
    [b"", b"\xc1", b"\x81", b"\x92\x01", b"\xd4\x01\x00", b"not msgpack at all",
     msgspec.msgpack.encode(fields(EXAMPLES[3])) + b"\x00"],
    ids=["empty", "reserved-byte", "truncated-map", "array", "ext", "text", "trailing-byte"],
)
def test_malformed_msgpack_is_refused(body: bytes) -> None:
    codec = MessageCodec(SECRET)
    refused(codec, [TAG, body, codec._mac(body)], "malformed")


def test_unknown_or_missing_kind_is_refused() -> None:
    raw = fields(EXAMPLES[3])
    refused(MessageCodec(None), frame({**raw, "kind": "ready2"}), "malformed")
    refused(MessageCodec(None), frame({**raw, "kind": 3}), "malformed")
    refused(MessageCodec(None), frame({k: v for k, v in raw.items() if k != "kind"}),
            "malformed")
    refused(MessageCodec(None), frame({**raw, "extra": 1}), "extra")  # unknown fields
    refused(MessageCodec(None), frame({k: v for k, v in raw.items() if k != "reason"}),
            "reason")


def _ready(**changes: Any) -> dict[str, Any]:
    return {**fields(EXAMPLES[2]), **changes}


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({**fields(EXAMPLES[3]), "room": -1}, "room"),
        ({**fields(EXAMPLES[3]), "room": 1.0}, "room"),
        ({**fields(EXAMPLES[3]), "room": "1"}, "room"),
        ({**fields(EXAMPLES[3]), "tp_rank": 2**16 + 1}, "tp_rank"),
        ({**fields(EXAMPLES[3]), "reason": "x" * 2001}, "reason"),
        ({**fields(EXAMPLES[4]), "port": 0}, "port"),
        ({**fields(EXAMPLES[4]), "port": 70000}, "port"),
        ({**fields(EXAMPLES[4]), "endpoint": ""}, "endpoint"),
        ({**fields(EXAMPLES[0]), "tp_size": 0}, "tp_size"),
        ({**fields(EXAMPLES[0]), "engine_id": "e" * 256}, "engine_id"),
        ({**fields(EXAMPLES[1]), "num_wanted": 0}, "num_wanted"),
        ({**fields(EXAMPLES[1]), "num_pages": 2**40 + 1}, "num_pages"),
        ({**fields(EXAMPLES[1]), "is_dummy": 1}, "is_dummy"),
        (_ready(grant="g" * 15), "grant"),
        (_ready(grant="g" * 129), "grant"),
        (_ready(agent_ports=[]), "agent_ports"),
        (_ready(agent_ports=[6001, 0]), "agent_ports"),
        (_ready(agent_ports=[70000]), "agent_ports"),
        (_ready(aux_rows=[b""] * (MAX_AUX_ROWS + 1)), "aux_rows"),
        (_ready(aux_rows=[bytes(MAX_AUX_ROW_NBYTES + 1)]), "aux_rows"),
        (_ready(page_ids="0000"), "page_ids"),
        (_ready(page_size=0), "page_size"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_out_of_range_fields_are_refused(raw: dict[str, Any], named: str) -> None:
    for secret in (SECRET, None):  # authenticated peers get the same checks
        codec = MessageCodec(secret)
        refused(codec, frame(raw, codec), f"malformed.*{named}")


def test_rooms_span_uint64() -> None:
    """SGLang's bootstrap rooms are unsigned 64-bit; msgpack carries no larger integer."""
    codec = MessageCodec(SECRET)
    for room in (0, 2**63, MAX_ROOM):
        message = Failed(room=room, tp_rank=0, reason="")
        assert codec.decode(codec.encode(message)) == message
    # The largest msgpack integer is uint64: 0xcf and 8 bytes. A peer cannot write more.
    body = msgspec.msgpack.encode(fields(Failed(room=MAX_ROOM, tp_rank=0, reason="")))
    assert b"\xcf" + b"\xff" * 8 in body


def test_is_ours() -> None:
    assert MessageCodec.is_ours(MessageCodec(SECRET).encode(EXAMPLES[0]))
    assert MessageCodec.is_ours([TAG])
    assert not MessageCodec.is_ours([])
    assert not MessageCodec.is_ours([b"sglang's own", b"x"])
    assert not MessageCodec.is_ours([b"", TAG])


def _nested(depth: int) -> bytes:
    """A map whose first value is ``depth`` nested one-element arrays."""
    return b"\x82\xa1a" + b"\x91" * depth + b"\xc0" + b"\xa4kind\xa5abort"


def test_deeply_nested_bodies_are_refused() -> None:
    codec = MessageCodec(None)
    refused(codec, [TAG, _nested(100), b""], "malformed")
    refused(codec, [TAG, _nested(100_000), b""], "malformed")


_SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=20) | st.binary(max_size=20))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                       max_leaves=12)
_KINDS = st.sampled_from(["registered", "wanted", "ready", "failed", "abort", "other"])


def _near(message: Message) -> st.SearchStrategy[dict[str, Any]]:
    """``message``'s fields with some replaced or dropped, one maybe added, any kind."""
    names = st.sampled_from(sorted(fields(message)))
    return st.builds(
        lambda kind, replaced, dropped, added: {
            **{k: v for k, v in fields(message).items() if k not in dropped},
            "kind": kind, **replaced, **added},
        _KINDS, st.dictionaries(names, _VALUES, max_size=3), st.sets(names, max_size=2),
        st.dictionaries(st.text(max_size=12), _VALUES, max_size=1))


_NEAR = st.sampled_from(EXAMPLES).flatmap(_near)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_arbitrary_frames_raise_only_message_error(frames: list[bytes]) -> None:
    for codec in (MessageCodec(SECRET), MessageCodec(None)):
        for candidate in (frames, [TAG, *frames[:1], b""]):
            with contextlib.suppress(MessageError):
                codec.decode(candidate)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256) | _NEAR.map(msgspec.msgpack.encode))
def test_arbitrary_bodies_decode_or_raise_message_error(body: bytes) -> None:
    codec = MessageCodec(SECRET)
    try:
        message = codec.decode([TAG, body, codec._mac(body)])
    except MessageError:
        return
    assert codec.decode(codec.encode(message)) == message  # what passes is a whole message


def test_registration_macs_bind_secret_and_body() -> None:
    from kvbridge.integrations.sglang.messages import registration_mac

    body = b'{"rank_ip": "10.0.0.1", "rank_port": 5000}'
    mac = registration_mac(b"s" * 32, body)
    assert len(mac) == 64 and mac == registration_mac(b"s" * 32, body)
    assert mac != registration_mac(b"t" * 32, body)
    assert mac != registration_mac(b"s" * 32, body.replace(b"5000", b"5001"))
