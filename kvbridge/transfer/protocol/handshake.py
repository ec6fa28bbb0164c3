"""Both halves of the connection handshake, plus framed message send/receive.

The server side (``serve_handshake``) is run by ``serving/session.py`` on every
accepted connection, the reader side (``reader_handshake``) by
``reading/link.py`` on every new link. Conversation (see ``wire.py``)::

    S -> R  Challenge(server nonce, version)
    R -> S  Hello(engine id, rank, version, compat hash, reader nonce,
                  proof = HMAC(secret, ctx("reader") || server nonce), topology)
    S       checks version, compat hash, proof  -> Reject(reason) and drop
            (a compat Reject carries the server's cache description, so the
            reader's error names the fields that differ: ``compat_reason``)
    S -> R  AgentMetadata(..., proof = HMAC(secret, ctx("server") || reader nonce))
    R       checks the server's proof (a server without the secret is dropped)

``ctx`` binds a proof to the direction and to both (engine id, rank) pairs
(:func:`kvbridge.transfer.protocol.security.handshake_context`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from kvbridge.transfer.errors import ProtocolError, RejectedError, TransferError
from kvbridge.transfer.protocol import security, wire
from kvbridge.transfer.ucx.connection import UcxConnection

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this agent is in a handshake."""

    engine_id: str
    rank: int  # global rank
    compat_hash: str
    secret: bytes | None
    topology: wire.TopologyInfo | None = None  # sent in Hello when reading
    compat: security.CompatInfo | None = None  # described in a compat Reject, both ways


_SERVER_CACHE = "; server cache "
_SAME = (": P and D must share one secret (the same secret_file or $KVBRIDGE_SECRET; with "
         "neither, instances of the same user on one host share theirs, and \"insecure\" "
         "turns it off on both)")


def compat_reason(mine: security.CompatInfo | None, message: str) -> str:
    """A compat Reject's message as the reader says it: the fields that differ.

    The server appends its cache description (``_SERVER_CACHE`` + JSON of its
    :class:`CompatInfo` fields) to the hash mismatch; the reader compares it
    with its own. A message without one (or ``mine`` None) comes back as it is.
    """
    head, found, tail = message.partition(_SERVER_CACHE)
    if not found or mine is None:
        return message
    try:
        theirs = security.CompatInfo(**json.loads(tail))
    except (ValueError, TypeError) as exc:
        return f"{head} (server cache description unreadable: {exc})"
    diff = security.compat_diff(mine, theirs)
    if not diff:
        return f"{head} (server cache {tail} equals ours: versions hash it differently)"
    return (f"this reader's KV cache and the server's differ ({'; '.join(diff)}): start P and "
            f"D with the same model and KV cache settings (e.g. --kv-cache-dtype)")


def _describe(compat: security.CompatInfo | None) -> str:
    if compat is None:
        return ""
    fields = {k: str(v) if k == "layout" else v for k, v in
              security.compat_fields(compat).items()}
    return _SERVER_CACHE + json.dumps(fields, sort_keys=True)


async def send_msg(
    conn: UcxConnection, codec: wire.MessageCodec, msg: wire.Message, timeout_s: float
) -> None:
    """Encode and send one control message."""
    await conn.send_frame(codec.encode(msg), timeout_s=timeout_s)


async def recv_msg(
    conn: UcxConnection, codec: wire.MessageCodec, max_nbytes: int, timeout_s: float
) -> wire.Message:
    """Receive and decode one control message.

    Raises:
        ProtocolError: bad frame or message. PeerTimeoutError, PeerClosedError.
    """
    return codec.decode(await conn.recv_frame(max_nbytes=max_nbytes, timeout_s=timeout_s))


async def reject(
    conn: UcxConnection,
    codec: wire.MessageCodec,
    reason: wire.RejectReason,
    message: str,
    xfer_id: int = 0,
    *,
    renewal: bool = False,
) -> None:
    """Tell the peer why; log it. Failure to deliver is only logged.

    ``xfer_id`` 0: the handshake or connection; else read ``xfer_id``, or with
    ``renewal`` the lease renewal that read asked for.
    """
    what = "renewal for xfer" if renewal else "xfer"
    logger.info("rejecting %s (%s %d): %s: %s", conn.peer, what, xfer_id, reason, message)
    try:
        await send_msg(conn, codec, wire.Reject(reason, message[:4096], xfer_id, renewal), 1.0)
    except TransferError as exc:  # best effort on a failing peer
        logger.debug("reject to %s not delivered: %s", conn.peer, exc)


