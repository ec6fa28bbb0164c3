"""Tests for kvbridge.transfer.serving.grants: leases, reader counting, exactly-once release."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.transfer.clock import ManualClock
from kvbridge.transfer.serving.grants import (
    GRANT_LEN,
    BlockNotGrantedError,
    DuplicateGrantError,
    ExpiredGrantError,
    GrantError,
    GrantTable,
    NoReadInFlightError,
    Release,
    UnknownGrantError,
)

DEFAULT_LEASE_S = 10.0
MAX_LEASE_S = 60.0


def make_table(start: float = 1000.0, **kwargs: int) -> tuple[GrantTable, ManualClock]:
    clock = ManualClock(start)
    return GrantTable(clock, DEFAULT_LEASE_S, MAX_LEASE_S, **kwargs), clock


# ------------------------------------------------------------------- issuing


def test_issue_returns_unguessable_json_safe_token_and_lease() -> None:
    table, clock = make_table()
    grants = [table.issue(f"r{i}", [i, i + 10], num_expected_readers=1) for i in range(50)]
    tokens = {g.grant for g in grants}
    assert len(tokens) == 50
    for g in grants:
        assert isinstance(g.grant, str) and len(g.grant) == GRANT_LEN
        assert g.grant.replace("-", "").replace("_", "").isalnum()
        assert g.expires_at == clock.now() + DEFAULT_LEASE_S
    assert grants[3].block_ids == (3, 13)
    assert len(table) == 50 and table.num_held_blocks == 100
    table.check_integrity()


def test_issue_lease_is_capped_at_max() -> None:
    table, clock = make_table()
    assert table.issue("a", [1], 1, lease_s=5.0).expires_at == clock.now() + 5.0
    assert table.issue("b", [1], 1, lease_s=1e6).expires_at == clock.now() + MAX_LEASE_S


@pytest.mark.parametrize(
    ("request_id", "block_ids", "num_readers", "lease_s", "match"),
    [
        ("", [1], 1, None, "request_id"),
        ("r", [1], 0, None, "num_expected_readers must be >= 1, got 0"),
        ("r", [1, -3], 1, None, r"\[-3\]"),
        ("r", [1, 2, 1], 1, None, "1 repeated"),
        ("r", [1], 1, 0.0, "lease_s"),
        ("r", [1], 1, float("nan"), "lease_s"),
    ],
)
def test_issue_rejects_bad_input_and_leaves_table_unchanged(
    request_id: str, block_ids: list[int], num_readers: int, lease_s: float | None, match: str
) -> None:
    table, _ = make_table()
    with pytest.raises(ConfigError, match=match):
        table.issue(request_id, block_ids, num_readers, lease_s)
    assert len(table) == 0 and table.num_held_blocks == 0
    table.check_integrity()


def test_issue_rejects_non_integer_block_ids() -> None:
    table, _ = make_table()
    with pytest.raises(TypeError):
        table.issue("r", [1.5], 1)  # type: ignore[list-item]
    assert len(table) == 0


def test_duplicate_request_id_raises_until_released() -> None:
    table, _ = make_table()
    g = table.issue("r", [1], 1)
    with pytest.raises(DuplicateGrantError, match="'r'"):
        table.issue("r", [2], 1)
    assert table.num_held_blocks == 1
    table.reader_done(g.grant, "d:0")
    again = table.issue("r", [2], 1)  # a released request id may be granted again
    assert again.grant != g.grant


def test_constructor_validates_leases() -> None:
    clock = ManualClock()
    with pytest.raises(ConfigError, match="max_lease_s"):
        GrantTable(clock, default_lease_s=10.0, max_lease_s=5.0)
    with pytest.raises(ConfigError):
        GrantTable(clock, default_lease_s=-1.0, max_lease_s=5.0)


def test_errors_are_kvbridge_errors() -> None:
    for cls in (UnknownGrantError, ExpiredGrantError, BlockNotGrantedError, DuplicateGrantError,
                NoReadInFlightError):
        assert issubclass(cls, GrantError) and issubclass(cls, KVBridgeError)


# ------------------------------------------------------------------- the issuer's token

ENGINE_TOKEN = "engine-chosen-" + "k" * 24  # any unguessable string of 16..256 characters


def test_the_issuer_may_choose_the_token_and_every_lookup_takes_it() -> None:
    table, clock = make_table()
    g = table.issue("r", [1, 2], 1, grant=ENGINE_TOKEN)
    assert g.grant == ENGINE_TOKEN and table.is_known(ENGINE_TOKEN)
    assert table.validate_read(ENGINE_TOKEN, [2]) == g
    table.begin_read(ENGINE_TOKEN, [1])
    assert table.renew(ENGINE_TOKEN, 20.0, until=math.inf) == clock.now() + 20.0
    table.end_read(ENGINE_TOKEN)
    assert table.set_expected_readers(ENGINE_TOKEN, 3) is False  # fixed at issue
    assert table.reader_done(ENGINE_TOKEN, "d:0") is True
    assert table.drain_released() == [Release("r", (1, 2), "done")]
    assert table.is_known(ENGINE_TOKEN)  # remembered, as a table token is
    table.check_integrity()


@pytest.mark.parametrize(("token", "match"), [
    ("k" * 15, ">= 16 and <= 256 characters, got 15"),
    ("k" * 257, ">= 16 and <= 256 characters, got 257"),
])
def test_a_chosen_token_of_a_bad_length_is_refused(token: str, match: str) -> None:
    table, _ = make_table()
    with pytest.raises(ConfigError, match=match):
        table.issue("r", [1], 1, grant=token)
    assert len(table) == 0
    table.check_integrity()


def test_a_chosen_token_is_unique_among_live_and_remembered_grants() -> None:
    table, _ = make_table()
    first = table.issue("a", [1], 1, grant=ENGINE_TOKEN)
    with pytest.raises(DuplicateGrantError, match="another request's"):
        table.issue("b", [2], 1, grant=ENGINE_TOKEN)
    table.reader_done(first.grant, "d:0")
    # released but remembered: a late read of the old grant must not open a new one
    with pytest.raises(DuplicateGrantError, match="another request's"):
        table.issue("b", [2], 1, grant=ENGINE_TOKEN)
    assert len(table) == 0
    table.check_integrity()


# ------------------------------------------------------------------- leases


def test_expiry_releases_once() -> None:
    table, clock = make_table()
    g = table.issue("r", [7, 8], num_expected_readers=2)
    other = table.issue("s", [9], num_expected_readers=1, lease_s=30.0)
    assert table.next_expiry() == g.expires_at
    clock.advance(DEFAULT_LEASE_S - 0.001)
    assert table.expire() == []
    clock.advance(0.001)
    expected = [Release("r", (7, 8), "expired")]
    assert table.expire() == expected
    assert table.expire() == []
    assert table.drain_released() == expected
    assert table.drain_released() == []
    assert table.num_held_blocks == 1 and len(table) == 1
    assert table.next_expiry() == other.expires_at
    table.check_integrity()


def test_validate_read_refuses_expired_grant_before_and_after_sweep() -> None:
    table, clock = make_table()
    g = table.issue("r", [1], 1)
    clock.advance(DEFAULT_LEASE_S)
    with pytest.raises(ExpiredGrantError, match="'r'"):
        table.validate_read(g.grant, [1])
    table.expire()
    with pytest.raises(ExpiredGrantError):
        table.validate_read(g.grant, [1])
    with pytest.raises(ExpiredGrantError):
        table.renew(g.grant, 5.0, until=math.inf)


def test_renew_extends_while_a_read_is_pinned_and_is_capped() -> None:
    table, clock = make_table()
    g = table.issue("r", [1], 1)
    table.begin_read(g.grant, [1])
    clock.advance(8.0)
    new_expiry = table.renew(g.grant, 10.0, until=math.inf)
    assert new_expiry == clock.now() + 10.0 > g.expires_at
    assert table.validate_read(g.grant, [1]).expires_at == new_expiry
    clock.advance(5.0)  # past the original expiry
    assert table.expire() == []  # no next_expiry() call in between: expire() alone skips it
    table.validate_read(g.grant, [1])
    assert table.next_expiry() == new_expiry
    # never past max_lease_s after the grant was issued, however late the renewal
    latest = g.expires_at - DEFAULT_LEASE_S + MAX_LEASE_S
    assert table.renew(g.grant, 1e9, until=math.inf) == latest
    # A shorter renewal never shortens the lease another reader relies on.
    assert table.renew(g.grant, 1.0, until=math.inf) == latest
    clock.advance(latest - clock.now())
    assert table.expire() == []  # expired, but released by the read's end_read
    table.end_read(g.grant)
    assert table.drain_released() == [Release("r", (1,), "expired")]
    table.check_integrity()


def test_a_renewal_without_a_read_in_flight_is_refused_and_extends_nothing() -> None:
    """Finding 4 of issue #29: a lease could be renewed with no read in flight, so a
    reader that read nothing kept P's blocks held as long as it kept asking."""
    table, clock = make_table()
    g = table.issue("r", [1, 2], 1)
    with pytest.raises(NoReadInFlightError, match="no read in flight"):
        table.renew(g.grant, 50.0, until=math.inf)
    table.begin_read(g.grant, [1])
    table.end_read(g.grant)  # a read that ended is not one in flight
    clock.advance(DEFAULT_LEASE_S - 1.0)
    with pytest.raises(NoReadInFlightError):
        table.renew(g.grant, 50.0, until=math.inf)
    assert table.validate_read(g.grant, [1]).expires_at == g.expires_at
    assert table.next_expiry() == g.expires_at
    clock.advance(1.0)  # the lease as issued
    assert table.expire() == [Release("r", (1, 2), "expired")]
    table.check_integrity()


