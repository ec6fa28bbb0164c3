"""Dead peers, leases and concurrency: nothing hangs, blocks are released exactly once."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from tests.integration.reads import issue, read, wait_read, wait_released
from tests.ports import free_port_base
from tests.transfer.agent_proc import Host, Spec, logical
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

FAST = {
    "connect_timeout_s": 2.0, "handshake_timeout_s": 2.0, "reply_timeout_s": 2.0,
    "chunk_timeout_s": 2.0, "heartbeat_s": 0.5, "read_timeout_s": 8.0,
}


def test_dead_server_fails_the_read_within_its_deadline() -> None:
    p_host, d_host = Host(), Host()
    try:
        server = p_host.add(Spec("p-dead", seed=5, port=free_port_base(1)))
        reader = d_host.add(Spec("d-dead", seed=-1, port=free_port_base(1), config=FAST))
        # a first read opens and caches the link; then the server's process dies
        token = issue([server], "warm", [1, 2], 1)
        read([reader], [server], "warm", token, [1, 2], [3, 4], 32)
        assert wait_read(reader, "warm")["failed"] == set()
        token = issue([server], "doomed", [5, 6, 7], 1)
        p_host.kill()
        started = time.monotonic()
        read([reader], [server], "doomed", token, [5, 6, 7], [10, 11, 12], 40)
        outcome = wait_read(reader, "doomed", timeout_s=20.0)
        assert outcome["failed"] == {10, 11, 12}
        assert time.monotonic() - started < FAST["read_timeout_s"] + 5.0
        assert not any(s.ok for s in outcome["stats"] if s.request_id == "doomed")
    finally:
        p_host.close()
        d_host.close()


def test_missing_reader_lets_the_lease_expire_once_and_readers_run_concurrently() -> None:
    p_host, d_host = Host(), Host()
    try:
        server = p_host.add(
            Spec("p-lease", seed=6, port=free_port_base(1), config={"lease_s": 1.0})
        )
        readers = [
            d_host.add(Spec(f"d-{i}", seed=-1, port=free_port_base(1))) for i in range(3)
        ]
        # three readers, three requests, all in flight together
        requests = {f"req-{i}": ([4 * i, 4 * i + 1, 4 * i + 2], [40 + i]) for i in range(3)}
        tokens = {rid: issue([server], rid, blocks, 1) for rid, (blocks, _) in requests.items()}
        expecting_two = issue([server], "half-read", [50, 51], 2)
        for i, (rid, (blocks, _)) in enumerate(requests.items()):
            local = [10 * i, 10 * i + 1, 10 * i + 2]
            read([readers[i]], [server], rid, tokens[rid], blocks, local, 40)
        read([readers[0]], [server], "half-read", expecting_two, [50, 51], [60, 61], 32)
        for i, rid in enumerate(requests):
            assert wait_read(readers[i], rid)["failed"] == set()
        # Before fetching any cache: sending a tensor to this process moves its storage
        # (into shared memory), and a read still landing in it would write freed memory.
        assert wait_read(readers[0], "half-read")["failed"] == set()
        for i, rid in enumerate(requests):
            local = [10 * i + j for j in range(3)]
            got = logical(readers[i].call("caches"), readers[i].spec, local, 40)
            want = logical(server.call("caches"), server.spec, requests[rid][0], 40)
            assert torch.equal(got, want)
            wait_released(server, rid)
        # only one of two expected readers reported: the lease, not the readers, frees it
        wait_released(server, "half-read", timeout_s=5.0)
        stats, num_live = server.call("grant_stats")
        assert (stats.num_released_done, stats.num_released_expired, num_live) == (3, 1, 0)
    finally:
        p_host.close()
        d_host.close()


def test_reader_of_expired_lease_reports_failure() -> None:
    p_host, d_host = Host(), Host()
    try:
        server = p_host.add(Spec("p-exp", seed=8, port=free_port_base(1)))
        reader = d_host.add(replace(Spec("d-exp", seed=-1, port=free_port_base(1)), config=FAST))
        token = issue([server], "late", [1], 1)
        server.call("issue", "short", [2], 1, 0.05, "short-lived-token-123")
        time.sleep(0.5)
        read([reader], [server], "late-2", "short-lived-token-123", [2], [3], 16)
        assert wait_read(reader, "late-2")["failed"] == {3}
        read([reader], [server], "late", token, [1], [4], 16)  # the link still works
        assert wait_read(reader, "late")["failed"] == set()
    finally:
        p_host.close()
        d_host.close()


def test_staged_read_cut_while_its_chunk_is_due_fails_instead_of_using_old_bytes() -> None:
    """P dies after its data header, before the chunk: the read must fail.

    The soak's ``wrong`` answers: when the link to a dead P is aborted, the
    abort ends the receives still posted on it with an empty message
    (``UcxWorker.complete_abandoned``). A staged read waiting for its last chunk
    took that for the chunk and unpacked the staging buffer as it was: the
    previous read's bytes, i.e. another request's KV, reported as loaded
    (``ok``, no failed blocks), then cached in D's prefix cache.
    """
    # P delays each chunk after its header; D stages (other block size and layout)
    p_host, d_host = Host(chunk_delay_s=3.0), Host()
    try:
        server = p_host.add(Spec("p-cut", seed=5, port=free_port_base(1)))
        reader = d_host.add(Spec("d-cut", seed=-1, port=free_port_base(1), layout="HND",
                                 block_size=32, config={**FAST, "chunk_timeout_s": 10.0,
                                                        "read_timeout_s": 30.0}))
        # a first read leaves its bytes in the staging buffer the next read takes
        token = issue([server], "first", [1, 2, 3, 4], 1)
        read([reader], [server], "first", token, [1, 2, 3, 4], [3, 4], 64)
        assert wait_read(reader, "first")["failed"] == set()
        token = issue([server], "cut", [5, 6, 7, 8], 1)
        read([reader], [server], "cut", token, [5, 6, 7, 8], [10, 11], 64)
        wait_until(lambda: server.call("counters").num_read_tasks, 10.0,  # being served
                   message="the read to reach the server")
        time.sleep(0.5)  # header answered, chunk receive posted; the chunk is 3 s away
        p_host.kill()
        outcome = wait_read(reader, "cut", timeout_s=20.0)
        assert outcome["failed"] == {10, 11}, outcome
        assert not any(s.ok for s in outcome["stats"]), outcome
        got = logical(reader.call("caches"), reader.spec, [10, 11], 64)
        first = logical(reader.call("caches"), reader.spec, [3, 4], 64)
        assert not torch.equal(got, first), "the cut read unpacked the first read's bytes"
    finally:
        p_host.close()
        d_host.close()