async def serve_handshake(
    conn: UcxConnection,
    codec: wire.MessageCodec,
    me: Identity,
    metadata: wire.AgentMetadata,
    *,
    max_nbytes: int,
    timeout_s: float,
) -> wire.Hello | None:
    """Run the server side; return the reader's Hello, or None after a Reject.

    Raises:
        ProtocolError: the reader sent something other than a Hello.
        PeerTimeoutError, PeerClosedError: the reader went silent or away.
    """
    nonce = security.make_nonce()
    await send_msg(conn, codec, wire.Challenge(nonce, security.PROTOCOL_VERSION), timeout_s)
    hello = await recv_msg(conn, codec, max_nbytes, timeout_s)
    if not isinstance(hello, wire.Hello):
        raise ProtocolError(f"expected Hello from {conn.peer}, got {type(hello).__name__}")
    problem: tuple[wire.RejectReason, str] | None = None
    if hello.protocol_version != security.PROTOCOL_VERSION:
        problem = (
            wire.RejectReason.VERSION,
            f"protocol version {hello.protocol_version} != {security.PROTOCOL_VERSION}",
        )
    elif hello.compat_hash != me.compat_hash:
        problem = (
            wire.RejectReason.COMPAT,
            f"compat hash {hello.compat_hash[:12]} != {me.compat_hash[:12]}"
            + _describe(me.compat),
        )
    elif me.secret is not None:
        context = security.handshake_context(
            "reader", hello.engine_id, hello.rank, me.engine_id, me.rank
        )
        if hello.proof is None or not security.verify(me.secret, nonce, context, hello.proof):
            problem = (wire.RejectReason.AUTH, "missing or wrong cluster secret proof" + _SAME)
        elif len(hello.nonce) != security.NONCE_NBYTES:
            problem = (wire.RejectReason.AUTH, f"reader nonce of {len(hello.nonce)} bytes")
    if problem is not None:
        await reject(conn, codec, *problem)
        return None
    proof = None
    if me.secret is not None:
        context = security.handshake_context(
            "server", hello.engine_id, hello.rank, me.engine_id, me.rank
        )
        proof = security.prove(me.secret, hello.nonce, context)
    await send_msg(conn, codec, _with_proof(metadata, proof), timeout_s)
    return hello


def _with_proof(metadata: wire.AgentMetadata, proof: bytes | None) -> wire.AgentMetadata:
    fields = {name: getattr(metadata, name) for name in metadata.__struct_fields__}
    fields["proof"] = proof
    return wire.AgentMetadata(**fields)


async def reader_handshake(
    conn: UcxConnection,
    codec: wire.MessageCodec,
    me: Identity,
    server_engine_id: str,
    server_rank: int,
    *,
    max_nbytes: int,
    timeout_s: float,
) -> wire.AgentMetadata:
    """Run the reader side; return the server's verified metadata.

    Raises:
        RejectedError: the server refused us (reason in ``.reason``; ``BUSY``
            before any challenge: it serves as many connections as it may).
        ProtocolError: unexpected message, wrong engine/rank, or a bad server proof.
        PeerTimeoutError, PeerClosedError: the server went silent or away.
    """
    challenge = await recv_msg(conn, codec, max_nbytes, timeout_s)
    if isinstance(challenge, wire.Reject):  # e.g. a server at its session cap
        raise RejectedError(challenge.reason, challenge.message)
    if not isinstance(challenge, wire.Challenge):
        raise ProtocolError(f"expected Challenge from {conn.peer}, got {type(challenge).__name__}")
    if len(challenge.nonce) != security.NONCE_NBYTES:
        raise ProtocolError(f"server nonce of {len(challenge.nonce)} bytes from {conn.peer}")
    nonce = security.make_nonce()
    proof = None
    if me.secret is not None:
        context = security.handshake_context(
            "reader", me.engine_id, me.rank, server_engine_id, server_rank
        )
        proof = security.prove(me.secret, challenge.nonce, context)
    hello = wire.Hello(
        me.engine_id, me.rank, security.PROTOCOL_VERSION, me.compat_hash, nonce, proof,
        me.topology,
    )
    await send_msg(conn, codec, hello, timeout_s)
    reply = await recv_msg(conn, codec, max_nbytes, timeout_s)
    match reply:
        case wire.Reject(reason=reason, message=message):
            if reason == wire.RejectReason.COMPAT:
                message = compat_reason(me.compat, message)
            raise RejectedError(reason, message)
        case wire.AgentMetadata():
            pass
        case _:
            raise ProtocolError(f"expected AgentMetadata from {conn.peer}, got {reply!r:.80}")
    rank = reply.pp_rank * reply.tp_size + reply.tp_rank
    if reply.engine_id != server_engine_id or rank != server_rank:
        raise ProtocolError(
            f"{conn.peer} is engine {reply.engine_id!r} rank {rank}, "
            f"expected {server_engine_id!r} rank {server_rank}"
        )
    if me.secret is not None:
        context = security.handshake_context(
            "server", me.engine_id, me.rank, server_engine_id, server_rank
        )
        if reply.proof is None or not security.verify(me.secret, nonce, context, reply.proof):
            raise ProtocolError(f"{conn.peer} failed to prove the cluster secret" + _SAME)
    return reply
