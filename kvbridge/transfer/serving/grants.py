"""The sending side's table of finished prefills whose blocks are held for readers.

When P finishes a prefill, the connector keeps the request's KV blocks and calls
``GrantTable.issue``; the returned ``Grant.grant``, the secret string that names
the grant, travels to D in ``kv_transfer_params``. P's transfer agent checks
every incoming read against the table, counts readers as they report, and the
table releases the grant exactly once, for one of three reasons:

    done     every expected reader (count from topology) reported done or failed
    expired  the lease ran out first (``expire()``, driven by the agent's timer)
    revoked  the request was aborted on P (``revoke()``)

Each release is queued once; the connector takes it from ``drain_released()`` and
frees the blocks. A read in flight pins its grant (``begin_read``/``end_read``):
a release that happens meanwhile is deferred until the last pinned read ends, so
P never frees blocks that UCX is still sending from.

Renewals are bounded three ways, so that no reader holds P's blocks beyond
what its reads need: ``renew`` is refused (``NoReadInFlightError``, nothing
extended) unless a read of the grant is pinned; it never moves the lease past
``until``, the deadline of the read that asked (the server passes it: P ends
that read by then, ``serving/session.py``); and never past ``max_lease_s``
after the grant was issued, however many reads follow one another. A grant
therefore lives at most ``max_lease_s`` after ``issue``, plus the end of the
reads pinned at that moment. With a grant board attached
(``attach_board``), live grants are also published there for same-host readers,
and taken off when their release is decided, before the blocks can be freed
(``protocol/grant_board.py``).

Lifecycle of one grant::

    issue ──> live ──(all readers reported)──> done    ─┐
               │  ──(now >= expires_at)──────> expired ─┼─(no reads in flight)─> Release
               │  ──(revoke)─────────────────> revoked ─┘      in drain_released()
               └─ renew() while a read is pinned moves expires_at later (never past
                  that read's deadline, nor issue time + max_lease_s)

The number of expected readers may be unknown when the grant is issued (P learns
D's topology only when D's first reader handshakes): ``issue`` with
``num_expected_readers=None`` and the serving agent calls
``set_expected_readers`` on first reader contact. Reports that arrive before the
count is known are kept and counted then.

Times are the table's ``Clock`` (monotonic, local to this process). Tell a peer
how long it has (``expires_at - clock.now()``), never the ``expires_at`` value.

A grant is named by one secret string, the one readers present (``grant`` in
every signature, message and ``kv_transfer_params``): the issuer's (an engine
picks one per request and shares it across its ranks, ``issue(grant=...)``: 16
to 256 characters, unique among live and remembered grants, and unguessable,
e.g. ``secrets.token_urlsafe(16)``), or else the table's own
``secrets.token_urlsafe(16)``: 128 random bits as a 22-character JSON-safe
``str``. Every method looks a grant up by that string. Lookup is a dict lookup,
after a length check (a peer's string of any other length is unknown without
being hashed). That does not leak a grant through timing: ``str`` hashing is
SipHash with a per-process random key, so the bucket a guess lands in tells
nothing about live grants, and string equality runs only after a full 64-bit
hash match, which a wrong guess practically never reaches. Guessing a live
128-bit grant succeeds with probability about 2**-128 per try.

Thread safety: every public method takes one internal lock and does no I/O and
no callbacks under it (``on_release`` runs after it is let go), so the agent's
event loop thread and the connector's thread may both call the table.

Example::

    from kvbridge.transfer.clock import MonotonicClock
    from kvbridge.transfer.serving.grants import GrantTable

    table = GrantTable(MonotonicClock(), default_lease_s=30.0, max_lease_s=120.0)
    grant = table.issue("req-1", block_ids=[4, 9, 2], num_expected_readers=2).grant
    # ... the grant goes to D; on P, for each incoming read:
    table.begin_read(grant, [4, 9])              # raises GrantError subclasses
    ...                                          # pack and send the blocks; a long
    table.renew(grant, 30.0, until=t_end)        # read renews (t_end: its deadline)
    table.end_read(grant)
    table.reader_done(grant, "engine-d:0")
    table.reader_done(grant, "engine-d:1")       # -> True, release queued
    for release in table.drain_released():        # connector frees the blocks
        print(release.request_id, release.block_ids, release.reason)
"""

