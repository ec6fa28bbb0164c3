"""Typed errors of the transfer layer.

Raised by :mod:`kvbridge.transfer.ucx` (network waits),
:mod:`kvbridge.transfer.protocol.wire` (decoding peer bytes) and the agent's
two halves (handshake, grants, reads). The agent turns each of
them into failed block ids for the request concerned; none of them is fatal to the
agent, which keeps serving other peers.

Hierarchy::

    KVBridgeError
      TransferError
        PeerTimeoutError      a network wait passed its deadline
        PeerClosedError       the peer said goodbye, or the connection was aborted
        PeerUnreachableError  no connection could be made
        ProtocolError         malformed, truncated, oversized or unexpected bytes
        RejectedError         the peer refused us with a reason code
          LeaseRefusedError   ... a lease renewal (fails the read that asked)
            NoReadServedError ... one naming no read the server serves (no
                                  verdict on the read)
        ReplyPendingError     a second wait for a reply already awaited on a link
        ReadCancelledError    the reader's engine cancelled the read (``cancel_reads``)
      ConfigError
        MissingPortError      a read needs a remote rank its per-rank port list lacks
"""

from __future__ import annotations

from kvbridge.errors import ConfigError, KVBridgeError


class TransferError(KVBridgeError):
    """Base class of every transfer failure."""


class PeerTimeoutError(TransferError):
    """A network wait (connect, send, receive, reply) passed its deadline."""


class PeerClosedError(TransferError):
    """The connection was closed by the peer or aborted locally."""


class PeerUnreachableError(TransferError):
    """A connection to the peer could not be set up."""


class ProtocolError(TransferError):
    """A peer sent bytes that do not form a valid, expected message."""


class RejectedError(TransferError):
    """The peer answered with a ``Reject`` message.

    Attributes:
        reason: the peer's reason code (a ``wire.RejectReason`` value).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"rejected ({reason}): {message}")
        self.reason = reason


class LeaseRefusedError(RejectedError):
    """The server refused to renew the grant of one read (``Reject(renewal=True)``).

    Fails that read alone; the link and its other reads go on.
    """


class NoReadServedError(LeaseRefusedError):
    """The server serves no read of the grant under the renewal's xfer id
    (``Reject(no_read, renewal=True)``): it extended nothing.

    A lease is renewed only while the server serves a read of the grant (see
    ``serving/grants.py``). The server's half of the read has ended (its sends
    are done, or the read failed there), has not pinned the grant yet, or never
    existed (a same-host copy on the grant board's word, which the server does
    not hear of). No verdict on the read: its own data says whether it succeeded.
    """


class ReplyPendingError(TransferError):
    """A request would wait for a reply that another request on the link already awaits.

    Raised before anything is sent; the first waiter keeps the reply. Means two
    reads in flight drew one xfer id, or one read renewed its grant twice at once.
    """


class ReadCancelledError(TransferError):
    """The reading engine cancelled the read (``TransferAgent.cancel_reads``): a load
    late at its deadline. Its blocks are reported failed like any other failure's;
    the engine recomputes them or fails the request, as its policy says."""


class MissingPortError(ConfigError):
    """A read or done notice needs a remote rank beyond the per-rank ports it was given.

    Raised on the agent's loop once the remote engine's plan names the rank (the
    list's length cannot be checked before); the read fails like any other.
    """