def test_a_renewal_never_moves_the_lease_past_its_reads_deadline() -> None:
    table, clock = make_table()
    g = table.issue("r", [1], 1)
    table.begin_read(g.grant, [1])
    deadline = clock.now() + 15.0  # what the server gives the read
    assert table.renew(g.grant, 40.0, until=deadline) == deadline
    clock.advance(10.0)
    assert table.renew(g.grant, 40.0, until=deadline) == deadline
    # a deadline before the lease's end extends nothing (and never shortens it)
    assert table.renew(g.grant, 40.0, until=clock.now() + 1.0) == deadline
    table.end_read(g.grant)
    table.check_integrity()


def test_reads_one_after_another_keep_a_grant_at_most_max_lease_s() -> None:
    """Renewal after renewal, each for a read in flight: the lease still ends
    ``max_lease_s`` after the grant was issued."""
    table, clock = make_table()
    g = table.issue("r", [1], 1)
    issued_at = clock.now()
    while clock.now() < issued_at + 2 * MAX_LEASE_S:
        try:
            table.begin_read(g.grant, [1])
        except ExpiredGrantError:
            break
        table.renew(g.grant, DEFAULT_LEASE_S, until=clock.now() + DEFAULT_LEASE_S)
        clock.advance(DEFAULT_LEASE_S / 2)
        table.end_read(g.grant)
    assert clock.now() >= issued_at + MAX_LEASE_S
    assert table.expire() == [Release("r", (1,), "expired")]


