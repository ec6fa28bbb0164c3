"""``TransferAgent``: one per worker process; serves and issues KV block reads over UCX.

Called by the connector's worker side (``kvbridge.connector``), from the engine's
synchronous worker thread. The agent runs its own asyncio event loop in a
background thread that owns the UCX worker, its listener and every connection;
the public methods below are thread-safe and never block on the network
(``start``/``close`` wait for the loop thread, with a deadline).

Addresses: the agent of global rank ``g`` of an engine listens on
``base_port + g``; ``start_read`` is given the remote engine's ``base_port``, or,
for an engine whose agents took any free port (``port=0``), the list of its
ranks' ports (``port=[p0, p1, ...]``, index = global rank).

Example (P rank 0 serving, D rank 0 reading)::

    p = TransferAgent("prefill", p_topo, 0, 0, compat, port=5600)
    p.register_kv_caches(p_caches); p.start()
    grant = p.issue_grant("req-1", block_ids=[3, 7], num_expected_readers=1).grant

    d = TransferAgent("decode", d_topo, 0, 0, compat)
    d.register_kv_caches(d_caches); d.start()
    d.start_read("req-1", engine_id="prefill", host="10.0.0.1", port=5600,
                 remote_block_ids=[3, 7], local_block_ids=[0, 1],
                 grant=grant, num_tokens=20)
    ...
    sending, recving = p.get_finished(), d.get_finished()   # each: (sending, recving)
    d.get_failed_block_ids()                                # {} when all went well

A grant may leave the reader count open (``num_expected_readers=None``): each
serving rank then fixes it from the first reader's handshake, which carries the
reader engine's topology. A reader that needs nothing (its own prefix cache
already holds the tokens, or its request was aborted) still tells every serving
rank it would have read from, with ``notify_done``, so P frees at once.

The work is done by the agent's two halves, ``serving/`` (sessions, grants,
sending) and ``reading/`` (links, read strategies), over ``ucx/`` and
``protocol/``. Each public method is thin: it validates its arguments and hands
the work to the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks.staging import BufferPool
from kvbridge.transfer.chunk_trace import ChunkTrace
from kvbridge.transfer.clock import Clock, MonotonicClock
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.local_kv import LocalKV, topology_info
from kvbridge.transfer.protocol.grant_board import GrantBoard, board_supported
from kvbridge.transfer.protocol.handshake import Identity
from kvbridge.transfer.protocol.host import ProbeCell, allowed, host_memory
from kvbridge.transfer.protocol.security import CompatInfo, compat_hash
from kvbridge.transfer.reading.base import ReaderContext
from kvbridge.transfer.reading.copier import Copier
from kvbridge.transfer.reading.jobs import ReadJob, ReadStats, checked_ports
from kvbridge.transfer.reading.reads import Reads
from kvbridge.transfer.serving.context import ServerContext, grant_issued
from kvbridge.transfer.serving.grants import Grant, GrantTable
from kvbridge.transfer.serving.session import serve_connection
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import UcxWorker

__all__ = ["AgentConfig", "AgentCounters", "ReadStats", "TransferAgent"]

logger = logging.getLogger(__name__)

_IDLE_EXPIRY_S = 1.0  # an agent holding no grants looks this often (see _expire_grants)


@dataclass(slots=True)
class _Running:
    loop: asyncio.AbstractEventLoop
    worker: UcxWorker
    reads: Reads
    stop: asyncio.Event
    server: ServerContext
    grant_issued: asyncio.Event = field(default_factory=asyncio.Event)  # wakes the expiry


@dataclass(frozen=True, slots=True)
class AgentCounters:
    """One consistent snapshot of an agent's serving tables and totals.

    The ``num_*`` "now" values return to their idle baseline once peers are gone
    and their done reports are settled; tests use that to prove nothing leaks.
    """

    num_sessions: int  # server sessions open now
    num_sessions_total: int  # connections that reached the server since start
    num_sessions_refused: int  # connections refused at AgentConfig.max_sessions
    num_serving_reads: int  # reads being served now (all sessions)
    num_copy_holds: int  # same-host copies holding their grant pinned now
    num_board_copies: int  # same-host copies made on the grant board's word since start
    num_read_tasks: int  # tasks serving those reads
    num_pending_reports: int  # done reports waiting for their grant to be issued
    num_staging_lent: int  # serve staging buffers lent out
    num_grants: int  # grants not yet released
    num_reads_served: int  # reads served to the end since start
    num_bytes_served: int  # KV bytes of those reads
    num_data_bytes_sent: int  # KV bytes handed to UCX on data channels (any outcome)
    num_ucx_requests: int  # UCX requests in flight (both halves)
    num_ucx_connections: int  # UCX connections open (both halves)
    num_ucx_tasks: int  # accepted-connection tasks alive
    num_ucx_stray_dropped: int  # unexpected UCX messages nothing would receive, dropped


class TransferAgent:
    """Serves this worker's KV blocks and pulls remote blocks into them.

    When ``KVBRIDGE_TRACE_CHUNKS`` names a directory as the agent is constructed,
    every staged chunk it serves or reads is traced there (``chunk_trace.py``).

    Args:
        engine_id: this engine's id (same on all its workers).
        topology: this engine's topology.
        tp_rank: this worker's TP rank.
        pp_rank: this worker's PP rank.
        compat: what peers must agree on (hashed into the handshake).
        port: listening port, 0 for any free port (read ``port`` after ``start``).
        secret: cluster secret; when set, peers must prove they know it.
        config: timeouts and buffer sizes.
        clock: time source of the grant table.
        on_event: called whenever ``get_finished`` may have news (a read ended,
            a grant was released), from the agent's thread or from the thread in
            ``start_read`` (a read made there); it must be quick, thread-safe and
            must not call back into the agent. For an engine
            that sleeps between steps (``kvbridge.reference.engine.wakeup``).

    Raises:
        ConfigError: the ranks are out of range for ``topology``, or ``compat`` and
            ``topology`` disagree on ``fused_kv`` or ``split_kv``.
    """

    def __init__(
        self,
        engine_id: str,
        topology: EngineTopology,
        tp_rank: int,
        pp_rank: int,
        compat: CompatInfo,
        *,
        port: int = 0,
        secret: bytes | None = None,
        config: AgentConfig | None = None,
        clock: Clock | None = None,
        on_event: Callable[[], None] | None = None,
    ) -> None:
        if not engine_id:
            raise ConfigError("engine_id must be a non-empty string")
        for name in ("fused_kv", "split_kv"):
            if getattr(compat, name) != getattr(topology, name):
                raise ConfigError(
                    f"CompatInfo.{name} {getattr(compat, name)} != EngineTopology.{name} "
                    f"{getattr(topology, name)}: describe one cache"
                )
        self.engine_id = engine_id
        self.topology = topology
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.global_rank = topology.global_rank(tp_rank, pp_rank)
        self.config = config or AgentConfig()
        self._clock = clock or MonotonicClock()
        self._on_event = on_event
        self.grants = GrantTable(self._clock, self.config.lease_s, 10 * self.config.lease_s,
                                 on_release=self._released)
        self._me = Identity(
            engine_id, self.global_rank, compat_hash(compat), secret, topology_info(topology),
            compat,
        )
        self._requested_port = port
        self._trace = ChunkTrace.from_env()  # KVBRIDGE_TRACE_CHUNKS: staged chunks' timeline
        self._local: LocalKV | None = None
        self._running: _Running | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.port = 0

    def _released(self) -> None:
        """A grant was released: its owner (another thread) will come for it."""
        running = self._running
        if running is not None:
            running.worker.stop_spinning()
        if self._on_event is not None:
            self._on_event()

    # ---------------------------------------------------------------- lifecycle
    def register_kv_caches(self, layer_caches: Sequence[torch.Tensor]) -> None:
        """Register this worker's caches (one tensor per held layer) before ``start``.

        Raises:
            ConfigError: shapes disagree with the topology, or already started.
        """
        if self._thread is not None:
            raise ConfigError("register_kv_caches must be called before start()")
        self._local = LocalKV(self.topology, self.tp_rank, self.pp_rank, layer_caches)

    def start(self, timeout_s: float = 10.0) -> int:
        """Start the loop thread and the listener; return the bound port.

        Raises:
            ConfigError: no caches registered, or started twice.
            TransferError: the listener could not start within ``timeout_s``.
        """
        if self._local is None:
            raise ConfigError("register_kv_caches before start()")
        if self._thread is not None:
            raise ConfigError("TransferAgent.start() called twice")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._thread_main, args=(ready, failure), daemon=True,
            name=f"kvbridge-agent-{self.engine_id}-{self.global_rank}",
        )
        self._thread.start()
        if not ready.wait(timeout_s) or failure:
            raise TransferError(f"transfer agent did not start: {failure or 'timeout'}")
        return self.port

    def _thread_main(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(ready, failure))
        except BaseException as exc:  # reported to start(); the thread just ends
            failure.append(exc)
            ready.set()
        finally:
            loop.close()

    async def _main(self, ready: threading.Event, failure: list[BaseException]) -> None:
        assert self._local is not None
        cfg = self.config
        loop = asyncio.get_running_loop()
        worker = UcxWorker(gpu_memory=self._local.layers[0].is_cuda)
        executor = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-copy")
        server_ctx = ServerContext(
            self._me, self._local, self.grants, cfg,
            BufferPool(cfg.num_serve_buffers, self._local.layers[0].device, cfg.chunk_nbytes),
            executor, self._clock, trace=self._trace,
        )
        copier = None
        if allowed(cfg.local_copy) and host_memory(self._local.layers):
            server_ctx.probe = ProbeCell()
            board = (GrantBoard(self._local.place) if cfg.grant_board and board_supported()
                     else None)
            if board is not None:
                self.grants.attach_board(board)  # grants issued from now on
            server_ctx.host = server_ctx.probe.host_info(board)
            copier = Copier(cfg.copy_threads)
        reader_ctx = ReaderContext(
            self._me, self._local, cfg,
            BufferPool(cfg.num_read_slots * cfg.window_chunks, self._local.layers[0].device,
                       cfg.chunk_nbytes),
            executor, copier=copier, trace=self._trace,
        )
        reads = Reads(reader_ctx, worker, f"{self.engine_id}:{self.global_rank}",
                      on_outcome=self._on_event)

        async def on_connect(conn: UcxConnection) -> None:
            await serve_connection(server_ctx, conn)

        try:
            self.port = worker.listen(
                cfg.listen_host, self._requested_port, on_connect,
                timeout_s=cfg.handshake_timeout_s,
            )
            self._running = _Running(loop, worker, reads, asyncio.Event(), server_ctx)
            ready.set()
            expiry = asyncio.create_task(self._expire_grants(self._running))
            await self._running.stop.wait()
            expiry.cancel()
            await reads.close()
        finally:
            await worker.close()
            executor.shutdown(wait=False, cancel_futures=True)
            if copier is not None:
                copier.close()

    async def _expire_grants(self, running: _Running) -> None:
        # Every expire_every_s while grants are live; with none, asleep until one is
        # issued (an idle agent does not wake for nothing), or _IDLE_EXPIRY_S for
        # grants issued on the table directly.
        while True:
            running.grant_issued.clear()
            self.grants.expire()
            self.grants.refresh_board()
            if len(self.grants):
                await asyncio.sleep(self.config.expire_every_s)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_IDLE_EXPIRY_S):
                    await running.grant_issued.wait()

    def close(self, timeout_s: float = 5.0) -> None:
        """Say goodbye to peers, stop the loop thread, free UCX resources. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        running, thread = self._running, self._thread
        if running is not None and thread is not None and thread.is_alive():
            running.loop.call_soon_threadsafe(running.stop.set)
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("transfer agent thread did not stop within %ss", timeout_s)
        if self._trace is not None:
            self._trace.close()

    def abort(self) -> None:
        """Stop now without goodbyes (peers notice through their own deadlines)."""
        running = self._running
        if running is not None:
            running.loop.call_soon_threadsafe(running.reads.abort_all)
        self.close(timeout_s=1.0)

    def take_grant_waits(self) -> list[float]:
        """Return and forget how long each read served here that came before its grant
        waited for it (seconds; a grant published late: ``serving/context.await_grant``).
        Any thread."""
        running = self._running
        if running is None:
            return []
        waits = running.server.grant_waits
        return [waits.popleft() for _ in range(len(waits))]

    def counters(self, timeout_s: float = 5.0) -> AgentCounters:
        """Snapshot the serving tables and totals (taken on the agent's loop).

        Raises:
            ConfigError: the agent is not running.
            TimeoutError: the loop did not answer within ``timeout_s``.
        """
        running = self._running
        if running is None or self._closed:
            raise ConfigError("counters of a TransferAgent that is not running")

        async def snapshot() -> AgentCounters:
            ctx, worker = running.server, running.worker
            return AgentCounters(
                num_sessions=len(ctx.sessions),
                num_sessions_total=ctx.num_sessions_total,
                num_sessions_refused=ctx.num_sessions_refused,
                num_serving_reads=sum(len(s.reads) for s in ctx.sessions),
                num_copy_holds=ctx.num_holds,
                num_board_copies=ctx.num_board_copies,
                num_read_tasks=sum(len(s.tasks) for s in ctx.sessions),
                num_pending_reports=len(ctx.reports),
                num_staging_lent=ctx.pool.num_lent,
                num_grants=len(self.grants),
                num_reads_served=ctx.num_reads_served,
                num_bytes_served=ctx.num_bytes_served,
                num_data_bytes_sent=ctx.num_data_bytes_sent,
                num_ucx_requests=worker.num_requests,
                num_ucx_connections=worker.num_connections,
                num_ucx_tasks=worker.num_tasks,
                num_ucx_stray_dropped=worker.num_stray_dropped,
            )

        future = asyncio.run_coroutine_threadsafe(snapshot(), running.loop)
        return future.result(timeout_s)

    # ---------------------------------------------------------------- serving side
    def issue_grant(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_expected_readers: int | None,
        lease_s: float | None = None,
        grant: str | None = None,
        prompt_digest: bytes | None = None,
    ) -> Grant:
        """Hold ``block_ids`` for readers of ``request_id``; see ``GrantTable.issue``.

        Args:
            num_expected_readers: readers that must report; None to let the first
                reader's handshake decide (``topology.num_expected_readers``).
            grant: the grant's string, chosen by the engine and shared by all its
                ranks (readers send one string to every rank); default: the
                table's own random one. It must be unguessable (e.g.
                ``secrets.token_urlsafe(16)``).
            prompt_digest: ``kvbridge.transfer.prompt_digest`` of the prompt whose KV
                the blocks hold; reads naming another prompt are then refused
                (``prompt_mismatch``). None leaves the grant unbound.

        Raises:
            ConfigError: as ``GrantTable.issue`` (e.g. ``grant`` shorter than 16 chars).
            DuplicateGrantError: as ``GrantTable.issue``.
        """
        issued = self.grants.issue(
            request_id, block_ids, num_expected_readers, lease_s, prompt_digest=prompt_digest,
            grant=grant,
        )
        running = self._running
        if running is not None and not self._closed:  # a read may wait for it: wake it now
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                running.loop.call_soon_threadsafe(_on_grant_issued, running)
        return issued

    # ---------------------------------------------------------------- reading side
    def start_read(
        self,
        request_id: str,
        *,
        engine_id: str,
        host: str,
        port: int | Sequence[int],
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        grant: str,
        num_tokens: int,
        first_token: int = 0,
        prompt_digest: bytes | None = None,
    ) -> None:
        """Begin pulling a request's blocks from a remote engine; returns at once,
        or once they are here for a same-host read the server's grant board allows
        (up to ``AgentConfig.inline_copy_max_nbytes``, copied on this thread:
        ``reading/inline.py``). Either way the outcome is collected as below.

        Token ``t`` of the request lives in remote block ``remote_block_ids[t //
        remote_block_size]`` and lands in ``local_block_ids[t // local_block_size]``;
        tokens ``[first_token, first_token + num_tokens)`` are read::

            request tokens   0 ........ first_token ............ end
            local blocks     |hit |hit |new |new |new |           (not written before
            remote blocks    |    r0   |    r1   |    r2   |       first_token; r1 is
                                            ^ read from here       read from its middle)

        The outcome appears later in ``get_finished()[1]`` and, on failure, in
        ``get_failed_block_ids()`` (the local blocks holding the read tokens).

        Args:
            request_id: key of the outcome; unique among reads in flight.
            engine_id: the serving engine.
            host: its host.
            port: its base port (rank ``g`` listens on ``port + g``), or the port of
                each of its global ranks (index = rank). A read that needs a rank
                the list lacks fails (``MissingPortError`` in its stats) and its
                blocks are reported failed.
            remote_block_ids: its blocks for the request, in token order.
            local_block_ids: our blocks, in token order.
            grant: the grant the serving engine issued for the request.
            num_tokens: tokens to load (> 0).
            first_token: first token to load; tokens before it are left alone.
            prompt_digest: ``kvbridge.transfer.prompt_digest`` of this request's
                prompt, sent with every read; a grant bound to another prompt
                refuses the read and its blocks are reported failed.

        Raises:
            ConfigError: bad arguments (nothing started; an empty port list or one
                with a number that is no port among them), or the agent is not running.
        """
        running = self._running
        if running is None or self._closed:
            raise ConfigError("start_read on a TransferAgent that is not running")
        ports = checked_ports(request_id, port)
        block_size = self.topology.block_size
        end_token = first_token + num_tokens
        local_needed = math.ceil(end_token / block_size) if num_tokens > 0 else 0
        if (num_tokens < 1 or first_token < 0 or len(local_block_ids) < local_needed
                or not remote_block_ids
                or (prompt_digest is not None and not 1 <= len(prompt_digest) <= 64)):
            raise ConfigError(
                f"read {request_id!r}: {num_tokens} tokens from token {first_token} need "
                f"{local_needed} local blocks (got {len(local_block_ids)}) and a non-empty "
                f"remote block list (got {len(remote_block_ids)}); a prompt digest has "
                f"1..64 bytes"
            )
        job = ReadJob(
            request_id, engine_id, host, ports, tuple(remote_block_ids),
            tuple(local_block_ids[:local_needed]), grant, num_tokens, time.monotonic(),
            first_token=first_token, prompt_digest=prompt_digest or b"",
        )
        if running.reads.read_inline(job):  # a same-host copy the board allowed: done
            return
        running.loop.call_soon_threadsafe(running.reads.submit, job)

    def notify_done(
        self,
        request_id: str,
        *,
        engine_id: str,
        host: str,
        port: int | Sequence[int],
        grant: str,
        ok: bool = True,
    ) -> None:
        """Tell every serving rank this rank would read from that it will not read.

        For a request whose tokens need no transfer (a full local prefix hit) or
        that was aborted before its read: P counts this rank as a reader that
        reported (``ok=False``: as one that gave up) and frees sooner than the
        lease. Returns at once; failures are only logged (P's lease still ends).
        Nothing is reported in ``get_finished``.

        Args:
            request_id: for logs.
            engine_id: the serving engine.
            host: its host.
            port: its base port, or its ranks' ports (as for ``start_read``).
            grant: the grant it issued for the request.
            ok: True for "not needed", False for "gave up".

        Raises:
            ConfigError: the agent is not running, or a bad port list (as ``start_read``).
        """
        running = self._running
        if running is None or self._closed:
            raise ConfigError("notify_done on a TransferAgent that is not running")
        job = ReadJob(
            request_id, engine_id, host, checked_ports(request_id, port), (), (), grant, 0,
            time.monotonic(), notify_only=True, ok=ok,
        )
        running.loop.call_soon_threadsafe(running.reads.submit, job)

    def cancel_reads(self, request_ids: Collection[str], quiesce_s: float = 2.0
                     ) -> concurrent.futures.Future[set[str]]:
        """Cancel reads in flight; the future says which of them no longer write our blocks.

        For an engine that gives up a load (late at its deadline) and will reuse
        its blocks (recompute into them, or free them): a read given up without
        this could go on writing them. Each cancelled read ends failed
        (``ReadCancelledError`` in its stats), reported once like any failure,
        after it made sure nothing of it writes into its local blocks any more
        (``reading/reads.py``); its server is told it gave up. Any thread; reads
        started before by this thread are among those cancelled.

        Args:
            request_ids: the reads to cancel (ids with no read in flight: nothing
                to do, and nothing of them writes).
            quiesce_s: how long the reads may take to end.

        Returns:
            A future (never failing) resolved within about ``quiesce_s`` with the
            ids sure to write nothing more; the others' reads end later, failed,
            and their blocks must stay theirs until that outcome comes.
        """
        running = self._running
        if running is None or self._closed:
            done: concurrent.futures.Future[set[str]] = concurrent.futures.Future()
            done.set_result(set())  # no loop to ask: promise nothing
            return done
        return asyncio.run_coroutine_threadsafe(
            running.reads.cancel(set(request_ids), quiesce_s), running.loop)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Return and forget ``(done_sending, done_recving)`` request ids.

        ``done_sending``: requests whose grant was released (all readers done,
        lease expired or revoked): their blocks may be freed. ``done_recving``:
        reads that ended, successfully or not (see ``get_failed_block_ids``).
        """
        sending = {release.request_id for release in self.grants.drain_released()}
        running = self._running
        recving = running.reads.outcomes.take_finished() if running is not None else set()
        return sending, recving

    def wait_finished(self, timeout_s: float) -> bool:
        """Block the calling thread until a read has ended, or at most ``timeout_s``.

        For a caller with nothing else to do until KV arrives: it sleeps instead
        of polling ``get_finished`` (polling takes the GIL from the agent's
        thread, which delays the very read being waited for). Returns True when
        ``get_finished()[1]`` has something to return; nothing is consumed.
        """
        running = self._running
        if running is None or self._closed:
            return False
        return running.reads.outcomes.wait_finished(timeout_s)

    def get_failed_block_ids(self) -> dict[str, set[int]]:
        """Return and forget local block ids that could not be loaded, by request."""
        running = self._running
        return running.reads.outcomes.take_failed() if running is not None else {}

    def get_stats(self) -> list[ReadStats]:
        """Return and forget per-read statistics of reads that ended."""
        running = self._running
        return running.reads.outcomes.take_stats() if running is not None else []


def _on_grant_issued(running: _Running) -> None:
    """On the agent's loop: wake reads waiting for a grant, and the expiry."""
    grant_issued(running.server)
    running.grant_issued.set()

