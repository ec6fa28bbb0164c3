"""The per-step message from the connector's scheduler side to every worker.

``ConnectorScheduler.build_connector_meta`` makes one ``ConnectorMetadata`` per
engine step; the engine sends the same object to every TP/PP worker, whose
``ConnectorWorker.start_load_kv`` acts on it. It is a ``msgspec.Struct``, so it
pickles for worker pipes and encodes with msgspec (no other wire format).

Four lists, each consumed once::

    reqs_to_recv     D: read these tokens of a request from P into these blocks
    reqs_to_send     P: hold these blocks under this grant for readers
    reqs_to_release  P: revoke these requests' grants now (blocks freed after)
    reqs_to_notify   D: tell P we will not read (full local hit, or aborted)
"""

from __future__ import annotations

import msgspec

__all__ = ["ConnectorMetadata", "NotifyRequest", "RecvRequest", "SendRequest"]


class RecvRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Load request tokens ``[first_token, first_token + num_tokens)`` from P.

    Token ``t`` lives in ``remote_block_ids[t // remote_block_size]`` on P and
    lands in ``local_block_ids[t // local block size]``; blocks before
    ``first_token`` (local prefix hits) are not written.

    Attributes:
        request_id: the request on this (D) engine.
        local_block_ids: D's blocks of the request from token 0, in token order.
        first_token: first token to load (D's local prefix hit, a block multiple).
        num_tokens: tokens to load (> 0).
        remote_engine_id: P's engine id.
        remote_host: P's transfer host.
        remote_port: P's transfer base port.
        remote_ports: the port of each of P's global ranks (empty: base + rank).
        remote_tp_size: P's TP size (the handshake is authoritative).
        remote_pp_size: P's PP size.
        remote_block_size: P's block size.
        remote_block_ids: P's blocks of the request from token 0.
        grant: P's grant (the secret string that names it).
        kv_digest: ``binding.kv_digest`` of this request's prompt and
            ``remote_block_ids``, sent with every read: P refuses the read
            unless its grant was issued for the same prompt and blocks.
        missing_block_ids: local blocks the request needs that no read fills
            (P does not hold them): reported failed when the read ends.

    Several KV cache groups (``kvbridge.topology.groups``): the block lists are
    the pairs of every group, group after group, read as whole blocks
    (``first_token`` 0, ``num_tokens`` a multiple of the equal block sizes).
    """

    request_id: str
    local_block_ids: list[int]
    first_token: int
    num_tokens: int
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_ports: list[int] = []
    remote_tp_size: int
    remote_pp_size: int
    remote_block_size: int
    remote_block_ids: list[int]
    grant: str
    kv_digest: bytes
    missing_block_ids: list[int] = []

    @property
    def end_token(self) -> int:
        """One past the last loaded token."""
        return self.first_token + self.num_tokens

    @property
    def ports(self) -> int | list[int]:
        """P's ports as ``TransferAgent.start_read`` takes them: per rank, else the base."""
        return self.remote_ports or self.remote_port


class SendRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Hold a finished prefill's blocks for remote readers.

    Attributes:
        request_id: the request on this (P) engine.
        block_ids: blocks to hold, in token order.
        grant: the string every rank issues the grant under (readers send one
            to all ranks).
        lease_s: how long the blocks are held if readers do not report.
        kv_digest: ``binding.kv_digest`` of the prompt tokens the blocks hold
            and ``block_ids``; the grant refuses reads naming anything else.
        finished_at: ``time.monotonic()`` of the scheduler when the request
            finished (0: unknown); the worker counts from it to its grant
            (``TransferStats.phases_s["publish"]``).
    """

    request_id: str
    block_ids: list[int]
    grant: str
    lease_s: float
    kv_digest: bytes
    finished_at: float = 0.0


class NotifyRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Tell P's ranks that this engine's ranks will not read a request.

    Attributes:
        request_id: the request on this (D) engine.
        remote_engine_id: P's engine id.
        remote_host: P's transfer host.
        remote_port: P's transfer base port.
        remote_ports: the port of each of P's global ranks (empty: base + rank).
        grant: P's grant (the secret string that names it).
        ok: True when nothing was needed (full local hit), False when the
            request was aborted or could not be loaded.
    """

    request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_ports: list[int] = []
    grant: str
    ok: bool

    @property
    def ports(self) -> int | list[int]:
        """P's ports as ``TransferAgent.notify_done`` takes them: per rank, else the base."""
        return self.remote_ports or self.remote_port


class ConnectorMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the workers must do for the connector in one step."""

    reqs_to_recv: list[RecvRequest] = []
    reqs_to_send: list[SendRequest] = []
    reqs_to_release: list[str] = []
    reqs_to_notify: list[NotifyRequest] = []

    def is_empty(self) -> bool:
        """True when the workers have nothing to do."""
        return not (
            self.reqs_to_recv or self.reqs_to_send or self.reqs_to_release or self.reqs_to_notify
        )
