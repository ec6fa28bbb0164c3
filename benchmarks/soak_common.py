"""What a soak run sent, what came back, and its summary, for ``soak.py`` (reference
engine) and ``soak_vllm.py`` (vLLM behind vllm-router).

A :class:`Job` is a greedy request and the tokens a healthy deployment answers
it with; a :class:`Tally` counts each answer's outcome (``right``, ``wrong``,
``clean_error``, ``aborted``, ``torn``, ``late``, ...; the runs name them),
clean errors by message, and keeps the first few details of the outcomes that
fail a run. :func:`print_summary` prints the run's summary (and saves it).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Job", "Tally", "print_summary"]

#: Outcomes whose details the report keeps (the first :data:`_NUM_EXAMPLES`).
_EXAMPLE_KINDS = frozenset({"wrong", "late"})
_NUM_EXAMPLES = 5


@dataclass(frozen=True)
class Job:
    """A request body and the token ids a healthy deployment answers it with."""

    body: dict[str, Any]
    expected: tuple[int, ...]


@dataclass
class Tally:
    """Outcome counts, clean errors by message, the longest request, and the first
    details of ``wrong`` and ``late`` answers (``examples``) for the report."""

    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    max_latency_s: float = 0.0

    def add(self, kind: str, detail: str = "") -> None:
        """Count one answer of outcome ``kind``; ``detail`` says what went wrong."""
        self.counts[kind] += 1
        if kind in _EXAMPLE_KINDS and len(self.examples) < _NUM_EXAMPLES:
            self.examples.append(detail[:300])


def print_summary(summary: dict[str, Any], json_path: str | None) -> None:
    """Print ``summary`` as indented JSON; also write it to ``json_path`` when given."""
    text = json.dumps(summary, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
