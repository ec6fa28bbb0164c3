"""What the agents' per-chunk traces say about the reads of one measurement.

With ``KVBRIDGE_TRACE_CHUNKS=<dir>`` set, agent processes append one JSON line per
staged chunk and side to files in ``<dir>`` (``kvbridge/transfer/chunk_trace.py``),
with a monotonic stamp per phase of the chunk. ``benchmarks/gpu_probe.py`` points
its agent pair there and summarises, per measurement, only the lines written since
its timed reads began (:class:`TraceTail`). The lines' own keys name the phases
(nothing here knows them)::

    {"side": "reader", "chunk": 0, "launch": "loop",
     "stamps_ns": {"posted": 1000000, "arrived": 3900000, "unpacked": 4800000}}
    -> {"reader": {"num_chunks": n, "total_ms": 3.8, "launch": ["loop"],
                   "gaps_ms": {"posted->arrived": 2.9, "arrived->unpacked": 0.9}}}

The stamps: the line's one nested object of numbers, else its float values;
nanoseconds when they are integers or their key ends in ``_ns``, else seconds;
each line's taken in time order. Medians over the chunks. The side is the line's
``side`` (or ``role``), else its file's name less a trailing process id; the line's
other text values are listed per side (``launch``: how the kernels ran).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

_SIDE_KEYS = ("side", "role")
_TRAILING_ID = re.compile(r"[-_.]?\d+$")


class TraceTail:
    """The trace lines written into one folder after :meth:`mark`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}

    def mark(self) -> None:
        """Remember where every file ends now: :meth:`summary` reads past it only."""
        self._offsets = {path: path.stat().st_size for path in self._files()}

    def summary(self) -> dict[str, Any]:
        """Median milliseconds per phase-to-phase gap and per chunk, per side, of the
        lines written since :meth:`mark`; empty when there are none."""
        per_side: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for path in self._files():
            with open(path, "rb") as file:
                file.seek(self._offsets.get(path, 0))
                text = file.read().decode(errors="replace")
            for raw in text.splitlines():
                line = _parse(raw)
                if line is not None and len(_stamps_ms(line)) >= 2:
                    per_side[_side(line, path)].append(line)
        return {side: _summarise(lines) for side, lines in sorted(per_side.items())}

    def _files(self) -> list[Path]:
        return sorted(p for p in self.folder.glob("*") if p.is_file())


def _parse(raw: str) -> dict[str, Any] | None:
    try:
        line = json.loads(raw)
    except ValueError:  # a line cut off while the file was written
        return None
    return line if isinstance(line, dict) else None


def _side(line: dict[str, Any], path: Path) -> str:
    for key in _SIDE_KEYS:
        if isinstance(line.get(key), str):
            return str(line[key])
    return _TRAILING_ID.sub("", path.stem) or path.stem


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _stamps_ms(line: dict[str, Any]) -> list[tuple[str, float]]:
    """``(phase, milliseconds)`` in time order: the one nested object of numbers, else
    the line's float values."""
    nested = [v for v in line.values() if isinstance(v, dict) and v
              and all(_is_number(x) for x in v.values())]
    items = (nested[0].items() if len(nested) == 1
             else [(k, v) for k, v in line.items() if isinstance(v, float)])
    stamps = [(key, value / 1e6 if isinstance(value, int) or key.endswith("_ns")
               else value * 1e3) for key, value in items]
    return sorted(stamps, key=lambda stamp: stamp[1])


def _summarise(lines: list[dict[str, Any]]) -> dict[str, Any]:
    gaps: dict[str, list[float]] = defaultdict(list)
    totals: list[float] = []
    texts: dict[str, set[str]] = defaultdict(set)
    for line in lines:
        stamps = _stamps_ms(line)
        totals.append(stamps[-1][1] - stamps[0][1])
        for (before, t0), (after, t1) in zip(stamps, stamps[1:], strict=False):
            gaps[f"{before}->{after}"].append(t1 - t0)
        for key, value in line.items():
            if isinstance(value, str) and key not in _SIDE_KEYS:
                texts[key].add(value)
    return {"num_chunks": len(lines), "total_ms": statistics.median(totals),
            **{key: sorted(values) for key, values in texts.items()},
            "gaps_ms": {name: statistics.median(values) for name, values in gaps.items()}}
