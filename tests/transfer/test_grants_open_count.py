"""Grants issued before the number of readers is known (fixed on first reader contact)."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError
from kvbridge.transfer.clock import ManualClock
from kvbridge.transfer.serving.grants import GrantTable, UnknownGrantError


def table() -> GrantTable:
    return GrantTable(ManualClock(100.0), default_lease_s=10.0, max_lease_s=60.0)


def test_no_release_until_the_count_is_known() -> None:
    t = table()
    g = t.issue("r", [1, 2], num_expected_readers=None)
    assert g.num_expected_readers is None
    assert not t.reader_done(g.grant, "d:0")
    assert not t.reader_done(g.grant, "d:1")
    assert t.drain_released() == []
    t.check_integrity()
    # reports that came first count as soon as the count is set
    assert t.set_expected_readers(g.grant, 2)
    (release,) = t.drain_released()
    assert (release.request_id, release.reason) == ("r", "done")
    t.check_integrity()


def test_first_count_wins_and_later_reports_complete_it() -> None:
    t = table()
    g = t.issue("r", [1], None)
    assert t.set_expected_readers(g.grant, 3)
    assert not t.set_expected_readers(g.grant, 1)  # ignored: the first reader set it
    assert not t.reader_done(g.grant, "d:0")
    assert not t.reader_failed(g.grant, "d:1")
    assert t.reader_done(g.grant, "d:2")
    assert [r.reason for r in t.drain_released()] == ["done"]
    assert t.stats().num_readers_failed == 1


def test_a_fixed_count_is_never_changed() -> None:
    t = table()
    g = t.issue("r", [1], 2)
    assert not t.set_expected_readers(g.grant, 1)
    assert not t.reader_done(g.grant, "d:0")
    assert t.drain_released() == []


def test_set_count_on_a_pinned_grant_defers_the_release() -> None:
    t = table()
    g = t.issue("r", [4], None)
    t.begin_read(g.grant, [4])
    t.reader_done(g.grant, "d:0")
    t.set_expected_readers(g.grant, 1)
    assert t.drain_released() == []  # a read is still sending from the blocks
    t.end_read(g.grant)
    assert [r.request_id for r in t.drain_released()] == ["r"]
    t.check_integrity()


def test_open_count_grants_still_expire() -> None:
    clock = ManualClock(0.0)
    t = GrantTable(clock, 5.0, 5.0)
    t.issue("r", [1], None)
    clock.advance(5.0)
    assert [r.reason for r in t.expire()] == ["expired"]


def test_bad_counts_and_tokens() -> None:
    t = table()
    g = t.issue("r", [1], None)
    with pytest.raises(ConfigError, match="num_expected_readers must be >= 1, got 0"):
        t.set_expected_readers(g.grant, 0)
    with pytest.raises(UnknownGrantError):
        t.set_expected_readers("x" * len(g.grant), 1)
    with pytest.raises(UnknownGrantError):
        t.set_expected_readers("short", 1)
    assert t.is_known(g.grant) and not t.is_known("short") and not t.is_known("y" * 22)
    t.revoke("r")
    assert t.is_known(g.grant)  # remembered after release
    with pytest.raises(UnknownGrantError):
        t.set_expected_readers(g.grant, 1)
