"""What ``kvbridge demo`` sends and how it judges and shows the answers.

``run.py`` builds the prompt mix with :func:`build_workload`, turns
each answer into a :class:`RequestResult` (the colocated answer beside the P/D
one), prints :func:`progress_line` as each request completes, then
:func:`render_table` and :func:`render_summary`, and exits with
:func:`exit_code`. Nothing here starts processes or talks HTTP, so tests can
feed it hand-made results.

Transfer figures come from D's ``/metrics`` counters, read before and after a
request (:meth:`TransferDelta.between`). Requests sent one at a time get their
own window; the concurrent batch shares one, shown once below the table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DemoPrompt",
    "RequestResult",
    "TransferDelta",
    "build_workload",
    "exit_code",
    "first_mismatch",
    "progress_line",
    "render_summary",
    "render_table",
]

# Two passages the long prompts are cut from; byte-level tokens, so one
# character is one token (plus BOS).
_DOCS = (
    "A disaggregated deployment splits every request in two. The prefill instance reads "
    "the whole prompt in one pass and writes its keys and values into a paged cache; the "
    "decode instance then produces the answer one token at a time. Moving the cache "
    "between them is cheaper than computing it again, provided both sides agree on which "
    "bytes of which block belong to which head, layer and token position. ",
    "Tensor parallel ranks each hold a slice of the attention heads. When the prefill side "
    "runs with two ranks and the decode side with one, the single decode worker reads half "
    "of every block from each prefill rank and stitches the halves together, fixing the "
    "memory layout and the block size on the way in, before the first decode step. ",
)
_SHORTS = ("Hi!", "KV?", "Ping", "P->D")
_SEQUENTIAL_KINDS = ("short", "long", "prefix", "repeat")


@dataclass(frozen=True, slots=True)
class DemoPrompt:
    """One request of the demo.

    Attributes:
        index: Position in the workload (0-based).
        kind: ``short`` (below one block), ``long``, ``prefix`` (shares the
            start of an earlier prompt: a partial prefix hit on D), ``repeat``
            (an earlier prompt again: a full hit) or ``concurrent``.
        text: The prompt.
        concurrent: Sent together with the other concurrent prompts.
    """

    index: int
    kind: str
    text: str
    concurrent: bool = False


def build_workload(num_prompts: int, block_size: int, quick: bool) -> list[DemoPrompt]:
    """The demo's prompt mix: sequential short/long/prefix/repeat rounds, then a batch.

    Args:
        num_prompts: Prompts in total (>= 1). From 4 on, a third of them
            (rounded down) go out concurrently at the end.
        block_size: The smaller of P's and D's block sizes; short prompts stay
            below it (BOS included) when it is at least 3.
        quick: Cut the long passages to half.

    Returns:
        ``num_prompts`` prompts in sending order.

    Raises:
        ValueError: ``num_prompts`` or ``block_size`` below 1.
    """
    if num_prompts < 1 or block_size < 1:
        raise ValueError(f"num_prompts ({num_prompts}) and block_size ({block_size}) "
                         f"must be >= 1")
    num_concurrent = num_prompts // 3 if num_prompts >= 4 else 0
    prompts: list[DemoPrompt] = []
    for i in range(num_prompts - num_concurrent):
        rnd, kind = divmod(i, len(_SEQUENTIAL_KINDS))
        doc = _doc(rnd, quick)
        texts = {
            "short": _SHORTS[rnd % len(_SHORTS)][: max(1, block_size - 2)],
            "long": doc,
            "prefix": doc[: len(doc) * 2 // 3] + "So what crosses the wire?",
            "repeat": doc,
        }
        name = _SEQUENTIAL_KINDS[kind]
        prompts.append(DemoPrompt(i, name, texts[name]))
    shared = _doc(0, quick)
    for j in range(num_concurrent):
        # Growing slices of the first passage, each with its own tail: D holds
        # the passage from the sequential rounds, so every one is a prefix hit.
        cut = len(shared) * (j + 1) // (num_concurrent + 1)
        prompts.append(DemoPrompt(len(prompts), "concurrent",
                                  f"{shared[:cut]} (request {j} of the batch)", True))
    return prompts


def _doc(rnd: int, quick: bool) -> str:
    doc = _DOCS[rnd % len(_DOCS)]
    if rnd >= len(_DOCS):
        doc = f"Round {rnd}. {doc}"  # later rounds must not share a prefix with earlier ones
    return doc[: len(doc) // 2] if quick else doc


@dataclass(frozen=True, slots=True)
class TransferDelta:
    """KV reads D's workers finished within one window of ``/metrics`` readings.

    Attributes:
        nbytes: Bytes received.
        duration_s: Sum of the reads' durations (one read per D worker and request).
        num_reads: Reads completed.
        num_failures: Reads failed.
    """

    nbytes: int
    duration_s: float
    num_reads: int
    num_failures: int

    @classmethod
    def between(cls, before: Mapping[str, float], after: Mapping[str, float],
                prefix: str = "kvbridge") -> TransferDelta:
        """The counters' growth from ``before`` to ``after`` (parsed ``/metrics`` samples).

        Raises:
            KeyError: a counter is missing from either reading.
        """

        def grew(name: str) -> float:
            key = f"{prefix}_{name}"
            return after[key] - before[key]

        return cls(int(grew("kv_transfer_bytes_total")), grew("kv_transfer_seconds_sum"),
                   int(grew("kv_transfer_seconds_count")),
                   int(grew("kv_transfer_failures_total")))

    @property
    def mean_read_s(self) -> float | None:
        """Mean duration of one read; D's workers read in parallel, so this is the
        wall time of a request's transfer (``None`` without reads)."""
        return self.duration_s / self.num_reads if self.num_reads else None

    @property
    def gbps(self) -> float | None:
        """Bytes moved per second of transfer wall time, in GB/s (10^9 bytes)."""
        mean = self.mean_read_s
        return self.nbytes / mean / 1e9 if mean else None


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request's P/D answer beside the colocated one.

    Attributes:
        prompt: What was sent.
        expected_token_ids: The colocated engine's answer.
        token_ids: The answer through the proxy (empty after an error).
        num_prompt_tokens: Prompt length in tokens (BOS included).
        num_cached_tokens: Prompt tokens D found in its own prefix cache.
        num_remote_tokens: Prompt tokens D read from P.
        ttft_s: Seconds from sending to the first token, seen by the client.
        transfer: This request's own window of D's counters; ``None`` when it
            shared one with other requests.
        error: Why the request failed, if it did.
    """

    prompt: DemoPrompt
    expected_token_ids: list[int]
    token_ids: list[int]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_remote_tokens: int = 0
    ttft_s: float | None = None
    transfer: TransferDelta | None = None
    error: str | None = None

    @property
    def matches(self) -> bool:
        """Whether the request succeeded and its tokens equal the colocated ones."""
        return self.error is None and self.token_ids == self.expected_token_ids


def first_mismatch(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first token where ``got`` differs from ``expected``.

    Returns:
        ``None`` when both are equal; ``min(len)`` when one is a prefix of the other.
    """
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def _verdict(result: RequestResult) -> str:
    if result.error is not None:
        return f"ERROR: {result.error}"
    pos = first_mismatch(result.expected_token_ids, result.token_ids)
    if pos is None:
        return "match"
    return (f"MISMATCH at token {pos}: expected {result.expected_token_ids[pos:pos + 4]}, "
            f"got {result.token_ids[pos:pos + 4]}")


