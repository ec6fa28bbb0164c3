"""One answer from the answers to a request's choices, each asked for on its own.

``kvbridge/proxy/app.py`` sends each unit of ``api_bodies.split`` through P and
D like a request of its own and merges what comes back here into what vLLM
answers a request for several choices: one ``id``, the choices numbered by
unit (``index`` k for unit k), the prompt's tokens counted once per prompt and
the choices' tokens summed. A stream interleaves the units' events as they
come, each choice's under its index, the usage (asked with ``include_usage``)
once at the end, then one ``[DONE]``. An error event of one unit is passed on
and the others go on. Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvbridge.http_common import SSE_DONE, sse_event

__all__ = ["merge_answers", "merge_streams"]


def _merge_usage(usages: list[Any], n: int) -> dict[str, Any] | None:
    """Usage of the whole request: unit k's prompt counted when k is a prompt's first choice."""
    if not all(isinstance(u, dict) for u in usages):
        return None
    merged = dict(usages[0])
    prompt = sum(int(u.get("prompt_tokens") or 0) for u in usages[::n])
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    merged.update(prompt_tokens=prompt, completion_tokens=completion,
                  total_tokens=prompt + completion)
    return merged


def merge_answers(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The non-streamed answer: unit k's choice as choice k.

    Args:
        answers: Each unit's JSON answer, in unit order.
        n: Choices per prompt (units ``k`` with ``k % n == 0`` start a prompt).
    """
    merged = dict(answers[0])
    choices = []
    for k, answer in enumerate(answers):
        for choice in answer.get("choices") or []:
            if isinstance(choice, dict):
                choices.append({**choice, "index": k})
    merged["choices"] = choices
    if "usage" in merged:
        merged["usage"] = _merge_usage([a.get("usage") for a in answers], n)
    return merged


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events (without their blank line) as they complete."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event:
                yield event
    if pending.strip():
        yield pending


class _Merger:
    """Rewrites the units' events into the one stream (owned by :func:`merge_streams`)."""

    def __init__(self, num_units: int, n: int) -> None:
        self.n = n
        self.usages: list[Any] = [None] * num_units
        self.head: dict[str, Any] = {}  # id, object, created, model of the first event

    def rewrite(self, k: int, raw: bytes) -> bytes | None:
        if raw == b"data: [DONE]":
            return None
        try:
            event = json.loads(raw.removeprefix(b"data: "))
        except ValueError:
            return raw + b"\n\n"
        if not isinstance(event, dict) or "error" in event:
            return raw + b"\n\n"
        if not self.head:
            self.head = {key: event.get(key) for key in ("id", "object", "created", "model")}
        choices = event.get("choices")
        if event.get("usage") is not None and not choices:  # the unit's usage: summed
            self.usages[k] = event["usage"]
            return None
        event["id"] = self.head["id"]
        event["choices"] = [{**c, "index": k} if isinstance(c, dict) else c
                            for c in choices or []]
        return sse_event(event)

    def usage_event(self) -> bytes:
        usage = _merge_usage(self.usages, self.n)
        return sse_event({**self.head, "choices": [], "usage": usage}) if usage else b""


async def merge_streams(streams: list[AsyncGenerator[bytes, None]], n: int
                        ) -> AsyncGenerator[bytes, None]:
    """The streamed answer from each unit's SSE stream, in unit order.

    Every stream is read to its end (or closed when the client leaves), so each
    unit's own clean-up runs.

    Args:
        streams: Each unit's SSE bytes, in unit order (closed here).
        n: Choices per prompt.
    """
    merger = _Merger(len(streams), n)
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncGenerator[bytes, None]) -> None:
        try:
            async for event in _events(stream):
                await queue.put((k, event))
        finally:
            await stream.aclose()
            await queue.put((k, None))

    pumps = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            k, raw = await queue.get()
            if raw is None:
                num_open -= 1
                continue
            out = merger.rewrite(k, raw)
            if out:
                yield out
        yield merger.usage_event() + SSE_DONE
    finally:
        for task in pumps:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps, return_exceptions=True)