from __future__ import annotations

import contextlib
import heapq
import math
import operator
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from kvbridge.errors import ConfigError, IntegrityError, KVBridgeError
from kvbridge.transfer.clock import Clock
from kvbridge.transfer.protocol.grant_board import GrantBoard

ReleaseReason = Literal["done", "expired", "revoked"]

GRANT_NBYTES = 16
MAX_DIGEST_NBYTES = 64
GRANT_LEN = len(secrets.token_urlsafe(GRANT_NBYTES))  # 22 characters: the table's own
MIN_GRANT_LEN = 16  # an issuer's grant string (see the module doc)
MAX_GRANT_LEN = 256  # as long as the wire lets a grant name be (``wire.Name``)
_NUM_IDS_IN_MESSAGE = 8


class GrantError(KVBridgeError):
    """A grant operation was refused; the table is unchanged."""


class UnknownGrantError(GrantError):
    """No live grant is named so (never issued, or already released)."""


class ExpiredGrantError(GrantError):
    """The grant's lease ran out."""


class BlockNotGrantedError(GrantError):
    """A read named block ids that the grant does not hold."""


class NoReadInFlightError(GrantError):
    """A renewal of a live grant with no read pinned (``begin_read``): nothing extended.

    A lease is renewed only while a read of the grant is served; a reader that
    is not reading lets the lease run out, as it was issued.
    """


class DuplicateGrantError(GrantError):
    """A live grant already exists for this request id, or is (or was) named so."""


@dataclass(frozen=True, slots=True)
class Grant:
    """A snapshot of one grant. ``renew`` makes a new snapshot; this one never changes."""

    grant: str
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float
    num_expected_readers: int | None  # None: set on first reader contact
    prompt_digest: bytes | None = None  # a read must name the same prompt (None: unbound)


@dataclass(frozen=True, slots=True)
class Release:
    """Blocks the owner may free now, and why."""

    request_id: str
    block_ids: tuple[int, ...]
    reason: ReleaseReason


@dataclass(frozen=True, slots=True)
class GrantStats:
    """Counters since the table was created."""

    num_issued: int
    num_released_done: int
    num_released_expired: int
    num_released_revoked: int
    num_readers_done: int
    num_readers_failed: int


@dataclass(slots=True)
class _Entry:
    snapshot: Grant
    block_set: frozenset[int]
    reader_failed: dict[str, bool] = field(default_factory=dict)  # reader id -> failed?
    num_active_reads: int = 0
    closing: ReleaseReason | None = None  # set once; released when no reads are in flight
    latest_expiry: float = math.inf  # issue time + max_lease_s: no renewal goes past it


def _grant_len_ok(grant: str) -> bool:
    """Whether a grant string may be this long (checked before hashing a peer's)."""
    return MIN_GRANT_LEN <= len(grant) <= MAX_GRANT_LEN


def _short(grant: str) -> str:
    # Grants are secrets and peers send arbitrary strings: log only a short prefix.
    return repr(grant[:6] + "...")


def _check_lease(lease_s: float) -> None:
    if not math.isfinite(lease_s) or lease_s <= 0:
        raise ConfigError(f"lease_s must be finite and > 0, got {lease_s}")


