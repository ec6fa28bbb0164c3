"""P restarts at the same address (same host, ports and engine id) with another shape.

D's link to the old P is dead, but D cannot know yet: UCX reports no peer
failure and the next heartbeat is a minute away (conftest), longer than P takes
to come back. The new P has a different TP size, block size and layout: if D reused
the old link and its handshake metadata, it would plan the read for the old shape
and the read would fail (or land wrong). D must find the link stale on first use,
handshake again and load the new shape: right answer, bytes moved, no failed read.
"""

from __future__ import annotations

import pytest

from tests.faults.conftest import FaultCluster, PConfig

pytestmark = pytest.mark.faults

STALE = "found stale"


@pytest.mark.p_config(None)  # any shape: the test changes it
@pytest.mark.parametrize("graceful", [False, True], ids=["sigkill", "sigterm"])
def test_restart_p_same_address_rehandshakes(cluster: FaultCluster, graceful: bool) -> None:
    cluster.assert_serves(f"before-restart-{graceful}")  # D now holds links to this P
    assert cluster.d is not None
    num_stale = cluster.d.log_tail(1 << 30).count(STALE)
    old = cluster.p_config
    new = PConfig(tp=1 if old.tp == 2 else 2, block_size=48 - old.block_size,
                  layout="HND" if old.layout == "NHD" else "NHD")
    cluster.restart_p(new, graceful=graceful)
    cluster.assert_serves(f"after-restart-{graceful}")
    # the first read met the old link, dropped it and handshook again
    assert cluster.d.log_tail(1 << 30).count(STALE) == num_stale + 1
    cluster.assert_settled()
