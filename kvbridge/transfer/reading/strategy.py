"""The one interface every read strategy implements, and what they are given.

A link (``link.py``) reads one plan item in three steps, whatever the strategy::

    setup = prepare(...)                  what to ask for: request, wire format,
                                          tokens, and whether it can be read direct
    begun = Strategy.begin(link, setup)   no waiting; a direct read is under way
    result = await begun.finish()         or begun.abandon(): exactly one of them

Three strategies, one module each, chosen by the link from ``setup``:

- ``staged.py``  the server packs, we receive into staging buffers and unpack
  (blocks stored differently: layout, block size, a strided head slice);
- ``direct.py``  receives straight into our blocks (``setup.span`` is set:
  both caches store the item's blocks alike);
- ``same_host.py``  we copy the server's blocks out of its memory ourselves
  (direct, the server on this host, a large read).

``begun.finished_now()`` may give the result with no waiting at all (a
same-host copy on the grant board's word that ``begin`` made whole); then the
read needs no ``finish``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.errors import ConfigError
from kvbridge.kernels import WireFormat
from kvbridge.topology import KVLayout, RemoteRead
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks.ranges import HeadSpan, head_span, num_planes
from kvbridge.transfer.blocks.staging import BufferPool
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import Identity
from kvbridge.transfer.reading.copier import Copier
from kvbridge.transfer.reading.tokens import TokenWindow
from kvbridge.transfer.ucx.ucp_lib import UcpLibrary

if TYPE_CHECKING:
    from kvbridge.transfer.reading.link import PeerLink

__all__ = ["BegunRead", "ItemResult", "ReadSetup", "ReaderContext", "prepare"]


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


@dataclass(slots=True)
class ItemResult:
    """Counters of one finished plan item."""

    nbytes: int
    num_messages: int
    direct: bool = False  # block memory to block memory, no staging
    local_copy: bool = False  # copied out of the server's memory by us (same host)
    unasked: bool = False  # ... on the server's grant board's word (``grant_board.py``)


@dataclass(slots=True)
class ReadSetup:
    """One plan item's read as prepared for a strategy (see ``prepare``)."""

    item: RemoteRead
    request: wire.ReadRequest  # as for a staged read; direct strategies adapt it
    wire_fmt: WireFormat
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

    def __init__(self, link: PeerLink, setup: ReadSetup) -> None:
        self.link = link
        self.setup = setup

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


def prepare(
    meta: wire.AgentMetadata,
    ctx: ReaderContext,
    xfer_ids: Iterator[int],
    item: RemoteRead,
    grant: str,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    num_tokens: int,
    first_token: int,
    prompt_digest: bytes,
) -> ReadSetup:
    """The read of ``item`` from a server described by ``meta``: request, format, tokens.

    ``xfer_ids``: the link's id counter (one id is drawn once the read is valid).

    Raises:
        ConfigError: the remote block ids do not cover the tokens, or a fused
            K/V cache is read from inside a block.
    """
    wire_fmt = WireFormat(
        layout=KVLayout.parse(meta.layout), block_size=meta.block_size,
        num_heads=len(item.remote_heads), head_dim=meta.head_dim,
        elem_nbytes=meta.elem_nbytes, num_layers=len(item.remote_layers), is_mla=meta.is_mla,
        fused_kv=meta.fused_kv,
    )
    fused = ctx.local.topology.fused_kv
    if fused and first_token % meta.block_size:
        raise ConfigError(
            f"a fused K/V cache (K transposed in each block) is read in whole blocks: "
            f"first token {first_token} is inside a block of {meta.block_size} tokens"
        )
    tokens = TokenWindow(first_token, num_tokens, meta.block_size, ctx.local.topology,
                         whole_blocks=fused)
    block_ids = list(remote_block_ids[tokens.first_remote_block : tokens.end_remote_block])
    num_blocks = len(block_ids)
    if num_blocks != tokens.end_remote_block - tokens.first_remote_block:
        raise ConfigError(
            f"{len(remote_block_ids)} remote block ids of {meta.block_size} tokens do not "
            f"cover tokens [{first_token}, {first_token + num_tokens})"
        )
    chunk_blocks = max(1, ctx.config.chunk_nbytes // wire_fmt.block_nbytes)
    xfer_id = next(xfer_ids) % wire.MAX_XFER_ID + 1
    request = wire.ReadRequest(
        xfer_id, grant, block_ids, item.remote_heads.start, item.remote_heads.stop,
        item.remote_layers.start, item.remote_layers.stop, chunk_blocks,
        prompt_digest=prompt_digest,
    )
    span = _direct_span(meta, ctx, item, tokens)
    return ReadSetup(item, request, wire_fmt, tokens, local_block_ids, span)


def _direct_span(
    meta: wire.AgentMetadata, ctx: ReaderContext, item: RemoteRead, tokens: TokenWindow
) -> HeadSpan | None:
    """Our heads' run in a block plane if this item can be read direct, else None."""
    local = ctx.local
    topo = local.topology
    alike = (
        meta.is_mla == topo.is_mla and meta.fused_kv == topo.fused_kv
        and KVLayout.parse(meta.layout) is topo.layout
        and meta.block_size == topo.block_size and meta.elem_nbytes == local.elem_nbytes
        and meta.head_dim == local.head_dim and tokens.skip == 0
        and tokens.local_offset == 0
    )
    if not alike or not ctx.config.direct_reads or local.layers[0].is_cuda:
        return None  # GPU memory: one packed buffer per chunk, not 32 KiB pieces (staging.py)
    heads = item.remote_heads
    remote_run = meta.is_mla or topo.layout is KVLayout.HND or len(heads) == meta.num_heads
    local_span = head_span(local, item.local_head_offset, item.local_head_offset + len(heads))
    return local_span if remote_run else None
