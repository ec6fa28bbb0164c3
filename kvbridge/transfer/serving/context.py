"""What the serving half of an agent shares: its context, sessions, and waiting for grants.

``ServerContext`` is built once by the agent (``agent.py``) and passed to every
session (``session.py``); a ``Session`` is what one open connection has in
flight. The engine hands the grant to D before its workers have issued it
(the grant travels in the HTTP answer while the next engine step issues it),
so a read or done report naming an unknown grant waits up to
``grant_wait_s`` for it (``await_grant``), woken by ``grant_issued``.

The number of readers to expect is only known once D's first reader says who
it is: each session computes it from its Hello (``expected_readers``) and fixes
it on every grant it touches that was issued without one (``fix_readers``).

Everything here runs on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.errors import ConfigError
from kvbridge.topology import num_expected_readers
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks.staging import BufferPool
from kvbridge.transfer.chunk_trace import ChunkTrace
from kvbridge.transfer.clock import Clock
from kvbridge.transfer.errors import PeerTimeoutError
from kvbridge.transfer.local_kv import LocalKV, topology_from_info
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import Identity
from kvbridge.transfer.protocol.host import ProbeCell
from kvbridge.transfer.serving import grants as grant_errors
from kvbridge.transfer.serving.grants import GrantTable
from kvbridge.transfer.ucx.ucp_lib import UcpLibrary

if TYPE_CHECKING:
    from kvbridge.transfer.serving.copy_hold import CopyHold

__all__ = [
    "ServedRead", "ServerContext", "Session", "await_grant", "expected_readers", "fix_readers",
    "grant_issued",
]

_GRANT_POLL_S = 0.05  # a fallback: issue_grant wakes waiters at once


@dataclass(slots=True)
class ServerContext:
    """What every session of one agent shares (owned by the agent)."""

    me: Identity
    local: LocalKV
    grants: GrantTable
    config: AgentConfig
    pool: BufferPool
    executor: Executor
    clock: Clock
    codec: wire.MessageCodec = field(default_factory=wire.MessageCodec)
    ucp: UcpLibrary = field(default_factory=UcpLibrary)
    reports: set[asyncio.Task[None]] = field(default_factory=set)  # done reports waiting
    # Set (and replaced) each time the engine issues a grant: see ``grant_issued``.
    issued: asyncio.Event = field(default_factory=asyncio.Event)
    sessions: set[Session] = field(default_factory=set)  # open sessions
    num_sessions_total: int = 0
    num_sessions_refused: int = 0  # connections refused at max_sessions
    num_bytes_served: int = 0  # KV bytes of reads served to the end
    num_data_bytes_sent: int = 0  # KV bytes handed to UCX on data channels
    num_reads_served: int = 0
    # Same-host copies: offered in the handshake when set (see ``protocol/host.py``).
    probe: ProbeCell | None = None
    host: wire.HostInfo | None = None
    num_holds: int = 0  # same-host copies pinned right now, sessions ended or not
    num_board_copies: int = 0  # same-host copies made on the grant board's word
    # Seconds reads that came before their grant waited for it (``await_grant``), until
    # the engine takes them (``TransferAgent.take_grant_waits``; appended on the loop).
    grant_waits: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=4096))
    trace: ChunkTrace | None = None  # staged chunks' timeline (``chunk_trace.py``); None: off


@dataclass(eq=False, slots=True)
class Session:
    """What one open connection has in flight (registered in ``ServerContext.sessions``)."""

    reads: dict[int, ServedRead] = field(default_factory=dict)  # xfer id -> read in flight
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # reads being served
    holds: dict[int, CopyHold] = field(default_factory=dict)  # xfer id -> copy under way


class ServedRead:
    """One read being served on a session: its grant, its deadline, its credit.

    ``deadline`` (the grant table's clock) is set once the grant is pinned for
    the read (``checks.pin``): the server ends the read by then
    (``checks.read_budget_s``), and a lease renewal the reader asks for it never
    moves the lease past it. None: not pinned (yet). A staged read waits on
    the credit per chunk.
    """

    def __init__(self, grant: str) -> None:
        self.grant = grant  # the grant the reader named (its string)
        self.deadline: float | None = None
        # The reader said CopyDone before the grant was pinned for it (it copied on the
        # grant board's word while this read waited for the grant): never pin it.
        self.withdrawn = False
        self.credit = 0
        self.changed = asyncio.Event()

    def grant_credit(self, num_chunks: int) -> None:
        if num_chunks > self.credit:
            self.credit = num_chunks
            self.changed.set()

    async def wait_credit(self, num_chunks: int, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while self.credit < num_chunks:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise PeerTimeoutError(
                f"no credit for chunk {num_chunks - 1} in {timeout_s}s"
            ) from None


def expected_readers(ctx: ServerContext, hello: wire.Hello) -> int:
    """Readers of the hello's engine that will report to this rank (1 without a topology).

    Raises:
        ConfigError: the reader's topology is invalid or cannot pair with ours.
    """
    if hello.topology is None:
        return 1
    try:
        reader = topology_from_info(hello.topology)
    except ValueError as exc:  # ConfigError is one; an unknown layout name another
        raise ConfigError(f"bad reader topology: {exc}") from None
    local = ctx.local
    return num_expected_readers(reader, local.topology, local.tp_rank, local.pp_rank)


def grant_issued(ctx: ServerContext) -> None:
    """Wake every read or report waiting for a grant (loop thread; the agent calls it)."""
    woken, ctx.issued = ctx.issued, asyncio.Event()
    woken.set()


async def await_grant(ctx: ServerContext, grant: str, num_readers: int) -> None:
    """Wait for grant ``grant`` to be issued.

    Returns as soon as the table knows the grant (live or released), else after
    ``grant_wait_s`` (the caller's grant call then raises ``UnknownGrantError``).
    A live grant issued without a reader count gets ``num_readers``. Woken by
    ``grant_issued``; it also looks every ``_GRANT_POLL_S`` (grants issued on the
    table directly, not through the agent, wake nobody).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.config.grant_wait_s
    while not ctx.grants.is_known(grant) and (left_s := deadline - loop.time()) > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left_s, _GRANT_POLL_S)):
                await ctx.issued.wait()
    # unknown or released: the grant call that follows says so
    fix_readers(ctx, grant, num_readers)


def fix_readers(ctx: ServerContext, grant: str, num_readers: int) -> None:
    """Give a live grant issued without a reader count this session's (else nothing)."""
    with contextlib.suppress(grant_errors.GrantError):
        ctx.grants.set_expected_readers(grant, num_readers)
