"""What every read strategy is given and implements: ``BegunRead`` and its inputs.

A link (``link.py``) reads one plan item in three steps, whatever the strategy::

    setup = prepare(...)                  what to ask for: request, wire format,
                                          tokens, and whether it can be read direct
    begun = Strategy.begin(link, setup)   no waiting; a direct read is under way
    result = await begun.finish()         or begun.abandon(): exactly one of them

``prepare`` and the choice of ``Strategy`` are ``strategy.py``'s; the
strategies (``staged.py``, ``direct.py``, ``same_host.py``) subclass
``BegunRead``. ``begun.finished_now()`` may give the result with no waiting at
all (a same-host copy on the grant board's word that ``begin`` made whole);
then the read needs no ``finish``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.kernels import PackedFormat
from kvbridge.topology import RemoteRead
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks.ranges import HeadSpan, num_planes
from kvbridge.transfer.blocks.staging import BufferPool
from kvbridge.transfer.chunk_trace import ChunkTrace
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import Identity
from kvbridge.transfer.reading.copier import Copier
from kvbridge.transfer.reading.tokens import TokenWindow
from kvbridge.transfer.ucx.ucp_lib import UcpLibrary

if TYPE_CHECKING:
    from kvbridge.transfer.reading.link import PeerLink

__all__ = ["BegunRead", "ItemResult", "ReadSetup", "ReaderContext"]


@dataclass(slots=True)
class ReaderContext:
    """What every link of one agent shares (owned by the agent)."""

    me: Identity
    local: LocalKV
    config: AgentConfig
    pool: BufferPool
    executor: Executor
    codec: wire.MessageCodec = field(default_factory=wire.MessageCodec)
    ucp: UcpLibrary = field(default_factory=UcpLibrary)
    copier: Copier | None = None  # None: no same-host copies
    trace: ChunkTrace | None = None  # staged chunks' timeline (``chunk_trace.py``); None: off


@dataclass(slots=True)
class ItemResult:
    """Counters of one finished plan item."""

    nbytes: int
    num_messages: int
    direct: bool = False  # block memory to block memory, no staging
    local_copy: bool = False  # copied out of the server's memory by us (same host)
    unasked: bool = False  # ... on the server's grant board's word (``grant_board.py``)
    # The read's timeline (``time.monotonic``; ``BegunRead.stamped``): begun, the grant
    # confirmed (the board said yes, the server's go, header or first chunk came), landed.
    began_at: float = 0.0
    granted_at: float = 0.0
    landed_at: float = 0.0


@dataclass(slots=True)
class ReadSetup:
    """One plan item's read as prepared for a strategy (see ``prepare``)."""

    item: RemoteRead
    request: wire.ReadRequest  # as for a staged read; direct strategies adapt it
    packed_fmt: PackedFormat
    tokens: TokenWindow
    local_block_ids: Sequence[int]
    span: HeadSpan | None  # our heads' run in a block plane if the item can be read direct

    @property
    def direct_block_ids(self) -> Sequence[int]:
        """Our blocks that take the remote blocks one for one (direct reads)."""
        first = self.tokens.first_local_block
        return self.local_block_ids[first:][: len(self.request.block_ids)]

    def direct_nbytes(self, local: LocalKV) -> int:
        """Bytes a direct read of the item moves (``span`` must be set)."""
        assert self.span is not None
        per_block = len(self.item.local_layers) * num_planes(local) * self.span.nbytes
        return len(self.request.block_ids) * per_block


class BegunRead(ABC):
    """One plan item's read under one strategy, from ``begin`` to its end.

    Whoever calls ``begin`` must call exactly one of ``finish`` and ``abandon``
    (unless ``finished_now`` returned a result). All on the agent's loop.
    """

    #: Nothing of this read can write into our blocks any more (meaningful once it
    #: ended): False while a chunk given up may still land in them (``direct.py``).
    quiet: bool = True
    #: When the server's word that the grant holds came (``time.monotonic``; 0: not yet):
    #: the grant board's yes, the go, the header or the first chunk (each strategy sets it).
    granted_at: float = 0.0

    def __init__(self, link: PeerLink, setup: ReadSetup) -> None:
        self.link = link
        self.setup = setup
        self.began_at = time.monotonic()

    def grant_seen(self) -> None:
        """The grant holds (the first word of it counts)."""
        if not self.granted_at:
            self.granted_at = time.monotonic()

    def stamped(self, result: ItemResult) -> ItemResult:
        """``result`` with this read's timeline (landed: now)."""
        result.landed_at = time.monotonic()
        result.began_at = self.began_at
        result.granted_at = self.granted_at or result.landed_at
        return result

    @property
    def item(self) -> RemoteRead:
        """The plan item being read."""
        return self.setup.item

    @property
    def request(self) -> wire.ReadRequest:
        """The request sent (or to be sent) for it; its ``xfer_id`` names the read."""
        return self.setup.request

    @classmethod
    @abstractmethod
    def begin(cls, link: PeerLink, setup: ReadSetup) -> BegunRead:
        """Start what needs no waiting (post receives, ask, start a copy).

        Raises:
            TransferError: the link is dead, or UCX refused a receive.
        """

    def finished_now(self) -> ItemResult | None:
        """The result if the read needs no more waiting, else None (``finish`` it)."""
        return None

    @property
    def asked(self) -> bool:
        """Whether the server was asked for this read (so it serves it, pinning the
        grant): only such a read's lease may be renewed (``serving/grants.py``)."""
        return True

    @abstractmethod
    async def finish(self) -> ItemResult:
        """Wait for the read to land (and unpack it).

        Raises:
            RejectedError: the server refused the read (grant unknown/expired, ...).
            ProtocolError: the server's answer does not fit the read (link killed
                when bytes may have landed unasked).
            PeerTimeoutError, PeerClosedError: the server went silent or away.
        """

    @abstractmethod
    def abandon(self) -> None:
        """Give up a begun read that will never be finished (its job was cancelled)."""
