"""A grant is bound to the prompt tokens and blocks it holds (``connector/binding.py``).

The digest itself; how both scheduler halves put it into the workers' metadata;
and two real ``ConnectorWorker``s (each with its own transfer agent, on
loopback): a read whose digest differs from the grant's is refused and its
blocks are reported invalid, a read with the same digest lands the KV.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.connector.binding import KV_DIGEST_NBYTES, kv_digest
from kvbridge.connector.metadata import ConnectorMetadata, RecvRequest, SendRequest
from kvbridge.connector.params import KVTransferParams
from kvbridge.connector.worker import ConnectorWorker
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.agent import AgentConfig
from kvbridge.transfer.protocol.security import CompatInfo
from tests.connector.helpers import (
    TOKENS,
    admit,
    manager,
    remote,
    request,
    scheduler,
    wait_finished,
)

# ---------------------------------------------------------------- the digest

ids = st.lists(st.integers(0, 2**63 - 1), max_size=40)


@settings(max_examples=200, deadline=None)
@given(tokens=ids, blocks=ids, other_tokens=ids, other_blocks=ids)
def test_digest_names_exactly_these_tokens_in_these_blocks(
    tokens: list[int], blocks: list[int], other_tokens: list[int], other_blocks: list[int]
) -> None:
    digest = kv_digest(tokens, blocks)
    assert len(digest) == KV_DIGEST_NBYTES
    assert kv_digest(tuple(tokens), tuple(blocks)) == digest  # any sequence, same bytes
    same = (other_tokens, other_blocks) == (tokens, blocks)
    assert (kv_digest(other_tokens, other_blocks) == digest) == same
    # nothing moves between the two lists (a token cannot pose as a block id)
    if blocks:
        assert kv_digest([*tokens, blocks[0]], blocks[1:]) != digest


def test_block_order_matters() -> None:
    assert kv_digest(TOKENS, [3, 4, 5]) != kv_digest(TOKENS, [5, 4, 3])
    assert kv_digest(TOKENS, [3, 4, 5]) != kv_digest(TOKENS, [3, 3, 5])


@pytest.mark.parametrize(("tokens", "blocks"), [([1, 2**64], [1]), ([1], [-1]), ([1], [2**63])])
def test_ids_outside_int64_raise(tokens: list[int], blocks: list[int]) -> None:
    with pytest.raises(ValueError, match="int64|>= 0"):
        kv_digest(tokens, blocks)


# ---------------------------------------------------------------- the scheduler halves


def held_by_p(tokens: list[int]) -> tuple[SendRequest, KVTransferParams]:
    """P finishes a prefill of ``tokens``; returns its send entry and the params for D."""
    conn, mgr = scheduler(), manager()
    req = request("p-req", tokens, KVTransferParams(do_remote_decode=True))
    mgr.allocate_slots(req, len(tokens))
    delay, params = conn.request_finished(req, mgr.get_block_ids("p-req")[0])
    assert delay and params is not None
    (send,) = conn.build_connector_meta().reqs_to_send
    return send, params


def read_by_d(tokens: list[int], params: KVTransferParams) -> RecvRequest:
    """D admits a request of ``tokens`` with ``params``; returns its recv entry."""
    conn, mgr = scheduler(), manager()
    assert admit(conn, mgr, request("d-req", tokens, params))[1] > 0
    (recv,) = conn.build_connector_meta().reqs_to_recv
    return recv


def test_p_binds_its_grant_to_the_prompt_and_blocks_it_holds() -> None:
    tokens = TOKENS[:40]
    send, params = held_by_p(tokens)
    assert send.kv_digest == kv_digest(tokens, send.block_ids)
    assert params.remote_num_tokens == len(tokens) and params.remote_block_ids == send.block_ids


def test_d_sends_the_digest_of_its_own_prompt() -> None:
    tokens = TOKENS[:40]
    send, params = held_by_p(tokens)
    # the same prompt on D: the digests agree although D loads only 39 tokens
    recv = read_by_d(tokens, params)
    assert recv.num_tokens == len(tokens) - 1
    assert recv.kv_digest == send.kv_digest
    # another prompt of the same length, or P's blocks in another order: they differ
    # (params without P's digest: D reads and P's agent refuses the read)
    other = [t + 1 for t in tokens]
    bare = msgspec.structs.replace(params, kv_digest=None)
    assert read_by_d(other, bare).kv_digest == kv_digest(other, send.block_ids)
    assert read_by_d(other, bare).kv_digest != send.kv_digest
    shuffled = KVTransferParams(**{**bare.to_json_dict(),
                                   "remote_block_ids": params.remote_block_ids[::-1]})
    assert read_by_d(tokens, shuffled).kv_digest != send.kv_digest


def test_d_refuses_params_with_ps_digest_for_another_prompt_before_reading() -> None:
    send, params = held_by_p(TOKENS[:40])
    assert params.kv_digest == send.kv_digest.hex()
    conn, mgr = scheduler(), manager()
    assert admit(conn, mgr, request("d-req", [t + 1 for t in TOKENS[:40]], params))[1] == 0
    meta = conn.build_connector_meta()
    assert meta.reqs_to_recv == [] and [n.grant for n in meta.reqs_to_notify] == [params.grant]


def test_d_prompt_extending_ps_is_bound_to_ps_tokens_only() -> None:
    """D's prompt may go on past what P holds: only the first remote_num_tokens count."""
    send, params = held_by_p(TOKENS[:40])
    recv = read_by_d(TOKENS[:70], params)
    assert recv.num_tokens == 40 and recv.kv_digest == send.kv_digest


