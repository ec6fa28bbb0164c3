"""A third peer on D's listener cannot complete D's posted receives with its own bytes.

UCX matches a tagged receive on the tag alone, worker-wide: any peer connected
to D's worker (every agent listens) may send any tag. D's receives for a read
from P used tags ``[connection id : 28][channel : 36]`` with ids drawn from
``random`` (which vLLM seeds with 0) and channels counted from 1: an outsider
could predict them and win the race with junk of the right size, and D would
cache the junk as the prompt's KV. Now each connection end's tags carry 64
bits from ``secrets`` (``ucx/connection.py``).

Real processes: P and D agents in child processes (D's ``random`` seeded with 0
as vLLM does), UCX between them (same-host copies off: the bytes go through
tagged messages), and an attacker in this process connected to D's listener,
flooding every tag it can predict with junk of exactly one read's size while
D reads. Every read must end with P's bytes in D's blocks, or fail typed.
"""

from __future__ import annotations

import asyncio
import ctypes
import random
import threading
from dataclasses import replace

import numpy as np
import torch

from kvbridge.transfer.protocol.wire import channel_of
from kvbridge.transfer.ucx.connection import CHANNEL_BITS
from kvbridge.transfer.ucx.ucp_lib import RequestParam, UcpRequest
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.integration.reads import issue, read, wait_read
from tests.ports import free_port_base
from tests.transfer.agent_proc import Spec, host_pair, logical

# One block of 2 layers x K,V x 16 tokens x 1 head x 32 dims x bf16 = 4 KiB: one
# eager UCX message, which an unmatched receive takes from the unexpected queue.
SHAPE = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 32, "num_blocks": 16}
NO_COPY = {"local_copy": False}
P_SPEC = Spec("p-inj", seed=13, config=NO_COPY, **SHAPE)
D_SPEC = Spec("d-inj", seed=-1, config=NO_COPY, seed_random=0, **SHAPE)
CHUNK_NBYTES = 2 * 2 * 16 * 1 * 32 * 2
NUM_READS = 6
NUM_GUESSED_IDS = 16  # the first ids a worker draws after random.seed(0)
_CONTIG = ctypes.byref(RequestParam(op_attr_mask=0))


def predicted_tags() -> list[int]:
    """Every tag of D's first reads that an attacker could predict before the fix."""
    rng = random.Random(0)
    ids = [rng.getrandbits(28) for _ in range(NUM_GUESSED_IDS)]
    return [(conn_id << CHANNEL_BITS) | channel_of(xfer_id, 0)
            for conn_id in ids for xfer_id in range(1, NUM_READS + 2)]


class Attacker:
    """A UCX peer of this process connected to D's listener, flooding ``tags`` with junk."""

    def __init__(self, port: int, tags: list[int]) -> None:
        self._port, self._tags = port, tags
        self._stop = threading.Event()
        self.connected = threading.Event()
        self.num_sent = 0
        self._thread = threading.Thread(target=asyncio.run, args=(self._flood(),), daemon=True)

    def __enter__(self) -> Attacker:
        self._thread.start()
        assert self.connected.wait(15.0), "the attacker could not connect to D's listener"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15.0)

    async def _flood(self) -> None:
        worker = UcxWorker()
        conn = await worker.connect("127.0.0.1", self._port, timeout_s=5.0)
        junk = np.full(CHUNK_NBYTES, 0x7F, dtype=np.uint8)  # bf16 0x7F7F: ~3.4e38
        lib = worker.ucp
        self.connected.set()
        try:
            while not self._stop.is_set():
                sends = []
                for tag in self._tags:
                    value = lib.tag_send_nbx(conn.endpoint_handle, junk.ctypes.data, junk.nbytes,
                                             tag, _CONTIG)
                    request = UcpRequest(lib, value, "junk", None)
                    sends.append(worker.track(request, junk, busy=False))
                await asyncio.wait(sends, timeout=1.0)
                self.num_sent += len(sends)
                await asyncio.sleep(0.001)
        finally:
            conn.abort()
            await worker.close()


def test_a_third_peer_cannot_complete_d_receives_with_its_bytes() -> None:
    with host_pair() as (p_host, d_host):
        server = p_host.add(replace(P_SPEC, port=free_port_base(1)))
        reader = d_host.add(D_SPEC)
        with Attacker(reader.port, predicted_tags()) as attacker:
            outcomes = {}
            for i in range(1, NUM_READS + 1):
                request_id = f"req-{i}"
                token = issue([server], request_id, [i], 1)
                read([reader], [server], request_id, token, [i], [i], 16)
                outcomes[i] = wait_read(reader, request_id)["failed"]
            num_sent = attacker.num_sent
        assert num_sent > 0
        p_caches, d_caches = server.call("caches"), reader.call("caches")
        for block, failed in outcomes.items():
            if failed:  # a failed read is reported (D recomputes): never a wrong token
                continue
            got = logical(d_caches, D_SPEC, [block], 16)
            want = logical(p_caches, P_SPEC, [block], 16)
            assert torch.equal(got, want), f"block {block}: D holds bytes P never sent"
        assert not any(outcomes.values()), outcomes  # nothing the attacker sent even landed