def test_renew_after_expiry_or_of_unknown_token_fails() -> None:
    table, clock = make_table()
    g = table.issue("r", [1], 1)
    table.begin_read(g.grant, [1])
    clock.advance(DEFAULT_LEASE_S + 1)
    with pytest.raises(ExpiredGrantError):
        table.renew(g.grant, 5.0, until=math.inf)
    with pytest.raises(UnknownGrantError):
        table.renew("x" * GRANT_LEN, 5.0, until=math.inf)
    with pytest.raises(ConfigError):
        table.renew(g.grant, -1.0, until=math.inf)


def test_many_renewals_keep_expiry_heap_bounded() -> None:
    table, clock = make_table()
    g = table.issue("r", [1], 1)
    table.begin_read(g.grant, [1])
    for _ in range(1000):
        clock.advance(0.01)
        table.renew(g.grant, DEFAULT_LEASE_S, until=math.inf)
    assert len(table._expiry_heap) <= 2 * len(table) + 65
    table.check_integrity()


# ------------------------------------------------------------------- readers


def test_distinct_readers_release_once_and_duplicates_count_once() -> None:
    table, clock = make_table()
    g = table.issue("r", [1, 2, 3], num_expected_readers=3)
    assert table.reader_done(g.grant, "d:0") is False
    assert table.reader_done(g.grant, "d:0") is False  # duplicate report
    assert table.reader_failed(g.grant, "d:1") is False
    assert len(table) == 1 and table.drain_released() == []
    assert table.reader_done(g.grant, "d:2") is True
    assert table.drain_released() == [Release("r", (1, 2, 3), "done")]
    # Late reports, later expiry and revoke do not release again.
    assert table.reader_done(g.grant, "d:2") is False
    assert table.reader_done(g.grant, "d:3") is False
    clock.advance(MAX_LEASE_S * 2)
    assert table.expire() == []
    assert table.revoke("r") is False
    assert table.drain_released() == []
    stats = table.stats()
    assert (stats.num_readers_done, stats.num_readers_failed) == (2, 1)
    assert (stats.num_issued, stats.num_released_done, stats.num_released_expired) == (1, 1, 0)
    with pytest.raises(UnknownGrantError, match="released"):
        table.validate_read(g.grant, [1])
    table.check_integrity()


