"""One read job as the agent submits it, and what the read cost.

``agent.py`` validates a ``start_read`` or ``notify_done`` call into a
``ReadJob`` (its ports through ``checked_ports``) and hands it to ``Reads``
(``reads.py``) on its loop; each job that reads ends with one ``ReadStats``,
which ``TransferAgent.get_stats`` returns (the connector sums them per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.transfer.errors import MissingPortError

__all__ = ["ReadJob", "ReadStats", "checked_ports"]


@dataclass(slots=True)
class ReadJob:
    """One ``start_read`` call (validated by the agent). Never changed once made (not
    ``frozen``: that makes each read's job slower to build; docs/benchmarks.md,
    "Figures behind the code").

    ``port``: the serving engine's base port (its rank ``g`` listens on ``port +
    g``), or the port of each of its global ranks (index = rank).
    """

    request_id: str
    engine_id: str
    host: str
    port: int | tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    grant: str
    num_tokens: int
    submitted_at: float
    first_token: int = 0
    prompt_digest: bytes = b""  # security.prompt_digest of the reader's prompt; b"": none
    notify_only: bool = False  # send ReadDone(ok) to every planned rank, read nothing
    ok: bool = True  # the ReadDone flag of a notify-only job

    def port_of(self, rank: int) -> int:
        """Where remote global rank ``rank`` listens.

        Raises:
            MissingPortError: a per-rank list without ``rank``.
        """
        if isinstance(self.port, int):
            return self.port + rank
        if rank >= len(self.port):
            raise MissingPortError(
                f"read {self.request_id!r} needs rank {rank} of engine {self.engine_id!r}, "
                f"but only the ports of ranks [0, {len(self.port)}) were given"
            )
        return self.port[rank]

    def has_port(self, rank: int) -> bool:
        """Whether :meth:`port_of` knows ``rank``."""
        return isinstance(self.port, int) or rank < len(self.port)


@dataclass(frozen=True, slots=True)
class ReadStats:
    """What one read cost.

    Attributes:
        request_id: the request.
        ok: all items succeeded.
        nbytes: KV bytes received.
        duration_s: from ``start_read`` to the outcome.
        num_messages: control messages and data chunks exchanged.
        num_remote_ranks: remote ranks contacted.
        error: the first failure, empty when ok.
        num_direct: plan items read direct, block memory to block memory (the
            rest were staged: packed, sent, unpacked).
        num_local_copies: of those, items this reader copied out of a server
            process on its own host (``same_host.py``) instead of through UCX.
        queue_s, grant_s, copy_s: the read's timeline, ``duration_s`` in three
            (of a read that succeeded; else 0): from ``start_read`` until the
            agent's thread began it (0 for a read made on the caller's thread,
            ``inline.py``), until the grant was confirmed (the server's grant
            board said yes, or its go, header or first chunk came), until the last
            byte landed. Several plan items: the first began, the last confirmed,
            the last landed.
        ended_at: ``time.monotonic()`` when the outcome was recorded (the engine
            collects it later: ``ended_at`` to then is its wait).
    """

    request_id: str
    ok: bool
    nbytes: int
    duration_s: float
    num_messages: int
    num_remote_ranks: int
    error: str = ""
    num_direct: int = 0
    num_local_copies: int = 0
    queue_s: float = 0.0
    grant_s: float = 0.0
    copy_s: float = 0.0
    ended_at: float = 0.0


def checked_ports(request_id: str, port: int | Sequence[int]) -> int | tuple[int, ...]:
    """``port`` as ``ReadJob`` keeps it: the base port, or a checked per-rank tuple.

    Raises:
        ConfigError: an empty list, or an entry that is not an int in [1, 65535].
    """
    if isinstance(port, int):  # a base port, as every caller passed before lists
        return port
    ports = tuple(port)
    bad = [p for p in ports if isinstance(p, bool) or not isinstance(p, int)
           or not 1 <= p <= 65535]
    if not ports or bad:
        raise ConfigError(
            f"read {request_id!r}: the per-rank port list must be non-empty ints in "
            f"[1, 65535], got {len(ports)} ports, bad ones: {bad[:8]}"
        )
    return ports
