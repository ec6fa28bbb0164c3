"""Slow a transfer server down from a test: it waits before each data chunk it serves.

Fault tests need reads that last seconds, so that a kill, a cut link or a
hang-up lands "mid-transfer" on purpose rather than by luck. kvbridge has no
knob for that; this module wraps the serving half's functions in one process
(``transfer/serving/``, where P answers reads), the reading half untouched:

    staged read      waits ``delay_s`` before each chunk's credit (``ServedRead.wait_credit``)
    direct read      chunk i is posted (i + 1) x ``delay_s`` late, or at once when the
                     connection is aborted, which fails it (``direct._post_chunk``)
    same-host copy   ``CopyGo`` goes out ``delay_s`` x chunks after the grant is pinned
                     (``session.CopyHold``); a cancelled session unpins it

The grant is pinned all the while, as for a slow network. Copies a reader
makes on the grant board's word alone never reach the server and are not
slowed (turn ``grant_board`` off for those). Keep ``delay_s`` under the
server's ``chunk_timeout_s``, and ``delay_s`` x chunks under its
``read_timeout_s``: the server's own deadlines still hold.

Three ways in:

- in this process: ``with slow_serving(0.1): ...`` (every server of the process);
- a ``tests/transfer/agent_proc.py`` host: ``Host(chunk_delay_s=0.1)``;
- a server started as a command: ``python -m tests.slow_serving <kvbridge.cli
  arguments>`` with ``KVBRIDGE_TEST_CHUNK_DELAY_S`` set (``chunk_delay_env``).
  The delay is installed when this module is imported, so the engine's TP
  workers (``multiprocessing`` spawn children, which import the parent's
  ``__main__`` module again) are slowed too.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by ``install`` only: a test's parent process stays free of ucxx
    from kvbridge.transfer.protocol.wire import ReadRequest
    from kvbridge.transfer.serving.context import ServerContext, Session
    from kvbridge.transfer.serving.direct import IovArray
    from kvbridge.transfer.ucx.connection import UcxConnection

ENV = "KVBRIDGE_TEST_CHUNK_DELAY_S"
#: How a test starts a slowed server as a command: ``[python, *COMMAND, *cli_args]``.
COMMAND = ("-m", "tests.slow_serving")


def chunk_delay_env(delay_s: float) -> dict[str, str]:
    """Environment for ``python -m tests.slow_serving ...``: slowed by ``delay_s``."""
    return {ENV: repr(float(delay_s))}


def install(delay_s: float) -> Callable[[], None]:
    """Slow every transfer server of this process down (module doc); returns the undo.

    Raises:
        ValueError: ``delay_s`` is negative or not finite.
    """
    if not (math.isfinite(delay_s) and delay_s >= 0):
        raise ValueError(f"a chunk delay must be finite and >= 0 seconds, got {delay_s!r}")
    from kvbridge.transfer.serving import direct, session
    from kvbridge.transfer.serving.checks import num_chunks
    from kvbridge.transfer.serving.context import ServedRead

    wait_credit, post_chunk = ServedRead.wait_credit, direct._post_chunk
    copy_hold = session.CopyHold

    async def slow_wait_credit(self: ServedRead, num_credited: int, timeout_s: float) -> None:
        await asyncio.sleep(delay_s)
        await wait_credit(self, num_credited, timeout_s)

    def slow_post_chunk(ctx: ServerContext, conn: UcxConnection, iov: IovArray,
                        channel: int) -> asyncio.Future[None]:
        chunk = channel & 0xFFFF  # wire.channel_of: [xfer_id : 20][chunk : 16]

        async def later() -> None:
            loop = asyncio.get_running_loop()
            due = loop.time() + (chunk + 1) * delay_s
            while not conn.closed and loop.time() < due:  # an aborted one fails it now
                await asyncio.sleep(min(due - loop.time(), 0.05))
            await post_chunk(ctx, conn, iov, channel)

        return asyncio.ensure_future(later())

    def slow_copy_hold(ctx: ServerContext, conn: UcxConnection, req: ReadRequest, token: str,
                       served: Session) -> None:
        async def later() -> None:
            try:
                await asyncio.sleep(delay_s * num_chunks(req))
            except BaseException:  # the session ended first: unpin, as a hold would
                ctx.grants.end_read(token)
                served.reads.pop(req.xfer_id, None)
                raise
            copy_hold(ctx, conn, req, token, served)

        task = asyncio.ensure_future(later())
        served.tasks.add(task)  # cancelled with the session
        task.add_done_callback(served.tasks.discard)

    ServedRead.wait_credit = slow_wait_credit  # type: ignore[method-assign]
    direct._post_chunk = slow_post_chunk
    session.CopyHold = slow_copy_hold  # type: ignore[assignment,misc]

    def undo() -> None:
        ServedRead.wait_credit = wait_credit  # type: ignore[method-assign]
        direct._post_chunk = post_chunk
        session.CopyHold = copy_hold  # type: ignore[misc]

    return undo


@contextmanager
def slow_serving(delay_s: float) -> Iterator[None]:
    """Every transfer server of this process slowed by ``delay_s`` while inside."""
    undo = install(delay_s)
    try:
        yield
    finally:
        undo()


# Run as a command, or imported again as a spawned TP worker's main module: installed now.
if __name__ in ("__main__", "__mp_main__") and os.environ.get(ENV):
    install(float(os.environ[ENV]))

if __name__ == "__main__":
    from kvbridge.cli.main import main

    sys.exit(main(sys.argv[1:]))
