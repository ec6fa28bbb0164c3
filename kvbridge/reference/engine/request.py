"""A generation request inside the engine, its parameters and what the engine reports.

``LLMEngine.add_request`` builds one :class:`EngineRequest` per request; the
scheduler (``engine/scheduler.py``) owns it from then on: it moves the request
through :class:`RequestStatus`, advances ``num_computed_tokens``, appends
sampled tokens and finally reports it in :class:`RequestOutput` records.

``EngineRequest`` extends the KV cache manager's :class:`kvbridge.reference.paged.request.Request`
(tokens, progress, block hashes) with what only the engine needs: sampling
parameters, status, ``kv_transfer_params`` and timing. Lifecycle::

    WAITING --schedule--> RUNNING --EOS / max_tokens--> FINISHED_*
       ^  \\                 |
       |   \\--remote load--> WAITING_FOR_REMOTE_KVS --loaded--> WAITING
       +----- preempted ---+
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum

import msgspec

from kvbridge.connector.params import KVTransferParams
from kvbridge.reference.engine.sampling import SamplerParams, check_sampler_args
from kvbridge.reference.paged.hashing import BlockHasher
from kvbridge.reference.paged.request import Request

__all__ = [
    "EngineRequest",
    "FinishReason",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
]


class SamplingParams(msgspec.Struct, frozen=True):
    """How a caller wants a request sampled, and when to stop it.

    The scheduler checks the stop conditions; the workers' sampler gets only
    :meth:`sampler_params`.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: Keep the smallest set of most likely tokens whose probability
            reaches ``top_p`` (1.0 keeps all).
        seed: Makes random draws reproducible; ``None`` draws from the runner's
            own unseeded generator.
        max_tokens: Output tokens to generate at most (>= 1).
        ignore_eos: Keep generating after the EOS token.

    Raises:
        ValueError: ``max_tokens`` < 1, a negative temperature or ``top_p``
            outside ``(0, 1]`` (``msgspec.ValidationError`` when decoding).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_sampler_args(self.temperature, self.top_p)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    def sampler_params(self) -> SamplerParams:
        """The fields the workers' sampler reads (what crosses to the workers each step)."""
        return SamplerParams(self.temperature, self.top_p, self.seed)


class RequestStatus(Enum):
    """Where a request is in its lifecycle (see the module diagram)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        """Whether the request is done (for any reason)."""
        return self in _FINISHED


class FinishReason(StrEnum):
    """Why a request finished, as reported to clients (OpenAI-style names)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISHED = frozenset({
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
})

_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


class EngineRequest(Request):
    """A request as the engine's scheduler tracks it.

    Args:
        request_id: Unique id within the engine.
        prompt_token_ids: The prompt (>= 1 token).
        sampling_params: Sampling and stop conditions.
        hasher: The engine's block hasher (``None``: no prefix caching).
        arrival_time_s: When the request arrived (the scheduler's clock).
        kv_transfer_params: Remote prefill / decode instructions, or ``None``.

    Raises:
        ValueError: empty id or prompt, or a negative token id.
    """

    __slots__ = (
        "sampling_params",
        "sampler_params",
        "status",
        "kv_transfer_params",
        "arrival_time_s",
        "first_token_time_s",
        "finish_reason",
        "error",
        "num_cached_tokens",
        "num_remote_tokens",
        "num_preemptions",
        "remote_load_done",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        hasher: BlockHasher | None,
        arrival_time_s: float,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> None:
        super().__init__(request_id, prompt_token_ids, hasher)
        self.sampling_params = sampling_params
        self.sampler_params = sampling_params.sampler_params()
        self.status = RequestStatus.WAITING
        self.kv_transfer_params = kv_transfer_params
        self.arrival_time_s = arrival_time_s
        self.first_token_time_s: float | None = None
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        # Prompt tokens found in the local prefix cache / loaded from a remote
        # prefill when the request was first scheduled (for reporting).
        self.num_cached_tokens = 0
        self.num_remote_tokens = 0
        self.num_preemptions = 0
        # A request is loaded from a remote prefill at most once: a preempted
        # or rolled-back request recomputes locally (no transfer loops).
        self.remote_load_done = False

    @property
    def is_finished(self) -> bool:
        """Whether the request is done."""
        return self.status.is_finished

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first output token, once there is one."""
        if self.first_token_time_s is None:
            return None
        return self.first_token_time_s - self.arrival_time_s

    def wants_remote_prefill(self) -> bool:
        """Whether the request asks to load its prompt's KV from a remote prefill."""
        params = self.kv_transfer_params
        return params is not None and params.do_remote_prefill and not self.remote_load_done

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Mark the request finished for ``reason`` (with a message for ``ERROR``)."""
        self.status = _STATUS_OF_REASON[reason]
        self.finish_reason = reason
        self.error = error

    def stop_reason(self, eos_token_id: int, max_model_len: int) -> FinishReason | None:
        """Why the request must stop after its latest token, or ``None`` to go on."""
        params = self.sampling_params
        if not params.ignore_eos and self.num_output_tokens and (
            self.all_token_ids[-1] == eos_token_id
        ):
            return FinishReason.STOP
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step (or ``generate``) reports about one request.

    Attributes:
        request_id: The request.
        new_token_ids: Tokens sampled in this step (``generate``: the whole completion).
        finished: Whether this is the request's last output.
        finish_reason: Why it finished, when ``finished``.
        kv_transfer_params: On a prefill instance, what a decode instance needs
            to load this request's KV (set on the finished output), else ``None``.
        num_prompt_tokens: Prompt length.
        num_cached_tokens: Prompt tokens found in the local prefix cache.
        num_remote_tokens: Prompt tokens loaded from a remote prefill.
        ttft_s: Seconds from arrival to the first token (``None`` before it).
        error: Message when ``finish_reason`` is ``ERROR``.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    kv_transfer_params: KVTransferParams | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_remote_tokens: int
    ttft_s: float | None
    error: str | None = None

    @classmethod
    def of(
        cls,
        request: EngineRequest,
        new_token_ids: list[int],
        kv_transfer_params: KVTransferParams | None = None,
    ) -> RequestOutput:
        """The output of ``request`` now, carrying ``new_token_ids``."""
        return cls(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            kv_transfer_params=kv_transfer_params,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_remote_tokens=request.num_remote_tokens,
            ttft_s=request.ttft_s,
            error=request.error,
        )
