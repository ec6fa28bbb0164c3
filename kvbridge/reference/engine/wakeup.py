"""``Wakeup``: a wake-up flag over a pipe, settable from other threads and processes.

The engine thread sleeps between steps when nothing can run (only KV transfers
in flight). What ends that sleep happens elsewhere: a new request on the
server's thread, or a transfer that finished on a worker's transfer-agent
thread, in another process. A ``threading.Event`` reaches only the first, so
the engine used to poll its workers with a back-off, which added up to its
longest wait to TTFT. A ``Wakeup`` is one non-blocking pipe::

    engine thread   wait(timeout) --poll----> [read end]  <-- set(): own threads
    worker process  WakeupSender() --write--> [write end] (a dup, sent at spawn)

``set`` writes one byte (several sets before a ``clear`` just fill the pipe a
little; a full pipe means a wake-up is pending anyway), ``clear`` drains,
``wait`` polls. The same interface as ``threading.Event`` (``set``, ``clear``,
``wait``), plus :meth:`sender` for other processes.
"""

from __future__ import annotations

import contextlib
import os
import select
from multiprocessing.connection import Connection

__all__ = ["Wakeup", "WakeupSender"]

_DRAIN_NBYTES = 4096


def _poke(fd: int) -> None:
    # A full pipe already holds a pending wake-up; a closed one has nobody to wake.
    with contextlib.suppress(BlockingIOError, BrokenPipeError, OSError):
        os.write(fd, b"\0")


class WakeupSender:
    """The write end of a :class:`Wakeup`, picklable to a spawned process.

    Calling it wakes the engine (thread-safe, never blocks). Sent to a child it
    arrives as its own duplicate of the pipe's write end.
    """

    def __init__(self, fd: int) -> None:
        # Connection pickles its fd for spawn (duplicated into the child).
        self._conn = Connection(os.dup(fd), readable=False)

    def __call__(self) -> None:
        _poke(self._conn.fileno())

    def close(self) -> None:
        """Close this end (the other ends stay open). Idempotent."""
        self._conn.close()


class Wakeup:
    """A wake-up flag (``set`` / ``clear`` / ``wait``) backed by a non-blocking pipe.

    ``set`` may be called from any thread, and from other processes through
    :meth:`sender`. ``wait`` and ``clear`` belong to the one waiting thread.
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._closed = False

    def set(self) -> None:
        """Wake the waiter (now, or at its next ``wait``)."""
        if not self._closed:
            _poke(self._write_fd)

    def clear(self) -> None:
        """Forget pending wake-ups."""
        if self._closed:
            return
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, _DRAIN_NBYTES):
                pass

    def wait(self, timeout_s: float | None = None) -> bool:
        """Sleep until ``set`` (True) or ``timeout_s`` passed (False); consumes nothing."""
        if self._closed:
            return True
        poller = select.poll()  # not select(): it refuses descriptors from 1024 up
        poller.register(self._read_fd, select.POLLIN)
        return bool(poller.poll(None if timeout_s is None else max(timeout_s, 0.0) * 1000))

    def sender(self) -> WakeupSender:
        """A callable that sets this flag, for another thread or a spawned process."""
        return WakeupSender(self._write_fd)

    def close(self) -> None:
        """Close the pipe; later ``set`` calls do nothing, ``wait`` returns at once."""
        if self._closed:
            return
        self._closed = True
        os.close(self._read_fd)
        os.close(self._write_fd)
