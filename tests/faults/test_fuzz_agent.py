"""Fuzzing a transfer agent's port: 10,000 hostile cases, then it must still serve.

The agent (P) runs in a child process with a cluster secret; a good reader (D)
in another. The fuzzer in this process knows the secret (the strongest peer:
authenticated but hostile) and plays seeded cases from ``fuzz_client.CaseMaker``:
openings that replace the Hello, and sessions of cases the agent must survive
followed by one that must end the session. Afterwards:

* every case got the answer its kind calls for, and no KV byte left the agent
  (no ``DataHeader`` to the fuzzer; the agent's data-byte counter did not move);
* the agent's tables (sessions, reads, done reports, staging, grants, UCX
  requests / connections / tasks) are back to their baseline;
* its RSS grew by less than a generous bound;
* a good reader still gets its blocks byte for byte.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvbridge.transfer.ucx.connection import MAX_CHANNEL
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.faults.fuzz_client import (
    CaseMaker,
    FuzzClient,
    FuzzReport,
    Target,
    counters,
    good_read,
    hosts,
    idle_view,
    wait_idle,
)
from tests.integration.reads import issue
from tests.ports import free_port_base
from tests.transfer.agent_proc import Spec
from tests.waiting import wait_until

pytestmark = pytest.mark.faults

SECRET = b"fuzzing needs a real secret too!"
FAST = {"grant_wait_s": 0.2, "handshake_timeout_s": 3.0, "reply_timeout_s": 3.0,
        "chunk_timeout_s": 3.0, "lease_s": 120.0}
P_SPEC = Spec("p-fuzz", seed=11, secret=SECRET, num_blocks=64, config=FAST)
D_SPEC = Spec("d-fuzz", seed=-1, secret=SECRET, num_blocks=64)
NUM_CASES = 10_000
NUM_OPENINGS = 1_000
CONCURRENCY = 4
RSS_GROWTH_LIMIT = 64 << 20
SEED = int(os.environ.get("KVBRIDGE_FUZZ_SEED", "20240808"))


async def fuzz(target: Target, port: int, seed: int, num_cases: int) -> FuzzReport:
    """Play ``num_cases`` cases: ``NUM_OPENINGS`` openings, the rest in sessions."""
    maker = CaseMaker(seed, target)
    rng = random.Random(seed + 1)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with FuzzClient(target, port) as client:
        jobs: list[Coroutine[Any, Any, None]] = []
        budget = num_cases - NUM_OPENINGS
        while budget > 0:
            num_keeping = min(budget - 1, rng.randint(4, 24))
            first_id = rng.randint(1, 1 << 19)
            ids = list(range(first_id, first_id + num_keeping + 1))
            keeping = [maker.keeping(i) for i in ids[:-1]]
            jobs.append(client.session(keeping, maker.ending(ids[-1]), set(ids)))
            budget -= num_keeping + 1
        jobs += [client.opening(maker.opening()) for _ in range(NUM_OPENINGS)]
        rng.shuffle(jobs)

        async def play(job: Coroutine[Any, Any, None]) -> None:
            async with gate:
                await job

        await asyncio.gather(*(play(job) for job in jobs))
    return client.report


def test_ten_thousand_hostile_cases_leave_the_agent_serving_and_bounded() -> None:
    with hosts(2) as (p_host, d_host):
        server = p_host.add(replace(P_SPEC, port=free_port_base(1)))
        reader = d_host.add(replace(D_SPEC, port=free_port_base(1)))
        good_read(server, reader, [3, 8], [20, 21])  # opens the reader's link
        # grants of other requests the fuzzer knows (and must not be able to read)
        live = tuple((issue([server], f"victim-{i}", blocks, 1), tuple(blocks))
                     for i, blocks in enumerate([[1, 2, 3], [10, 40], [63]]))
        dead = secrets.token_urlsafe(16)
        server.call("issue", "expired", [5, 6], 1, 0.05, dead)
        time.sleep(0.5)
        target = Target(server.spec, live, (dead,))
        baseline = wait_idle(server, counters(server))
        assert baseline.num_grants == len(live)
        rss_before = p_host.rss_nbytes()
        started = time.monotonic()

        report = asyncio.run(fuzz(target, server.port, SEED, NUM_CASES))

        elapsed_s = time.monotonic() - started
        print(f"fuzz seed {SEED}: {report.num_cases} cases over {report.num_connections} "
              f"connections in {elapsed_s:.1f}s; cases {dict(report.cases)}; "
              f"replies {dict(report.replies)}; silent drops {dict(report.silent_drops)}")
        assert report.num_cases == NUM_CASES
        after = wait_idle(server, baseline)
        assert after.num_data_bytes_sent == baseline.num_data_bytes_sent  # no KV left
        assert after.num_reads_served == baseline.num_reads_served
        assert after.num_sessions_total >= baseline.num_sessions_total + report.num_connections
        # bytes sent on data channels were received and dropped, not kept by UCX
        assert after.num_ucx_stray_dropped >= report.cases["unsolicited_data"] > 0
        rss_after = p_host.rss_nbytes()
        print(f"agent RSS {rss_before >> 20} MiB -> {rss_after >> 20} MiB; {idle_view(after)}")
        assert rss_after - rss_before < RSS_GROWTH_LIMIT
        good_read(server, reader, [9, 4, 63], [30, 31, 32])
        stats, num_live = server.call("grant_stats")
        assert num_live == len(live)  # the victims' grants are untouched


def test_junk_tags_from_an_unauthenticated_peer_are_dropped_not_kept() -> None:
    """UCX keeps unmatched tagged messages for ever; the agent must drop them itself."""
    num_junk = 2000
    with hosts(1) as (p_host,):
        server = p_host.add(replace(P_SPEC, port=free_port_base(1)))
        before = counters(server)

        async def flood() -> None:
            worker = UcxWorker()
            conn = await worker.connect("127.0.0.1", server.port, timeout_s=5.0)
            try:  # no handshake: junk on random tags, then one rendezvous-sized message
                rng = random.Random(SEED)
                for _ in range(num_junk):
                    junk = np.frombuffer(rng.randbytes(2048), dtype=np.uint8)
                    await conn.send(junk, rng.randint(1, MAX_CHANNEL), timeout_s=5.0)
                # completes only once the agent receives it (rendezvous)
                await conn.send(np.zeros(4 << 20, np.uint8), 12345, timeout_s=10.0)
            finally:
                conn.abort()
                await worker.close()

        asyncio.run(flood())
        wait_until(lambda: counters(server), 10.0, interval_s=0.1,
                   until=lambda now: now.num_ucx_stray_dropped
                   >= before.num_ucx_stray_dropped + num_junk,
                   message=f"{num_junk} junk messages dropped")
        wait_idle(server, before)