def test_reader_done_after_expiry_but_before_sweep_releases_as_done() -> None:
    table, clock = make_table()
    g = table.issue("r", [5], num_expected_readers=1)
    clock.advance(DEFAULT_LEASE_S + 1)
    assert table.reader_done(g.grant, "d:0") is True
    assert table.expire() == []
    assert table.drain_released() == [Release("r", (5,), "done")]


def test_reader_reports_validate_input() -> None:
    table, _ = make_table()
    g = table.issue("r", [5], num_expected_readers=1)
    with pytest.raises(ConfigError):
        table.reader_done(g.grant, "")
    with pytest.raises(UnknownGrantError):
        table.reader_done("never-issued-token-xyz", "d:0")
    assert len(table) == 1


def test_forgotten_tokens_become_unknown() -> None:
    table, _ = make_table(num_tombstones=1)
    first = table.issue("a", [1], 1)
    table.reader_done(first.grant, "d:0")
    second = table.issue("b", [2], 1)
    table.reader_done(second.grant, "d:0")
    assert table.reader_done(second.grant, "d:0") is False  # still remembered
    with pytest.raises(UnknownGrantError):
        table.reader_done(first.grant, "d:0")


# ------------------------------------------------------------------- revoke


def test_revoke_releases_at_once() -> None:
    table, clock = make_table()
    g = table.issue("r", [4, 5], num_expected_readers=2)
    table.reader_done(g.grant, "d:0")
    assert table.revoke("r") is True
    assert table.revoke("r") is False
    assert table.revoke("never") is False
    assert table.drain_released() == [Release("r", (4, 5), "revoked")]
    assert table.reader_done(g.grant, "d:1") is False
    clock.advance(MAX_LEASE_S * 2)
    assert table.expire() == [] and table.drain_released() == []
    assert table.next_expiry() is None
    with pytest.raises(UnknownGrantError, match="revoked"):
        table.validate_read(g.grant, [4])


# ------------------------------------------------------------------- reads


def test_validate_read_errors() -> None:
    table, _ = make_table()
    g = table.issue("r", [10, 11, 12], 1)
    other = table.issue("s", list(range(100, 120)), 1)
    assert table.validate_read(g.grant, [12, 10]) == g
    assert table.validate_read(g.grant, []) == g
    with pytest.raises(UnknownGrantError):
        table.validate_read("A" * GRANT_LEN, [10])
    with pytest.raises(UnknownGrantError):
        table.validate_read("short", [10])
    with pytest.raises(UnknownGrantError):
        table.validate_read("A" * 10_000, [10])
    # The other request's token does not open this request's blocks.
    with pytest.raises(BlockNotGrantedError, match=r"3 of 3 .*'s'.*\[10, 11, 12\]"):
        table.validate_read(other.grant, [10, 11, 12])
    with pytest.raises(BlockNotGrantedError, match=r"1 of 3 .*\[13\]"):
        table.validate_read(g.grant, [10, 13, 11])
    with pytest.raises(BlockNotGrantedError) as info:
        table.validate_read(g.grant, list(range(1000)))
    assert "997 of 1000" in str(info.value) and len(str(info.value)) < 300
    table.check_integrity()


def test_error_messages_do_not_contain_whole_tokens() -> None:
    table, clock = make_table()
    g = table.issue("r", [1], 1)
    clock.advance(DEFAULT_LEASE_S)
    table.expire()
    with pytest.raises(ExpiredGrantError) as info:
        table.validate_read(g.grant, [1])
    assert g.grant not in str(info.value)