def test_params_that_cannot_be_digested_prefill_locally() -> None:
    conn, mgr = scheduler(), manager()
    req = request("r", TOKENS[:40], remote(40, remote_block_ids=[2**63, 1, 2]))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    (notice,) = conn.build_connector_meta().reqs_to_notify  # P frees now, not at lease end
    assert (notice.request_id, notice.ok) == ("r", False)
    assert admit(conn, mgr, req) == (0, 0)


# ---------------------------------------------------------------- real workers

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 8, 16, 4, 8
FAST_AGENT = AgentConfig(connect_timeout_s=2.0, handshake_timeout_s=2.0, reply_timeout_s=3.0,
                         chunk_timeout_s=3.0, heartbeat_s=0.5, read_timeout_s=10.0)


def make_worker(engine_id: str) -> ConnectorWorker:
    topo = EngineTopology(tp_size=1, pp_size=1, block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS,
                          is_mla=False, layout=KVLayout.NHD, num_layers=2)
    compat = CompatInfo("m", "float32", NUM_HEADS, HEAD_DIM, 2, KVLayout.NHD, BLOCK_SIZE, False)
    return ConnectorWorker(engine_id, topo, 0, 0, compat, host="127.0.0.1", base_port=0,
                           secret=None, agent_config=FAST_AGENT)


@dataclass
class Pair:
    """A P worker whose cache holds random KV and a D worker whose cache is zero."""

    p: ConnectorWorker
    d: ConnectorWorker
    p_caches: list[torch.Tensor]
    d_caches: list[torch.Tensor]


@pytest.fixture
def pair() -> Iterator[Pair]:
    gen = torch.Generator().manual_seed(11)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM)
    p, d = make_worker("p-bind"), make_worker("d-bind")
    made = Pair(p, d, [torch.randn(shape, generator=gen) for _ in range(2)],
                [torch.zeros(shape) for _ in range(2)])
    try:
        p.register_kv_caches(made.p_caches)
        d.register_kv_caches(made.d_caches)
        yield made
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("honest", [True, False])
def test_workers_land_the_kv_only_for_the_prompt_it_was_granted_for(
    pair: Pair, honest: bool
) -> None:
    p, d = pair.p, pair.d
    tokens, p_blocks, d_blocks = TOKENS[:40], [5, 1, 6], [2, 7, 0]
    p_meta = ConnectorMetadata(reqs_to_send=[SendRequest(
        request_id="p-r", block_ids=p_blocks, grant="G" * 22, lease_s=30.0,
        kv_digest=kv_digest(tokens, p_blocks))])
    p.start_load_kv(p_meta)
    p.wait_for_save()
    d_tokens = tokens if honest else tokens[::-1]
    assert p.handshake_metadata is not None
    recv = RecvRequest(
        request_id="d-r", local_block_ids=d_blocks, first_token=0, num_tokens=39,
        remote_engine_id="p-bind", remote_host="127.0.0.1", remote_port=p.handshake_metadata.port,
        remote_tp_size=1, remote_pp_size=1, remote_block_size=BLOCK_SIZE,
        remote_block_ids=p_blocks, grant="G" * 22, kv_digest=kv_digest(d_tokens, p_blocks),
    )
    d.start_load_kv(ConnectorMetadata(reqs_to_recv=[recv]))
    d.wait_for_save()
    invalid = wait_finished(d, "d-r", recving=True)
    # [layers, 2, tokens, heads, dim] of the request's blocks, in token order
    landed = torch.stack(pair.d_caches)[:, :, d_blocks].flatten(2, 3)
    if honest:
        assert invalid == set()
        served = torch.stack(pair.p_caches)[:, :, p_blocks].flatten(2, 3)
        assert torch.equal(landed[:, :, :39], served[:, :, :39])  # token 39 was not read
    else:
        assert invalid == set(d_blocks)
        assert not landed.any()  # not one byte of the other prompt's KV arrived
    # either way the reader reported back, so P frees well before the lease ends
    assert wait_finished(p, "p-r", recving=False) == set()