class GrantTable:
    """Grants of held blocks, with leases and reader counting.

    Args:
        clock: time source (monotonic seconds).
        default_lease_s: lease of ``issue`` when none is given.
        max_lease_s: no grant ever expires later than ``max_lease_s`` after its
            ``issue`` (nor does ``issue`` give a longer lease).
        num_tombstones: how many released grants to remember, so that a late
            read of an expired grant gets ``ExpiredGrantError`` and a late done
            report returns ``False`` instead of raising.
        on_release: called (outside the lock, by the thread that caused it)
            after a call queued a release for ``drain_released``.

    Raises:
        ConfigError: a lease is not finite and > 0, ``max_lease_s <
            default_lease_s``, or ``num_tombstones < 0``.
    """

    def __init__(
        self,
        clock: Clock,
        default_lease_s: float,
        max_lease_s: float,
        *,
        num_tombstones: int = 4096,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        _check_lease(default_lease_s)
        _check_lease(max_lease_s)
        if max_lease_s < default_lease_s:
            raise ConfigError(
                f"max_lease_s ({max_lease_s}) < default_lease_s ({default_lease_s})"
            )
        if num_tombstones < 0:
            raise ConfigError(f"num_tombstones must be >= 0, got {num_tombstones}")
        self._clock = clock
        self._default_lease_s = default_lease_s
        self._max_lease_s = max_lease_s
        self._num_tombstones = num_tombstones
        self._on_release = on_release
        self._num_releases = 0
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # grant -> entry
        self._grant_by_request: dict[str, str] = {}
        # (expires_at, grant); stale items (renewed/released) are skipped lazily.
        self._expiry_heap: list[tuple[float, str]] = []
        self._released: list[Release] = []
        self._tombstones: OrderedDict[str, ReleaseReason] = OrderedDict()
        self._num_held_blocks = 0
        self._num_issued = 0
        self._num_released = {"done": 0, "expired": 0, "revoked": 0}
        self._num_readers = {False: 0, True: 0}  # failed? -> count
        self._board: GrantBoard | None = None

    def refresh_board(self) -> int:
        """Take grants off the board whose caches moved since they were put on; how many."""
        with self._lock:
            return self._board.withdraw_moved() if self._board is not None else 0

    def attach_board(self, board: GrantBoard) -> None:
        """Publish grants issued from now on to ``board`` (``grant_board.py``)."""
        with self._lock:
            self._board = board

    # ---------------------------------------------------------------- issuing

    def issue(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_expected_readers: int | None,
        lease_s: float | None = None,
        prompt_digest: bytes | None = None,
        grant: str | None = None,
    ) -> Grant:
        """Hold ``block_ids`` for ``request_id`` under ``grant`` (default: a new random one).

        Args:
            request_id: the request on P; at most one live grant per request.
            block_ids: distinct block ids >= 0 (may be empty).
            num_expected_readers: distinct readers that must report before release;
                None when not known yet (see ``set_expected_readers``).
            lease_s: lease length; ``default_lease_s`` when None, capped at ``max_lease_s``.
            prompt_digest: ``security.prompt_digest`` of the prompt the blocks hold;
                the server refuses reads naming another prompt. None: unbound.
            grant: the string readers will present, chosen by the issuer (an engine
                shares one across its ranks); it must be unguessable. None: the
                table draws one (a 22-character url-safe ``str``).

        Returns:
            The new grant; its ``grant`` string is what every other method takes.

        Raises:
            ConfigError: empty request id, ``num_expected_readers < 1``, a bad lease,
                negative / repeated block ids, or a ``grant`` that is not a ``str``
                of ``MIN_GRANT_LEN`` to ``MAX_GRANT_LEN`` characters.
            TypeError: a block id is not an integer.
            DuplicateGrantError: ``request_id`` already has a live grant, or
                ``grant`` names a live grant or a released one still remembered
                (a late read of that one must not open this one).
        """
        if not request_id:
            raise ConfigError("request_id must be a non-empty string")
        if num_expected_readers is not None and num_expected_readers < 1:
            raise ConfigError(f"num_expected_readers must be >= 1, got {num_expected_readers}")
        if prompt_digest is not None and not 1 <= len(prompt_digest) <= MAX_DIGEST_NBYTES:
            raise ConfigError(
                f"prompt_digest must have 1..{MAX_DIGEST_NBYTES} bytes, got {len(prompt_digest)}"
            )
        if grant is not None and not (isinstance(grant, str) and _grant_len_ok(grant)):
            length = len(grant) if isinstance(grant, str) else type(grant).__name__
            raise ConfigError(f"a grant must have >= {MIN_GRANT_LEN} and <= {MAX_GRANT_LEN} "
                              f"characters, got {length}")
        lease = self._default_lease_s if lease_s is None else lease_s
        _check_lease(lease)
        ids = tuple(operator.index(b) for b in block_ids)
        negative = [b for b in ids if b < 0]
        if negative:
            raise ConfigError(f"block ids must be >= 0, got {negative[:_NUM_IDS_IN_MESSAGE]}")
        block_set = frozenset(ids)
        if len(block_set) != len(ids):
            raise ConfigError(f"{len(ids) - len(block_set)} repeated block ids in {request_id!r}")
        with self._lock:
            if request_id in self._grant_by_request:
                raise DuplicateGrantError(f"request {request_id!r} already has a live grant")
            if grant is None:
                grant = secrets.token_urlsafe(GRANT_NBYTES)
                while grant in self._entries or grant in self._tombstones:  # ~never
                    grant = secrets.token_urlsafe(GRANT_NBYTES)
            elif grant in self._entries or grant in self._tombstones:
                raise DuplicateGrantError(
                    f"grant {_short(grant)} of request {request_id!r} is (or was) another "
                    f"request's"
                )
            now = self._clock.now()
            expires_at = now + min(lease, self._max_lease_s)
            snapshot = Grant(grant, request_id, ids, expires_at, num_expected_readers,
                             prompt_digest)
            self._entries[grant] = _Entry(snapshot, block_set,
                                          latest_expiry=now + self._max_lease_s)
            if self._board is not None:
                self._board.publish(grant, ids, expires_at - self._clock.now(), prompt_digest)
            self._grant_by_request[request_id] = grant
            self._push_expiry(expires_at, grant)
            self._num_held_blocks += len(ids)
            self._num_issued += 1
            return snapshot

    # ---------------------------------------------------------------- reading

    def validate_read(self, grant: str, block_ids: Sequence[int]) -> Grant:
        """Check that a read of ``block_ids`` under ``grant`` is allowed now.

        Does not pin the grant; use ``begin_read`` when the read will follow.

        Returns:
            The grant's current snapshot.

        Raises:
            UnknownGrantError: no live grant is named ``grant`` (or it was released).
            ExpiredGrantError: the lease ran out (even if ``expire()`` has not run).
            BlockNotGrantedError: some ids are not in the grant; the message lists a few.
        """
        with self._lock:
            return self._check_read(grant, block_ids).snapshot

    def begin_read(self, grant: str, block_ids: Sequence[int]) -> Grant:
        """Validate like ``validate_read``, then pin the grant until ``end_read``.

        While pinned, a release (done, expired or revoked) is decided but
        deferred: the blocks stay held until the last pinned read ends.

        Raises:
            The errors of ``validate_read``; the grant is then not pinned.
        """
        with self._lock:
            entry = self._check_read(grant, block_ids)
            entry.num_active_reads += 1
            return entry.snapshot

    def end_read(self, grant: str) -> None:
        """Unpin one ``begin_read``; queue a deferred release if this was the last.

        Raises:
            GrantError: no ``begin_read`` of this grant is outstanding.
        """
        with self._releasing():
            entry = self._entries.get(grant)
            if entry is None or entry.num_active_reads == 0:
                raise GrantError(f"end_read of grant {_short(grant)} without begin_read")
            entry.num_active_reads -= 1
            if entry.closing is not None and entry.num_active_reads == 0:
                self._release(entry, entry.closing)

    def renew(self, grant: str, lease_s: float, *, until: float) -> float:
        """Extend a live grant's lease, for a read of it in flight, to ``now + lease_s``.

        Never shortens the lease; never moves it past ``until`` (the deadline of
        the read that asked, in this table's clock) nor past ``max_lease_s``
        after the grant was issued. A renewal bounded so may extend nothing.

        Returns:
            The grant's ``expires_at`` after the call.

        Raises:
            ConfigError: ``lease_s`` is not finite and > 0.
            UnknownGrantError, ExpiredGrantError: as for ``validate_read``
                (checked first: a grant that is gone says so).
            NoReadInFlightError: no read of the grant is pinned (``begin_read``);
                the lease is unchanged.
        """
        _check_lease(lease_s)
        with self._lock:
            now = self._clock.now()
            entry = self._live_entry(grant, now)
            g = entry.snapshot
            if entry.num_active_reads == 0:
                raise NoReadInFlightError(
                    f"grant of request {g.request_id!r} has no read in flight: its lease is "
                    f"renewed only while a read of it is served (it ends in "
                    f"{g.expires_at - now:.3f}s as issued or last renewed)"
                )
            bound = min(now + min(lease_s, self._max_lease_s), until, entry.latest_expiry)
            expires_at = max(g.expires_at, bound)
            if expires_at != g.expires_at:
                entry.snapshot = replace(g, expires_at=expires_at)
                self._push_expiry(expires_at, grant)
                if self._board is not None:
                    self._board.renew(grant, expires_at - now)
            return expires_at

    def set_expected_readers(self, grant: str, num_expected_readers: int) -> bool:
        """Fix the reader count of a grant issued with ``num_expected_readers=None``.

        The first call wins; later calls (other readers of the same engine
        compute the same count) change nothing. If enough readers already
        reported, the release is decided now.

        Returns:
            True if this call set the count.

        Raises:
            ConfigError: ``num_expected_readers < 1``.
            UnknownGrantError: no grant (live or being released) is named ``grant``.
        """
        if num_expected_readers < 1:
            raise ConfigError(f"num_expected_readers must be >= 1, got {num_expected_readers}")
        with self._releasing():
            entry = self._entries.get(grant) if _grant_len_ok(grant) else None
            if entry is None:
                raise UnknownGrantError(f"no grant {_short(grant)}")
            if entry.snapshot.num_expected_readers is not None:
                return False
            entry.snapshot = replace(entry.snapshot, num_expected_readers=num_expected_readers)
            self._maybe_done(entry)
            return True

    def is_known(self, grant: str) -> bool:
        """Whether ``grant`` names a grant that is live or was released (and remembered)."""
        if not _grant_len_ok(grant):
            return False
        with self._lock:
            return grant in self._entries or grant in self._tombstones

    # ---------------------------------------------------------------- releasing

    def reader_done(self, grant: str, reader_id: str) -> bool:
        """Record that reader ``reader_id`` (e.g. ``"engine-d:1"``) finished.

        Repeated reports from one reader count once. Reports are accepted even
        after the lease ran out (they only bring the release closer).

        Returns:
            True exactly once per grant: on the report that completes the count
            of distinct readers. False otherwise, also for reports about a grant
            that was already released (if still remembered).

        Raises:
            ConfigError: empty ``reader_id``.
            UnknownGrantError: the grant was never issued (or is long forgotten).
        """
        return self._report(grant, reader_id, failed=False)

    def reader_failed(self, grant: str, reader_id: str) -> bool:
        """Like ``reader_done``, for a reader that gave up; counted in ``stats()``."""
        return self._report(grant, reader_id, failed=True)

    def expire(self, now: float | None = None) -> list[Release]:
        """Release every grant whose lease ran out by ``now`` (default: the clock).

        Grants with reads in flight are marked expired and released by their
        last ``end_read``.

        Returns:
            The releases this call queued (they also appear in ``drain_released``).
        """
        with self._releasing():
            now = self._clock.now() if now is None else now
            expired: list[Release] = []
            while self._expiry_heap and self._expiry_heap[0][0] <= now:
                expires_at, grant = heapq.heappop(self._expiry_heap)
                entry = self._entries.get(grant)
                if entry is None or entry.closing is not None:
                    continue
                if entry.snapshot.expires_at != expires_at:
                    continue  # renewed; a later heap item stands for it
                self._close(entry, "expired")
                if entry.num_active_reads == 0:
                    expired.append(self._release(entry, "expired"))
            return expired

    def revoke(self, request_id: str) -> bool:
        """Release the request's grant now (e.g. the request was aborted on P).

        Returns:
            True if this call decided the release; False if the request has no
            live grant or its release was already decided.
        """
        with self._releasing():
            grant = self._grant_by_request.get(request_id)
            if grant is None:
                return False
            entry = self._entries[grant]
            if entry.closing is not None:
                return False
            self._close(entry, "revoked")
            if entry.num_active_reads == 0:
                self._release(entry, "revoked")
            return True

    def drain_released(self) -> list[Release]:
        """Return and forget the queued releases; each release is returned once.

        Ownership of the blocks passes to the caller, which frees them.
        """
        with self._lock:
            released, self._released = self._released, []
            return released

    # ---------------------------------------------------------------- queries

    def next_expiry(self) -> float | None:
        """Earliest ``expires_at`` among grants not yet being released, or None."""
        with self._lock:
            heap = self._expiry_heap
            while heap and self._is_stale(*heap[0]):
                heapq.heappop(heap)
            return heap[0][0] if heap else None

    @property
    def num_held_blocks(self) -> int:
        """Block ids held by unreleased grants (a block in two grants counts twice)."""
        return self._num_held_blocks

    def __len__(self) -> int:
        """Number of grants not yet released."""
        return len(self._entries)

    def stats(self) -> GrantStats:
        """Counters since the table was created."""
        with self._lock:
            return GrantStats(
                num_issued=self._num_issued,
                num_released_done=self._num_released["done"],
                num_released_expired=self._num_released["expired"],
                num_released_revoked=self._num_released["revoked"],
                num_readers_done=self._num_readers[False],
                num_readers_failed=self._num_readers[True],
            )

    def check_integrity(self) -> None:
        """Cross-check every index and counter.

        Raises:
            IntegrityError: with the counts that disagree.
        """
        with self._lock:
            self._check_integrity_locked()

    # ---------------------------------------------------------------- internals

    def _check_integrity_locked(self) -> None:
        entries = self._entries
        by_request = {e.snapshot.request_id: t for t, e in entries.items()}
        if by_request != self._grant_by_request or len(by_request) != len(entries):
            raise IntegrityError(
                f"{len(entries)} grants but {len(self._grant_by_request)} request ids indexed"
            )
        num_blocks = sum(len(e.snapshot.block_ids) for e in entries.values())
        if num_blocks != self._num_held_blocks:
            raise IntegrityError(f"grants hold {num_blocks} blocks, counter says "
                                 f"{self._num_held_blocks}")
        heap_items = set(self._expiry_heap)
        for grant, e in entries.items():
            g = e.snapshot
            if grant != g.grant or len(e.block_set) != len(g.block_ids):
                raise IntegrityError(f"grant {g.request_id!r}: name or block set mismatch")
            if e.num_active_reads < 0 or (e.closing is not None and e.num_active_reads == 0):
                raise IntegrityError(f"grant {g.request_id!r}: {e.num_active_reads} active "
                                     f"reads while closing={e.closing}")
            expected = g.num_expected_readers
            if e.closing is None and expected is not None and len(e.reader_failed) >= expected:
                raise IntegrityError(f"grant {g.request_id!r}: {len(e.reader_failed)} of "
                                     f"{expected} readers reported, not released")
            if g.expires_at > e.latest_expiry:
                raise IntegrityError(f"grant {g.request_id!r} expires at {g.expires_at}, past "
                                     f"its latest {e.latest_expiry}")
            if e.closing is None and (g.expires_at, grant) not in heap_items:
                raise IntegrityError(f"grant {g.request_id!r}: expiry {g.expires_at} not queued")
            if grant in self._tombstones:
                raise IntegrityError(f"grant {g.request_id!r} is both live and released")
        if len(self._tombstones) > self._num_tombstones:
            raise IntegrityError(f"{len(self._tombstones)} tombstones > {self._num_tombstones}")
        num_released = sum(self._num_released.values())
        if self._num_issued != num_released + len(entries):
            raise IntegrityError(f"{self._num_issued} issued != {num_released} released + "
                                 f"{len(entries)} live")

    def _check_read(self, grant: str, block_ids: Sequence[int]) -> _Entry:
        entry = self._live_entry(grant, self._clock.now())
        outside = [b for b in block_ids if b not in entry.block_set]
        if outside:
            raise BlockNotGrantedError(
                f"{len(outside)} of {len(block_ids)} requested block ids are not in the "
                f"grant of request {entry.snapshot.request_id!r}, e.g. "
                f"{outside[:_NUM_IDS_IN_MESSAGE]}"
            )
        return entry

    def _live_entry(self, grant: str, now: float) -> _Entry:
        if not _grant_len_ok(grant):  # before hashing an arbitrary peer string
            raise UnknownGrantError(f"no grant {_short(grant)}")
        entry = self._entries.get(grant)
        if entry is None:
            reason = self._tombstones.get(grant)
            if reason == "expired":
                raise ExpiredGrantError(f"grant {_short(grant)} expired and was released")
            if reason is not None:
                raise UnknownGrantError(f"grant {_short(grant)} was already released ({reason})")
            raise UnknownGrantError(f"no grant {_short(grant)}")
        g = entry.snapshot
        if entry.closing == "expired" or now >= g.expires_at:
            raise ExpiredGrantError(
                f"grant of request {g.request_id!r} expired at {g.expires_at:.3f} (now {now:.3f})"
            )
        if entry.closing is not None:
            raise UnknownGrantError(
                f"grant of request {g.request_id!r} is being released ({entry.closing})"
            )
        return entry

    def _report(self, grant: str, reader_id: str, *, failed: bool) -> bool:
        if not reader_id:
            raise ConfigError("reader_id must be a non-empty string")
        with self._releasing():
            entry = self._entries.get(grant) if _grant_len_ok(grant) else None
            if entry is None:
                if _grant_len_ok(grant) and grant in self._tombstones:
                    return False
                raise UnknownGrantError(f"no grant {_short(grant)}")
            if reader_id not in entry.reader_failed:
                entry.reader_failed[reader_id] = failed
                self._num_readers[failed] += 1
            return self._maybe_done(entry)

    def _maybe_done(self, entry: _Entry) -> bool:
        """Decide the release when every expected reader reported; True if decided now."""
        expected = entry.snapshot.num_expected_readers
        if entry.closing is not None or expected is None or len(entry.reader_failed) < expected:
            return False
        self._close(entry, "done")
        if entry.num_active_reads == 0:
            self._release(entry, "done")
        return True

    @contextlib.contextmanager
    def _releasing(self) -> Iterator[None]:
        """The table's lock; then, outside it, ``on_release`` if a release was queued."""
        with self._lock:
            before = self._num_releases
            yield
            released = self._num_releases != before
        if released and self._on_release is not None:
            self._on_release()

    def _close(self, entry: _Entry, reason: ReleaseReason) -> None:
        """Decide the release; off the board at once (no new read may start)."""
        entry.closing = reason
        if self._board is not None:
            self._board.withdraw(entry.snapshot.grant)

    def _release(self, entry: _Entry, reason: ReleaseReason) -> Release:
        self._num_releases += 1
        g = entry.snapshot
        if self._board is not None:
            self._board.withdraw(g.grant)
        del self._entries[g.grant]
        del self._grant_by_request[g.request_id]
        self._num_held_blocks -= len(g.block_ids)
        self._num_released[reason] += 1
        if self._num_tombstones > 0:
            self._tombstones[g.grant] = reason
            if len(self._tombstones) > self._num_tombstones:
                self._tombstones.popitem(last=False)
        release = Release(g.request_id, g.block_ids, reason)
        self._released.append(release)
        return release

    def _is_stale(self, expires_at: float, grant: str) -> bool:
        entry = self._entries.get(grant)
        return entry is None or entry.closing is not None or entry.snapshot.expires_at != expires_at

    def _push_expiry(self, expires_at: float, grant: str) -> None:
        heap = self._expiry_heap
        heapq.heappush(heap, (expires_at, grant))
        # Renewals and early releases leave stale items behind; rebuild when they dominate.
        if len(heap) > 2 * len(self._entries) + 64:
            heap[:] = [item for item in heap if not self._is_stale(*item)]
            heapq.heapify(heap)