def progress_line(result: RequestResult, num_total: int) -> str:
    """The line printed when a request completes."""
    ttft = f"{result.ttft_s * 1e3:7.1f} ms" if result.ttft_s is not None else "      - ms"
    width = len(str(num_total))
    return (f"[{result.prompt.index + 1:>{width}}/{num_total}] {result.prompt.kind:<10} "
            f"{result.num_prompt_tokens:4d} tokens (D hit {result.num_cached_tokens:4d}, "
            f"read {result.num_remote_tokens:4d})  TTFT {ttft}  {_verdict(result)}")


def _nbytes(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < 1 << 20:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


_COLUMNS = ("#", "kind", "prompt", "D hit", "remote", "match", "moved", "xfer ms", "GB/s",
            "TTFT ms")


def _row(result: RequestResult) -> tuple[str, ...]:
    delta = result.transfer
    if delta is None:
        moved = ms = gbps = "*"
    else:
        mean, rate = delta.mean_read_s, delta.gbps
        moved = _nbytes(delta.nbytes)
        ms = f"{mean * 1e3:.1f}" if mean is not None else "-"
        gbps = f"{rate:.3g}" if rate is not None else "-"
    return (str(result.prompt.index + 1), result.prompt.kind, str(result.num_prompt_tokens),
            str(result.num_cached_tokens), str(result.num_remote_tokens),
            "yes" if result.matches else "NO", moved, ms, gbps,
            f"{result.ttft_s * 1e3:.1f}" if result.ttft_s is not None else "-")


def render_table(results: Sequence[RequestResult]) -> str:
    """One row per request: prompt tokens, D's prefix hit and remote tokens, match
    (``yes``/``NO``), bytes moved, transfer ms, GB/s and client TTFT."""
    rows = [_COLUMNS, *(_row(r) for r in results)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(_COLUMNS))]
    left = {1, 5}  # kind and match read better left-aligned
    lines = ["  ".join(cell.ljust(w) if c in left else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def render_summary(results: Sequence[RequestResult], batch: TransferDelta | None,
                   total: TransferDelta, num_p_held: int | None = None) -> str:
    """Lines under the table: the concurrent batch's shared window, totals, verdict.

    Args:
        results: Every request's result.
        batch: The concurrent batch's shared window, if there was a batch.
        total: The whole run's window.
        num_p_held: Prefills whose blocks P still held for readers at the end
            (``None``: not known).
    """
    lines = []
    if batch is not None:
        num_batch = sum(r.transfer is None for r in results)
        mean, rate = batch.mean_read_s, batch.gbps
        lines.append(f"* the {num_batch} concurrent requests are measured together: "
                     f"{_nbytes(batch.nbytes)} in {batch.num_reads} reads"
                     + (f", {mean * 1e3:.1f} ms per read, {rate:.3g} GB/s"
                        if mean is not None and rate is not None else ""))
    num_ok = sum(r.matches for r in results)
    lines.append(f"D read {_nbytes(total.nbytes)} from P in {total.num_reads} reads "
                 f"({total.num_failures} failed). xfer ms: mean read time of D's workers "
                 f"(they read in parallel; the first read includes the handshake); "
                 f"GB/s: bytes / that time.")
    if num_p_held is not None:
        lines.append("P released the blocks of every prefill once D had read them."
                     if num_p_held == 0 else
                     f"P still holds the blocks of {num_p_held} prefills for readers (they "
                     f"are freed when their lease ends).")
    lines.append(f"{num_ok}/{len(results)} answers match the colocated run token for token: "
                 + ("PASS" if exit_code(results) == 0 else "FAIL"))
    return "\n".join(lines)


def exit_code(results: Sequence[RequestResult]) -> int:
    """0 when every request matched, else 1 (also for an empty run)."""
    return 0 if results and all(r.matches for r in results) else 1
