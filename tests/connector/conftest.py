"""Shared child processes for the connector's multi-process tests (one P side, one D side)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.connector.engine_proc import EngineHost


@pytest.fixture(scope="session")
def hosts() -> Iterator[tuple[EngineHost, EngineHost]]:
    """``(prefill_host, decode_host)``: processes that host any number of engines."""
    p_host, d_host = EngineHost(), EngineHost()
    try:
        yield p_host, d_host
    finally:
        p_host.close()
        d_host.close()
