"""D side of ``ConnectorScheduler``: the requests this engine loads from a remote prefill.

``ConnectorScheduler`` (``scheduler.py``) owns one :class:`RemoteLoads` and
forwards the engine's D-side calls to it (see its docstring for the order). A
load goes through::

    planned     get_num_new_matched_tokens said "load": tokens known, no blocks yet
    allocated   update_state_after_alloc recorded its blocks (a RecvRequest)
    dispatched  in a ConnectorMetadata the workers received; they are reading
    finished    every worker reported; ok, or some blocks invalid

A request that will not load (a full local hit, an expired lease, an abort) is
*given back*: the workers tell P (a ``NotifyRequest``) so P frees its blocks
without waiting for its lease.

Token arithmetic. P computed the KV of prompt tokens ``[0, n)``. The last
prompt token is always recomputed on D (its logits give the first token), so
D loads at most up to ``end = min(n, num_prompt_tokens - 1)``::

    prompt     0 ............................................ num_prompt_tokens
    local hit  |==== num_local ====|                             (D's prefix cache)
    loaded                         |===== num_ext =====|         (from P)
    computed on D                                      |== >= 1 ==|
                                                      end

``num_ext = end - num_local``; zero (a full local hit, or a one-token prompt)
means no load: the grant is given back to P with a notice. After a successful
load ``num_computed_tokens = num_local + num_ext <= num_prompt_tokens - 1``, so
the engine never needs to subtract anything itself.

P and D block sizes may differ. ``num_local`` is a multiple of D's block size;
a load starting inside a P block reads that P block and skips its first tokens
on arrival. Every request is loaded at most once and a loaded request is never
served onward (no transfer loops). D reads with the digest of its own prompt
(``binding.py``): P refuses a read for another prompt's KV, and D recomputes.

Params are checked before anything else (``params.py``): with a secret, params
whose signature does not verify plan no read and are given back to no one (their
addresses may be a forger's); signed params for another prompt, or whose
lease ended, are refused here and given back to P. Each refusal is logged with
its reason (``ParamsRefusal``) and counted (``num_refused``).

Several KV cache groups (``groups``: sliding-window or recurrent-state layers
beside full attention): each group moves what ``kvbridge.topology.groups``
says (a window's blocks, the state after ``end`` tokens), all groups in one
read of block pairs, block sizes equal on both sides. A state after ``end``
tokens exists on P only if P stopped there: in the classic flow a state
model's P computes the prompt without its last token (``end = n``); asked
for the first-token flow it computes it all and D's prompt has P's token
after it (``end = n`` again). A load that could not be exact (P's state is
for another token count, P freed a block of the window D needs, TP sizes
differ under a state) is not made: the request prefills locally and a log
line names the reason.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvbridge.connector.binding import kv_digest
from kvbridge.connector.metadata import NotifyRequest, RecvRequest
from kvbridge.connector.params import KVTransferParams, ParamsRefusal, check_signature
from kvbridge.connector.request import BlockIds, ConnectorRequest
from kvbridge.errors import ConfigError
from kvbridge.topology.groups import CacheGroup, load_problem, plan_group_read

__all__ = ["LoadEnd", "LoadState", "RemoteLoads"]

logger = logging.getLogger(__name__)

LoadState = Literal["planned", "allocated", "dispatched"]


@dataclass(slots=True)
class _Load:
    """D: one request's load, from planning to its finish."""

    params: KVTransferParams
    first_token: int
    num_tokens: int
    kv_digest: bytes  # of D's own prompt and the params' blocks (binding.py)
    recv: RecvRequest | None = None  # set once blocks are allocated
    dispatched: bool = False  # in a metadata the workers received
    aborted: bool = False
    invalid_block_ids: set[int] = field(default_factory=set)

    def written_block_ids(self, block_size: int) -> list[int]:
        recv = self.recv
        assert recv is not None
        end_block = math.ceil(recv.end_token / block_size)
        return (recv.local_block_ids[recv.first_token // block_size : end_block]
                + recv.missing_block_ids)


@dataclass(frozen=True, slots=True)
class LoadEnd:
    """How a load ended (``RemoteLoads.finish``).

    Attributes:
        aborted: its request ended during the load: the blocks, kept until
            now, may be freed.
        block_ids: the request's blocks in token order, from token 0.
        invalid_block_ids: those of them that hold no valid KV.
    """

    aborted: bool
    block_ids: tuple[int, ...]
    invalid_block_ids: frozenset[int]

    def first_bad_token(self, block_size: int, invalid_block_ids: Iterable[int] = ()) -> int | None:
        """Token index of the first block without valid KV (``None``: all of it arrived).

        Args:
            block_size: tokens per block.
            invalid_block_ids: more invalid blocks (e.g. other loads' of the same
                step), counted where the request has them.
        """
        bad = self.invalid_block_ids.union(invalid_block_ids)
        index = next((i for i, block_id in enumerate(self.block_ids) if block_id in bad), None)
        return None if index is None else index * block_size


class RemoteLoads:
    """Loads of remote prefills into this engine's blocks, from planning to finish.

    Args:
        block_size: this engine's tokens per block.
        may_load: False on a prefill-only engine: every load is refused (the
            request prefills locally and its grant is given back).
        clock: wall clock (epoch seconds), compared with a grant's ``expires_at``.
        groups: this engine's KV cache groups; None (or one ``tokens`` group):
            one group, every block from token 0.
        null_block_id: the engine's placeholder block in a group's list (never
            written), if it has one.
        tp_size: this engine's TP size (a recurrent state is not split otherwise).
        params_key: ``params.params_key`` of the cluster secret: params must
            carry its signature (None: no secret, params are not checked).
    """

    def __init__(self, block_size: int, *, may_load: bool, clock: Callable[[], float],
                 groups: Sequence[CacheGroup] | None = None, null_block_id: int | None = None,
                 tp_size: int = 1, params_key: bytes | None = None) -> None:
        self.block_size = block_size
        self._params_key = params_key
        self.may_load = may_load
        self._clock = clock
        one_group = groups is None or (len(groups) == 1 and groups[0].kind == "tokens")
        self.groups: tuple[CacheGroup, ...] | None = None if one_group else tuple(groups or ())
        self.null_block_id, self.tp_size = null_block_id, tp_size
        self._planned: dict[str, _Load] = {}  # asked, blocks not allocated yet
        self._loads: dict[str, _Load] = {}  # allocated, until the workers finish
        self._block_owner: dict[int, str] = {}  # written block id -> loading request
        self._consumed: set[str] = set()  # remote params used up (load at most once)
        self._to_notify: list[NotifyRequest] = []
        self.num_started = 0  # loads dispatched to the workers
        self.num_failed = 0  # finished loads with invalid blocks
        self.num_local_hits_skipped = 0  # not read: the local prefix cache had it all
        self.num_refused: dict[ParamsRefusal, int] = {}  # params refused, by reason

    def plan(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """``ConnectorScheduler.get_num_new_matched_tokens``: tokens to load, and whether to."""
        params = request.kv_transfer_params
        request_id = request.request_id
        if params is None or not params.do_remote_prefill:
            return 0, False
        if request_id in self._consumed or request_id in self._loads:
            return 0, False
        if not self.may_load:
            logger.warning("request %r asks a prefill-only engine to load KV: prefilling "
                           "locally", request_id)
            self._give_back(request_id, params, ok=False)
            return 0, False
        forged = check_signature(params, self._params_key)
        if forged is not None:  # not P's: contact no one they name
            self._refuse(request_id, forged, "unsigned params are refused when this engine "
                         "has a cluster secret (P needs the same secret)" if forged == "unsigned"
                         else "they are not what a P with this cluster secret signed")
            self._consumed.add(request_id)
            return 0, False
        if params.expires_at is not None and params.expires_at <= self._clock():
            self._refuse(request_id, "expired", f"the remote prefill's lease ended "
                         f"{self._clock() - params.expires_at:.1f}s ago")
            self._give_back(request_id, params, ok=False)
            return 0, False
        assert params.remote_block_size is not None  # parse_kv_transfer_params checked
        num_prompt = request.num_prompt_tokens
        end = min(params.remote_num_tokens, num_prompt - 1)
        start = num_computed_tokens
        if end <= start:
            self.num_local_hits_skipped += 1
            self._give_back(request_id, params, ok=True)
            return 0, False
        if start % self.block_size:  # not a prefix hit: blocks before it are not whole
            logger.info("request %r: cannot load from token %d (block size %d); prefilling "
                        "locally", request_id, start, self.block_size)
            self._give_back(request_id, params, ok=True)
            return 0, False
        if self.groups is not None:
            problem = self._group_problem(params, start, end)
            if problem is not None:
                logger.warning("request %r: cannot load its KV exactly: %s; prefilling "
                               "locally", request_id, problem)
                self._give_back(request_id, params, ok=True)
                return 0, False
        try:
            # D's own prompt, not P's: P refuses the read unless they are the same
            digest = kv_digest(request.prompt_token_ids[: params.remote_num_tokens],
                               params.remote_block_ids, params.remote_groups)
        except ValueError as exc:
            logger.warning("request %r: %s; prefilling locally", request_id, exc)
            self._give_back(request_id, params, ok=False)
            return 0, False
        if params.kv_digest is not None and params.kv_digest != digest.hex():
            self._refuse(request_id, "prompt_mismatch", "P prefilled another prompt (or other "
                         "tokens of it) than this request's")
            self._give_back(request_id, params, ok=False)
            return 0, False
        self._planned[request_id] = _Load(params, start, end - start, digest)
        return end - start, True

    def _group_problem(self, params: KVTransferParams, start: int, end: int) -> str | None:
        """Why a load of ``[start, end)`` over several groups would not be exact, or None."""
        assert self.groups is not None
        if params.remote_block_size != self.block_size:
            return (f"P's block size {params.remote_block_size} != this engine's "
                    f"{self.block_size}: a model with several KV cache groups moves whole "
                    f"blocks (set the same --block-size on P and D)")
        has_state = any(group.kind == "state" for group in self.groups)
        if has_state and params.remote_tp_size != self.tp_size:
            return (f"a linear-attention / Mamba state is split over TP ranks: P's TP "
                    f"{params.remote_tp_size} != this engine's {self.tp_size} (use the same "
                    f"--tensor-parallel-size on P and D)")
        spans = params.remote_groups or [(0, len(params.remote_block_ids))]
        return load_problem(self.groups, spans, start, end, params.remote_num_tokens,
                            self.block_size)

    def record_allocation(
        self, request: ConnectorRequest, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        """``ConnectorScheduler.update_state_after_alloc``: where the remote tokens land.

        Raises:
            ConfigError: more external tokens than planned, several groups, or
                too few blocks for the tokens (nothing recorded).
        """
        request_id = request.request_id
        load = self._planned.get(request_id)
        if load is None:
            return
        block_groups = blocks.get_block_ids()
        num_needed = math.ceil((load.first_token + num_external_tokens) / self.block_size)
        num_groups = 1 if self.groups is None else len(self.groups)
        if (num_external_tokens > load.num_tokens or len(block_groups) != num_groups
                or (self.groups is None and len(block_groups[0]) < num_needed)):
            raise ConfigError(
                f"request {request_id!r}: {num_external_tokens} external tokens (planned "
                f"{load.num_tokens}) from token {load.first_token} need {num_needed} blocks in "
                f"{num_groups} groups, got {[len(group) for group in block_groups]}"
            )
        del self._planned[request_id]
        self._consumed.add(request_id)
        if num_external_tokens == 0:
            self._give_back(request_id, load.params, ok=True)
            return
        p = load.params
        assert p.remote_engine_id and p.remote_host and p.remote_port and p.grant
        assert p.remote_block_size is not None
        load.num_tokens = num_external_tokens
        if self.groups is None:
            local_ids, first_token, num_tokens = (block_groups[0][:num_needed],
                                                  load.first_token, num_external_tokens)
            remote_ids, missing = list(p.remote_block_ids), list[int]()
        else:
            remote_ids, local_ids, missing = self._group_read(
                request_id, p, block_groups, load.first_token,
                load.first_token + num_external_tokens)
            first_token, num_tokens = 0, len(local_ids) * self.block_size
        load.recv = RecvRequest(
            request_id=request_id, local_block_ids=local_ids,
            first_token=first_token, num_tokens=num_tokens,
            remote_engine_id=p.remote_engine_id, remote_host=p.remote_host,
            remote_port=p.remote_port, remote_ports=list(p.remote_ports),
            remote_tp_size=p.remote_tp_size,
            remote_pp_size=p.remote_pp_size, remote_block_size=p.remote_block_size,
            remote_block_ids=remote_ids, grant=p.grant,
            kv_digest=load.kv_digest, missing_block_ids=missing,
        )
        self._loads[request_id] = load
        for block_id in load.written_block_ids(self.block_size):
            self._block_owner[block_id] = request_id

    def _group_read(self, request_id: str, params: KVTransferParams,
                    block_groups: Sequence[Sequence[int]], first_token: int, end: int
                    ) -> tuple[list[int], list[int], list[int]]:
        """``(remote ids, local ids, missing local ids)`` of a load over several groups.

        A load whose blocks do not fit what was planned reads nothing: every
        block it would have written is reported missing (the load fails).
        """
        assert self.groups is not None
        spans = params.remote_groups or [(0, len(params.remote_block_ids))]
        try:
            read = plan_group_read(self.groups, block_groups, spans, params.remote_block_ids,
                                   first_token, end, self.block_size, self.null_block_id)
        except ValueError as exc:
            logger.error("request %r: cannot read its KV cache groups: %s", request_id, exc)
            first_block, end_block = (first_token // self.block_size,
                                      math.ceil(end / self.block_size))
            failed = [block_id for ids in block_groups for block_id in ids[first_block:end_block]
                      if block_id != self.null_block_id]
            return [], [], failed
        if read.missing:
            logger.warning("request %r: P does not hold %d blocks this engine allocated; its "
                           "load will count as failed", request_id, len(read.missing))
        return read.remote_block_ids, read.local_block_ids, read.missing

    def dispatch(self) -> tuple[list[RecvRequest], list[NotifyRequest]]:
        """This step's work for the workers: new loads and give-back notices (then cleared)."""
        recvs = [load.recv for load in self._loads.values() if not load.dispatched]
        for load in self._loads.values():
            load.dispatched = True
        self.num_started += len(recvs)
        notices, self._to_notify = self._to_notify, []
        return [recv for recv in recvs if recv is not None], notices

    def mark_invalid(self, block_ids: Iterable[int]) -> None:
        """Blocks a worker reported holding no valid KV, charged to the loads writing them."""
        for block_id in block_ids:
            owner = self._block_owner.get(block_id)
            if owner is not None:
                self._loads[owner].invalid_block_ids.add(block_id)
            else:
                logger.warning("invalid block %d belongs to no load in flight", block_id)

    def finish(self, request_id: str) -> LoadEnd | None:
        """Every worker is done with this request's load.

        Returns:
            How it ended (``None``: no such load in flight, logged).
        """
        load = self._loads.pop(request_id, None)
        if load is None:
            logger.warning("finished load of unknown request %r", request_id)
            return None
        written = load.written_block_ids(self.block_size)
        for block_id in written:
            self._block_owner.pop(block_id, None)
        if load.invalid_block_ids:
            self.num_failed += 1
        assert load.recv is not None
        return LoadEnd(load.aborted, tuple(load.recv.local_block_ids),
                       frozenset(load.invalid_block_ids))

    def end_request(self, request: ConnectorRequest) -> bool | None:
        """A request finished or was aborted: settle its load, if it asked for one.

        Returns:
            ``None`` when the request asked for no load (it may be served to
            readers); else whether its blocks must wait: True while a worker
            may still be writing into them (``finish`` then returns True).
        """
        request_id = request.request_id
        try:
            return self._end_request(request)
        finally:
            self._consumed.discard(request_id)

    def _end_request(self, request: ConnectorRequest) -> bool | None:
        request_id = request.request_id
        self._planned.pop(request_id, None)
        load = self._loads.get(request_id)
        if load is not None:
            if load.dispatched:  # a worker may be writing into the blocks: wait for it
                load.aborted = True
                return True
            del self._loads[request_id]
            for block_id in load.written_block_ids(self.block_size):
                self._block_owner.pop(block_id, None)
            self._give_back(request_id, load.params, ok=False)
            return False
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill:
            return None
        if request_id not in self._consumed:  # ended before its load was planned
            self._give_back(request_id, params, ok=False)
        return False

    def state(self, request_id: str) -> LoadState | None:
        """``ConnectorScheduler.load_state``."""
        if request_id in self._planned:
            return "planned"
        load = self._loads.get(request_id)
        if load is None:
            return None
        return "dispatched" if load.dispatched else "allocated"

    def written_block_ids(self, request_id: str) -> list[int]:
        """The local blocks an allocated load writes (empty if it has none)."""
        load = self._loads.get(request_id)
        if load is None or load.recv is None:
            return []
        return load.written_block_ids(self.block_size)

    def has_pending_work(self) -> bool:
        """Notices to send or loads in flight (both end only through engine steps)."""
        return bool(self._to_notify or self._loads)

    @property
    def num_in_flight(self) -> int:
        """Loads dispatched to the workers and not finished."""
        return sum(1 for load in self._loads.values() if load.dispatched)

    def _refuse(self, request_id: str, reason: ParamsRefusal, why: str) -> None:
        logger.warning("request %r: refusing its kv_transfer_params (%s): %s; prefilling "
                       "locally", request_id, reason, why)
        self.num_refused[reason] = self.num_refused.get(reason, 0) + 1

    def _give_back(self, request_id: str, params: KVTransferParams, *, ok: bool) -> None:
        """Tell P (through the workers) that this engine will not read the request."""
        self._consumed.add(request_id)
        if not (params.remote_engine_id and params.remote_host and params.remote_port
                and params.grant):
            return
        self._to_notify.append(NotifyRequest(
            request_id=request_id, remote_engine_id=params.remote_engine_id,
            remote_host=params.remote_host, remote_port=params.remote_port,
            remote_ports=list(params.remote_ports), grant=params.grant, ok=ok,
        ))
