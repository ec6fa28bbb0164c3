"""A read request against this rank: what is wrong with it, what it moves, pinning its grant.

Called by ``session.py`` before any read is served, on both paths (at once and
in a task), and by the send strategies for their sizes. A request is checked
whole before anything is pinned or sent; a problem becomes a
``Reject(BAD_REQUEST)`` for that read alone.
"""

from __future__ import annotations

import hmac
import math

from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.blocks.ranges import MAX_RANGES_PER_CHUNK, head_span, num_planes
from kvbridge.transfer.local_kv import LocalKV
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.serving import grants as grant_errors
from kvbridge.transfer.serving.context import ServedRead, ServerContext

__all__ = [
    "block_nbytes", "check_request", "direct_nbytes", "grant_reason", "num_chunks", "pin",
    "problem", "read_budget_s",
]

R = wire.RejectReason
_GRANT_REASONS: list[tuple[type[Exception], wire.RejectReason]] = [
    (grant_errors.ExpiredGrantError, R.EXPIRED_GRANT),
    (grant_errors.UnknownGrantError, R.UNKNOWN_GRANT),
    (grant_errors.BlockNotGrantedError, R.NOT_GRANTED),
    (grant_errors.NoReadInFlightError, R.NO_READ),
]


def grant_reason(exc: Exception) -> wire.RejectReason:
    """The ``Reject`` reason for a grant table error (``BAD_REQUEST`` for any other)."""
    for kind, reason in _GRANT_REASONS:
        if isinstance(exc, kind):
            return reason
    return R.BAD_REQUEST


def problem(ctx: ServerContext, req: wire.ReadRequest) -> str | None:
    """Return what is wrong with ``req`` for this server, or None."""
    if req.local_copy:
        if ctx.host is None:
            return "this server offers no same-host copies"
        if not req.direct:
            return "a same-host copy must be a direct read"
        num_origins = (req.layer_end - req.layer_start) * num_planes(ctx.local)
        if num_origins > wire.MAX_COPY_ORIGINS:
            return f"same-host copy of {num_origins} planes > limit {wire.MAX_COPY_ORIGINS}"
    return check_request(ctx.local, req, 4 * ctx.config.chunk_nbytes)


def check_request(local: LocalKV, req: wire.ReadRequest, max_chunk_nbytes: int) -> str | None:
    """Return what is wrong with ``req`` for this rank, or None."""
    if not 0 <= req.head_start < req.head_end <= local.num_heads:
        return f"heads [{req.head_start}, {req.head_end}) outside [0, {local.num_heads})"
    if not 0 <= req.layer_start < req.layer_end <= len(local.layers):
        return f"layers [{req.layer_start}, {req.layer_end}) outside [0, {len(local.layers)})"
    bad = [b for b in req.block_ids if b >= local.num_blocks]
    if bad:
        return f"block ids {bad[:8]} outside [0, {local.num_blocks})"
    chunk_nbytes = req.chunk_blocks * block_nbytes(local, req)
    if req.chunk_blocks > 1 and chunk_nbytes > max_chunk_nbytes:
        return f"chunk of {chunk_nbytes} bytes > limit {max_chunk_nbytes}"
    if math.ceil(len(req.block_ids) / req.chunk_blocks) > wire.MAX_CHUNKS:
        return f"more than {wire.MAX_CHUNKS} chunks"
    if req.direct:
        if head_span(local, req.head_start, req.head_end) is None:
            return (f"heads [{req.head_start}, {req.head_end}) of this {local.topology.layout} "
                    f"cache are not one run per block: read them staged")
        num_ranges = req.chunk_blocks * (req.layer_end - req.layer_start) * num_planes(local)
        if num_ranges > MAX_RANGES_PER_CHUNK:
            return f"direct chunk of {num_ranges} ranges > limit {MAX_RANGES_PER_CHUNK}"
    return None


def block_nbytes(local: LocalKV, req: wire.ReadRequest) -> int:
    """Packed bytes of one block of ``req`` (its heads and layers)."""
    num_heads = req.head_end - req.head_start
    per_layer = local.block_nbytes * num_heads // local.num_heads
    return per_layer * (req.layer_end - req.layer_start)


def num_chunks(req: wire.ReadRequest) -> int:
    """Data chunks of ``req``."""
    return math.ceil(len(req.block_ids) / req.chunk_blocks)


def direct_nbytes(local: LocalKV, req: wire.ReadRequest) -> int:
    """Bytes a direct read or same-host copy of ``req`` moves (``req`` checked)."""
    span = head_span(local, req.head_start, req.head_end)
    assert span is not None  # check_request
    num_layers = req.layer_end - req.layer_start
    return len(req.block_ids) * num_layers * num_planes(local) * span.nbytes


def read_budget_s(cfg: AgentConfig, req: wire.ReadRequest) -> float:
    """How long after pinning its grant the server may spend on ``req``: its deadline.

    ``chunk_timeout_s`` per chunk, and never more than ``read_timeout_s`` (a
    reader gives up after as long). Every way of serving ends the read by then:
    direct sends by their one timer, same-host copies by their hold
    (``CopyGo.hold_s``), staged reads by a timeout over all chunks. So a read
    pins its grant for ``read_timeout_s`` at most.
    """
    return min(num_chunks(req) * cfg.chunk_timeout_s, cfg.read_timeout_s)


def pin(
    ctx: ServerContext, grant: str, req: wire.ReadRequest, read: ServedRead
) -> tuple[R, str] | None:
    """Pin grant ``grant`` for ``req`` (``begin_read``), or say why the read may not go on.

    Returns None with the grant pinned (the caller must ``end_read`` it) and
    ``read.deadline`` set (``read_budget_s`` from now), else ``(reason,
    message)`` for the ``Reject`` with nothing pinned.
    """
    try:
        held = ctx.grants.begin_read(grant, req.block_ids)
    except grant_errors.GrantError as exc:
        return grant_reason(exc), str(exc)
    if held.prompt_digest is not None and not hmac.compare_digest(
        held.prompt_digest, req.prompt_digest
    ):
        ctx.grants.end_read(grant)
        return R.PROMPT_MISMATCH, "the grant holds the KV of another prompt"
    read.deadline = ctx.clock.now() + read_budget_s(ctx.config, req)
    return None
