"""A per-chunk timeline of staged reads, to see where a chunk's time goes (issue #41).

Off unless ``KVBRIDGE_TRACE_CHUNKS`` names a directory when a ``TransferAgent``
is constructed (:meth:`ChunkTrace.from_env`). Then the agent appends one JSON
line per staged chunk per side to ``<dir>/chunks-<pid>.jsonl``::

    {"side":"server","xfer_id":7,"chunk":0,"nbytes":16777216,"launch":"loop",
     "stamps_ns":{"credit":...,"buffer":...,"packed":...,"sent":...}}
    {"side":"reader","xfer_id":7,"chunk":0,"nbytes":16777216,"launch":"loop",
     "stamps_ns":{"posted":...,"arrived":...,"unpacked":...,"credited":...}}

Stamps are ``time.monotonic_ns()`` (one clock for every process of a host), in
phase order:

    server  credit    the reader's credit covering the chunk seen
            buffer    a staging buffer taken for it
            packed    its pack ended (``launch``: how it ran, ``blocks/launching.py``)
            sent      UCX's send of it completed
    reader  posted    its receive posted
            arrived   its bytes arrived
            unpacked  its unpack ended
            credited  the credit its free buffer allows sent (none for the last
                      window's chunks: nothing left to credit)

A phase not reached (a failed read, the last window's credit) is left out.
Off, the halves hold None (one check per chunk). On, each read keeps its
records and hands them over when it ends (:meth:`ChunkTrace.write`), one write
per read; at ``close`` and at process exit whatever is left goes out. A write
that fails turns the trace off with one log line: it never fails a read.

Thread-safety: ``write``, ``flush`` and ``close`` may be called from any thread
(the agent's loop writes, ``close`` and exit flush from others).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgspec

__all__ = ["ENV", "ChunkTrace", "ReadChunk", "ServedChunk", "line_of"]

logger = logging.getLogger(__name__)

ENV = "KVBRIDGE_TRACE_CHUNKS"


@dataclass(slots=True)
class ServedChunk:
    """One chunk a server packed and sent (``time.monotonic_ns``; None: not reached)."""

    SIDE: ClassVar[str] = "server"
    PHASES: ClassVar[tuple[str, ...]] = ("credit", "buffer", "packed", "sent")

    xfer_id: int
    chunk: int
    nbytes: int
    launch: str
    credit: int | None = None
    buffer: int | None = None
    packed: int | None = None
    sent: int | None = None


@dataclass(slots=True)
class ReadChunk:
    """One chunk a reader received and unpacked (``time.monotonic_ns``; None: not reached)."""

    SIDE: ClassVar[str] = "reader"
    PHASES: ClassVar[tuple[str, ...]] = ("posted", "arrived", "unpacked", "credited")

    xfer_id: int
    chunk: int
    nbytes: int
    launch: str
    posted: int | None = None
    arrived: int | None = None
    unpacked: int | None = None
    credited: int | None = None


def line_of(record: ServedChunk | ReadChunk) -> dict[str, Any]:
    """The JSON object of one record (module docstring)."""
    stamps = {phase: stamp for phase in record.PHASES
              if (stamp := getattr(record, phase)) is not None}
    return {"side": record.SIDE, "xfer_id": record.xfer_id, "chunk": record.chunk,
            "nbytes": record.nbytes, "launch": record.launch, "stamps_ns": stamps}


class ChunkTrace:
    """Appends chunk records as JSON lines to ``<directory>/chunks-<pid>.jsonl``.

    Args:
        directory: where the file goes (made if missing, at the first write).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._kept: list[ServedChunk | ReadChunk] = []
        self._lock = threading.Lock()
        self._off = False
        self._encoder = msgspec.json.Encoder()
        atexit.register(self.flush)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChunkTrace | None:
        """A trace into the directory ``KVBRIDGE_TRACE_CHUNKS`` names, or None (unset, empty)."""
        directory = (os.environ if environ is None else environ).get(ENV, "")
        return cls(directory) if directory else None

    @property
    def path(self) -> Path:
        """This process's file (the pid is read at each write: a forked child has its own)."""
        return self.directory / f"chunks-{os.getpid()}.jsonl"

    @property
    def off(self) -> bool:
        """A write failed: nothing is kept or written any more."""
        return self._off

    def write(self, records: Iterable[ServedChunk | ReadChunk]) -> None:
        """Append ``records`` (one read's chunks, in order) to the file now. Never raises."""
        with self._lock:
            if not self._off:
                self._kept.extend(records)
                self._flush_locked()

    def flush(self) -> None:
        """Write what is kept. Never raises."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Flush, and forget the exit hook. Idempotent."""
        self.flush()
        atexit.unregister(self.flush)

    def _flush_locked(self) -> None:
        kept, self._kept = self._kept, []
        if not kept or self._off:
            return
        data = b"".join(self._encoder.encode(line_of(record)) + b"\n" for record in kept)
        path = self.path
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(data)
                while view:  # O_APPEND: other agents of this process append between lines
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError as exc:
            self._off = True
            logger.warning("chunk trace off: cannot write %s: %s", path, exc)