def test_pinned_read_defers_expiry_release() -> None:
    table, clock = make_table()
    g = table.issue("r", [1, 2], num_expected_readers=1)
    table.begin_read(g.grant, [1, 2])
    clock.advance(DEFAULT_LEASE_S)
    assert table.expire() == []
    assert table.drain_released() == [] and table.num_held_blocks == 2
    assert table.next_expiry() is None
    with pytest.raises(ExpiredGrantError):
        table.begin_read(g.grant, [1])  # no new reads of an expiring grant
    table.check_integrity()
    table.end_read(g.grant)
    assert table.drain_released() == [Release("r", (1, 2), "expired")]
    assert table.num_held_blocks == 0
    with pytest.raises(GrantError, match="without begin_read"):
        table.end_read(g.grant)
    table.check_integrity()


def test_pinned_read_defers_done_and_revoke() -> None:
    table, clock = make_table()
    g = table.issue("r", [1], num_expected_readers=1)
    table.begin_read(g.grant, [1])
    table.begin_read(g.grant, [1])
    assert table.reader_done(g.grant, "d:0") is True
    assert table.revoke("r") is False  # release already decided
    table.end_read(g.grant)
    assert table.drain_released() == []
    table.end_read(g.grant)
    assert table.drain_released() == [Release("r", (1,), "done")]

    # A lease running out while a decided release waits for reads keeps its reason.
    f = table.issue("f", [3], num_expected_readers=1)
    table.begin_read(f.grant, [3])
    assert table.reader_done(f.grant, "d:0") is True
    clock.advance(MAX_LEASE_S + 1)
    assert table.expire() == []
    table.end_read(f.grant)
    assert table.drain_released() == [Release("f", (3,), "done")]

    h = table.issue("s", [2], num_expected_readers=1)
    assert table.next_expiry() == h.expires_at
    table.begin_read(h.grant, [2])
    with pytest.raises(BlockNotGrantedError):
        table.begin_read(h.grant, [3])  # a refused read is not pinned
    assert table.revoke("s") is True
    assert table.reader_done(h.grant, "d:0") is False
    table.end_read(h.grant)
    assert table.drain_released() == [Release("s", (2,), "revoked")]
    table.check_integrity()


def test_end_read_without_begin_read_raises() -> None:
    table, _ = make_table()
    g = table.issue("r", [1], 1)
    with pytest.raises(GrantError):
        table.end_read(g.grant)
    table.check_integrity()


def test_shared_blocks_are_counted_per_grant() -> None:
    table, _ = make_table()
    a = table.issue("a", [1, 2, 3], 1)
    table.issue("b", [1, 2, 9], 1)  # prefix-cache blocks shared by two requests
    assert table.num_held_blocks == 6
    table.reader_done(a.grant, "d:0")
    assert table.num_held_blocks == 3
    table.check_integrity()


# ------------------------------------------------------------------- properties

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("issue"), st.lists(st.integers(0, 30), max_size=6, unique=True),
                  st.integers(1, 3), st.sampled_from([None, 1.0, 5.0, 100.0])),
        st.tuples(st.just("advance"), st.floats(0.0, 15.0)),
        st.tuples(st.just("expire")),
        st.tuples(st.sampled_from(["done", "failed"]), st.integers(0, 20), st.integers(0, 3)),
        st.tuples(st.just("renew"), st.integers(0, 20), st.floats(0.5, 200.0),
                  st.floats(0.0, 100.0)),
        st.tuples(st.just("revoke"), st.integers(0, 20)),
        st.tuples(st.just("begin"), st.integers(0, 20)),
        st.tuples(st.just("end"), st.integers(0, 20)),
    ),
    max_size=60,
)


@dataclass
class _Model:
    request_id: str
    grant: str
    block_ids: tuple[int, ...]
    expires_at: float
    num_expected_readers: int
    issued_at: float = 0.0
    readers: set[str] = field(default_factory=set)
    num_pins: int = 0
    revoked: bool = False


def _check_release(release: Release, m: _Model, now: float) -> None:
    assert release.block_ids == m.block_ids
    if release.reason == "expired":
        assert now >= m.expires_at
    elif release.reason == "done":
        assert len(m.readers) >= m.num_expected_readers
    else:
        assert m.revoked


