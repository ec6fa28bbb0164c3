"""What the scheduler hands out: one step's decisions and a stats snapshot.

``Scheduler.schedule`` returns a :class:`SchedulerOutput`; the engine turns it
into the workers' ``StepBatch`` and the connector's ``build_connector_meta``
reads it. ``Scheduler.get_stats`` returns a :class:`SchedulerStats`, which the
metrics endpoint renders.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.reference.engine.runner import RequestStep, StepBatch
from kvbridge.reference.engine.sampling import SamplerParams

__all__ = ["ScheduledRequest", "SchedulerOutput", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's work in a step.

    Attributes:
        req_id: The request.
        token_ids: Tokens computed this step (a prompt chunk or the last sampled token).
        start_pos: Tokens already in the cache before the step.
        block_ids: The request's block ids (covering ``start_pos + len(token_ids)``).
        sample: Whether a token is sampled after ``token_ids``.
        sampling: Sampling parameters for the workers.
        is_new: First step since the request was admitted (or re-admitted).
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling: SamplerParams
    is_new: bool


@dataclass(slots=True)
class SchedulerOutput:
    """What :meth:`Scheduler.schedule` decided for one step.

    Attributes:
        step_id: Step counter (from 1).
        scheduled: Requests to run, in batch order.
        preempted_req_ids: Requests preempted this step (blocks freed).
        finished_req_ids: Requests finished since the previous step.
        connector_metadata: What the connector's workers do this step (``None``
            without a connector).
    """

    step_id: int
    scheduled: list[ScheduledRequest]
    preempted_req_ids: frozenset[str]
    finished_req_ids: frozenset[str]
    connector_metadata: object | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(len(s.token_ids) for s in self.scheduled)

    def step_batch(self) -> StepBatch:
        """The batch the workers run."""
        return StepBatch(
            [RequestStep(s.req_id, s.token_ids, s.start_pos, s.block_ids, s.sample, s.sampling)
             for s in self.scheduled],
            step_id=self.step_id,
        )


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for logs and ``/metrics``.

    Attributes:
        num_running: Requests running.
        num_waiting: Requests waiting to be admitted (preempted ones included).
        num_waiting_for_remote_kvs: Requests whose KV is being loaded.
        num_free_blocks: Blocks free for allocation.
        num_usable_blocks: Blocks the cache has (null block excluded).
        num_blocks_held_for_transfer: Blocks of finished requests kept for remote readers.
        num_preemptions: Preemptions since start.
        prefix_cache_queries: Tokens looked up in the prefix cache since start.
        prefix_cache_hits: Tokens found there.
    """

    num_running: int
    num_waiting: int
    num_waiting_for_remote_kvs: int
    num_free_blocks: int
    num_usable_blocks: int
    num_blocks_held_for_transfer: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens since start (0.0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0
