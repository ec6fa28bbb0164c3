"""Fixtures for multi-host tests: labs of network namespaces from tests/integration/netns.py.

Requesting any lab fixture first removes labs left by crashed runs, then builds a
fresh lab that is torn down after the test, pass or fail. A machine where namespaces
cannot be made fails these tests with the reason; they are never skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import pytest

from tests.integration.netns import NetnsLab, cleanup_stale

LabFactory = Callable[[Sequence[str]], NetnsLab]


@pytest.fixture(scope="session")
def netns_clean_slate() -> None:
    """Delete namespaces of earlier runs that died without tearing down (once per session)."""
    cleanup_stale()


@pytest.fixture
def netns_lab_factory(netns_clean_slate: None) -> Iterator[LabFactory]:
    """Build labs on demand (``factory(["prefill", "decode"])``); all closed at teardown."""
    with contextlib.ExitStack() as stack:  # closes every lab even if one close fails

        def factory(host_names: Sequence[str]) -> NetnsLab:
            return stack.enter_context(NetnsLab(host_names))

        yield factory


@pytest.fixture
def two_hosts(netns_lab_factory: LabFactory) -> NetnsLab:
    """A lab with hosts ``a`` (10.77.0.1) and ``b`` (10.77.0.2)."""
    return netns_lab_factory(["a", "b"])


@pytest.fixture
def pd_lab(netns_lab_factory: LabFactory) -> NetnsLab:
    """A lab with hosts ``prefill``, ``decode`` and ``proxy`` on one switch."""
    return netns_lab_factory(["prefill", "decode", "proxy"])