@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
def test_random_operations_release_every_grant_exactly_once(ops: list[tuple[Any, ...]]) -> None:
    table, clock = make_table()
    models: list[_Model] = []
    by_request: dict[str, _Model] = {}
    released: dict[str, Release] = {}

    def drain() -> None:
        for release in table.drain_released():
            assert release.request_id not in released, "released twice"
            released[release.request_id] = release
            _check_release(release, by_request[release.request_id], clock.now())

    for kind, *args in ops:
        picks = models and kind not in ("issue", "advance", "expire")
        m = models[args[0] % len(models)] if picks else None
        try:
            if kind == "issue":
                block_ids, num_readers, lease_s = args
                rid = f"req{len(models)}"
                g = table.issue(rid, block_ids, num_readers, lease_s)
                models.append(_Model(rid, g.grant, g.block_ids, g.expires_at, num_readers,
                                     clock.now()))
                by_request[rid] = models[-1]
            elif kind == "advance":
                clock.advance(args[0])
            elif kind == "expire":
                table.expire()
            elif kind in ("done", "failed") and m is not None:
                report = table.reader_done if kind == "done" else table.reader_failed
                if m.request_id not in released:
                    m.readers.add(f"d:{args[1]}")
                report(m.grant, f"d:{args[1]}")
            elif kind == "renew" and m is not None:
                before, until = m.expires_at, clock.now() + args[2]
                try:
                    m.expires_at = table.renew(m.grant, args[1], until=until)
                except NoReadInFlightError:
                    assert m.num_pins == 0
                    raise
                assert m.num_pins > 0
                assert m.expires_at == before or m.expires_at <= min(
                    until, clock.now() + args[1], m.issued_at + MAX_LEASE_S)
            elif kind == "revoke" and m is not None:
                m.revoked = table.revoke(m.request_id) or m.revoked
            elif kind == "begin" and m is not None:
                table.begin_read(m.grant, m.block_ids[:2])
                m.num_pins += 1
            elif kind == "end" and m is not None and m.num_pins > 0:
                table.end_read(m.grant)
                m.num_pins -= 1
        except GrantError:
            pass  # refused operations must leave the table consistent
        table.check_integrity()
        drain()
        live = [m for m in models if m.request_id not in released]
        assert table.num_held_blocks == sum(len(m.block_ids) for m in live)
        assert len(table) == len(live)
        if kind == "expire":  # nothing unpinned and past its lease survives a sweep
            assert not [m for m in live if m.num_pins == 0 and clock.now() >= m.expires_at]

    # Finish every read in flight and let every lease run out.
    for m in models:
        for _ in range(m.num_pins):
            table.end_read(m.grant)
    clock.advance(MAX_LEASE_S + 1)
    table.expire()
    drain()
    assert sorted(released) == sorted(by_request)
    assert len(table) == 0 and table.num_held_blocks == 0 and table.next_expiry() is None
    stats = table.stats()
    num_released = stats.num_released_done + stats.num_released_expired
    assert num_released + stats.num_released_revoked == stats.num_issued == len(models)
    table.check_integrity()


def test_on_release_runs_after_every_call_that_queued_a_release() -> None:
    """Once per releasing call, never for a call that released nothing, and outside
    the lock (the callback may use the table)."""
    seen: list[int] = []
    clock = ManualClock(1000.0)
    table = GrantTable(clock, DEFAULT_LEASE_S, MAX_LEASE_S,
                       on_release=lambda: seen.append(len(table.drain_released())))
    done = table.issue("done", [1], num_expected_readers=2)
    table.reader_done(done.grant, "d:0")
    assert seen == []
    table.reader_done(done.grant, "d:1")
    assert seen == [1]
    pinned = table.issue("pinned", [2], num_expected_readers=1)
    table.begin_read(pinned.grant, [2])
    table.reader_done(pinned.grant, "d:0")  # decided, deferred: the read is in flight
    assert seen == [1]
    table.end_read(pinned.grant)
    assert seen == [1, 1]
    late = table.issue("late", [3], num_expected_readers=None)
    table.reader_done(late.grant, "d:0")
    table.set_expected_readers(late.grant, 1)
    assert seen == [1, 1, 1]
    table.issue("expiring", [4], num_expected_readers=1)
    table.issue("revoked", [5], num_expected_readers=1)
    table.expire()
    assert seen == [1, 1, 1]
    assert table.revoke("revoked") is True
    assert seen == [1, 1, 1, 1]
    clock.advance(DEFAULT_LEASE_S)
    table.expire()
    assert seen == [1, 1, 1, 1, 1]
    assert table.revoke("revoked") is False and table.expire() == []
    assert seen == [1, 1, 1, 1, 1]
    table.check_integrity()
