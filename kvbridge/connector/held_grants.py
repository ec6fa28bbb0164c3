"""P side of ``ConnectorScheduler``: finished prefills held for remote readers.

``ConnectorScheduler`` (``scheduler.py``) owns one :class:`HeldGrants`. When a
``do_remote_decode`` request finishes on P, :meth:`HeldGrants.hold` keeps its
prompt's blocks under a fresh grant (a ``SendRequest`` for the workers)
and returns the ``kv_transfer_params`` D reads with. A hold ends when the
workers report the request as finished sending: every reader reported, the
lease ended, or the grant was revoked (:meth:`HeldGrants.revoke`)::

    hold  -> SendRequest (next step) -> readers read ... -> finished_sending -> release
                 revoke -> reqs_to_release (next step) ---^

Holds are capped (``max_held_blocks``): a new hold that would take more goes
after the oldest holds, which are revoked (their readers are refused and
recompute), so that readers that never come cannot stall new prefills. Only
holds the workers know of are revoked (a revocation in the step its grant is
issued would come first and miss it); when those do not make room, the new
prefill is not held (P frees it, D recomputes).

Each grant is bound to the prompt tokens it holds and to their blocks
(``binding.py``): P issues it with the digest of its prompt, and the transfer
agent refuses a read whose digest differs.

With several KV cache groups the request's blocks come per group, and P
holds of each what a reader may need (``kvbridge.topology.groups``: every
block of a full-attention group, the window's blocks, the state block), all
under one grant; the params say where each group's run sits.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence

from kvbridge.connector.binding import kv_digest
from kvbridge.connector.metadata import SendRequest
from kvbridge.connector.params import KVTransferParams, sign_params
from kvbridge.connector.request import ConnectorRequest
from kvbridge.topology import CacheGroup, EngineTopology, hold_groups

__all__ = ["HeldGrants"]

logger = logging.getLogger(__name__)


class HeldGrants:
    """Grants this engine serves, from the prefill's end until its blocks go back.

    Args:
        engine_id: this engine's id, handed to readers.
        host: host readers connect to.
        base_port: transfer base port (0: the ports come with ``set_ports``).
        topology: this engine's topology (its TP and PP sizes go to readers).
        block_size: tokens per block.
        lease_s: how long blocks are held for readers.
        clock: wall clock (epoch seconds) for ``expires_at``.
        groups: the engine's KV cache groups (None: one group of every block).
        null_block_id: the engine's placeholder block in a group's list, if any.
        params_key: ``params.params_key`` of the cluster secret: the params
            handed out are signed with it (None: no secret, unsigned).
        max_held_blocks: at most this many blocks held at once (None: no cap).
    """

    def __init__(
        self, engine_id: str, host: str, base_port: int, topology: EngineTopology,
        block_size: int, *, lease_s: float, clock: Callable[[], float],
        groups: Sequence[CacheGroup] | None = None, null_block_id: int | None = None,
        params_key: bytes | None = None, max_held_blocks: int | None = None,
    ) -> None:
        self._params_key = params_key
        self.max_held_blocks = max_held_blocks
        self._revoked: set[str] = set()  # held, revocation asked
        self.num_evicted = 0  # holds revoked to make room under the cap
        self.engine_id, self.host, self.base_port = engine_id, host, base_port
        self.topology, self.block_size, self.lease_s = topology, block_size, lease_s
        self._clock = clock
        self.groups = tuple(groups) if groups is not None else None
        self.null_block_id = null_block_id
        self._ports: list[int] = []  # per global rank, when base_port is 0
        self._held: dict[str, int] = {}  # request -> blocks held for readers
        self._to_send: list[SendRequest] = []
        self._to_release: list[str] = []
        self.num_issued = 0
        self.num_released = 0

    def set_ports(self, ports: Sequence[int]) -> None:
        """Where each worker's transfer agent listens (index: global rank; the caller checks)."""
        self._ports = list(ports)

    def hold(self, request: ConnectorRequest,
             block_ids: list[int] | tuple[list[int], ...]) -> KVTransferParams | None:
        """Hold a finished prefill's blocks for readers under a new grant.

        Args:
            request: a finished ``do_remote_decode`` request.
            block_ids: its blocks in token order: a list (one group), or a
                tuple of one list per KV cache group (the engine's ``groups``).

        Returns:
            The params D reads with (the blocks stay held until ``release``), or
            ``None`` when nothing is served: under two tokens, ports unknown, or
            blocks that cannot be bound to the prompt.
        """
        request_id = request.request_id
        groups: tuple[list[int], ...] = (
            block_ids if isinstance(block_ids, tuple) else (block_ids,))
        num_tokens = min(request.num_prompt_tokens,
                         max(len(ids) for ids in groups) * self.block_size)
        if num_tokens < 2:  # D recomputes the last prompt token anyway: nothing to read
            return None
        if not (self.base_port or self._ports):
            logger.warning("request %r: the workers' ports are not known yet; not serving "
                           "its KV", request_id)
            return None
        spans: list[tuple[int, int]] = []
        if self.groups is None:
            if len(groups) != 1:
                logger.warning("request %r: %d KV cache groups on an engine configured "
                               "for one; not serving its KV", request_id, len(groups))
                return None
            held = groups[0][: math.ceil(num_tokens / self.block_size)]
        else:
            try:
                if any(g.kind == "state" for g in self.groups) and (
                        request.num_computed_tokens != num_tokens):
                    raise ValueError(
                        f"its recurrent state is the state after {request.num_computed_tokens}"
                        f" tokens, not after the {num_tokens} of its prompt (ask P for "
                        f"max_tokens 1)")
                both = hold_groups(self.groups, groups, num_tokens, self.block_size,
                                   self.null_block_id)
            except ValueError as exc:
                logger.warning("request %r: cannot serve its KV: %s", request_id, exc)
                return None
            held, spans = both.block_ids, both.spans
        try:
            # binds the grant to these tokens in these blocks (binding.py): D sends
            # the digest of its own prompt and P's reads are refused unless it is equal
            digest = kv_digest(request.prompt_token_ids[:num_tokens], held, spans)
        except ValueError as exc:
            logger.warning("request %r: cannot serve its KV: %s", request_id, exc)
            return None
        if not self._make_room(request_id, len(held)):
            return None
        grant = secrets.token_urlsafe(16)
        self._to_send.append(SendRequest(
            request_id=request_id, block_ids=held, grant=grant, lease_s=self.lease_s,
            kv_digest=digest, finished_at=time.monotonic()))
        self._held[request_id] = len(held)
        self.num_issued += 1
        topo = self.topology
        # whole seconds, rounded down: routers re-encode the params (vllm-router parses
        # floats to within 1 ULP, which a signature does not survive); every JSON
        # parser reads an integral value exactly, and D gives up at most 1 s early
        expires_at = float(math.floor(self._clock() + self.lease_s))
        return sign_params(KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_host=self.host,
            remote_port=self._ports[0] if self._ports else self.base_port,
            remote_ports=list(self._ports), remote_block_ids=held, remote_tp_size=topo.tp_size,
            remote_pp_size=topo.pp_size, remote_block_size=self.block_size,
            remote_num_tokens=num_tokens, grant=grant, expires_at=expires_at,
            remote_groups=spans, kv_digest=digest.hex(),
        ), self._params_key)

    def _make_room(self, request_id: str, num_blocks: int) -> bool:
        """Revoke the oldest holds until ``num_blocks`` more fit under the cap.

        Returns:
            False (nothing revoked) when they cannot fit: the request is not held.
        """
        cap = self.max_held_blocks
        if cap is None:
            return True
        pending = {send.request_id for send in self._to_send}
        live = [(rid, n) for rid, n in self._held.items() if rid not in self._revoked]
        num_live = sum(n for _, n in live)
        victims: list[str] = []
        for rid, n in live:  # oldest first (insertion order)
            if num_live + num_blocks <= cap:
                break
            if rid not in pending:
                victims.append(rid)
                num_live -= n
        if num_live + num_blocks > cap:
            logger.warning("request %r: its %d blocks do not fit under the cap of %d blocks "
                           "held for readers (max_held_share); not serving its KV (D "
                           "recomputes)", request_id, num_blocks, cap)
            return False
        for rid in victims:
            logger.warning("request %r: released before its reader came, to make room for "
                           "new holds (cap of %d blocks held for readers); its reader "
                           "recomputes", rid, cap)
            self.revoke(rid)
            self.num_evicted += 1
        return True

    def revoke(self, request_id: str) -> bool:
        """``ConnectorScheduler.revoke``: True if held (released in a later step)."""
        if request_id not in self._held:
            return False
        if request_id not in self._revoked:
            self._revoked.add(request_id)
            self._to_release.append(request_id)
        return True

    def release(self, request_id: str) -> None:
        """The workers finished sending the request: its hold is over (if it was held)."""
        self._revoked.discard(request_id)
        if self._held.pop(request_id, None) is not None:
            self.num_released += 1

    def dispatch(self) -> tuple[list[SendRequest], list[str]]:
        """This step's work for the workers: new grants and revocations (then cleared)."""
        work = self._to_send, self._to_release
        self._to_send, self._to_release = [], []
        return work

    def has_pending_work(self) -> bool:
        """Grants to send or revoke, or blocks held (holds end only through engine steps)."""
        return bool(self._to_send or self._to_release or self._held)

    @property
    def num_held_blocks(self) -> int:
        """Blocks held for remote readers right now."""
        return sum(self._held.values())

    @property
    def num_held_requests(self) -> int:
        """Requests whose blocks are held right now."""
        return len(self._held)
