"""A server agent serves at most ``AgentConfig.max_sessions`` connections at once.

Beyond the cap a new connection is answered with a typed ``Reject(BUSY)`` in
place of the handshake's challenge and closed; the ones already open go on,
and a slot freed is taken again. Real UCX between workers of this process.
"""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.transfer.errors import RejectedError
from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.handshake import reader_handshake, recv_msg
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.transfer.inproc import HOST, READER_ID, SERVER_ID, identity, server_and_reader
from tests.waiting import wait_until_async

CODEC = wire.MessageCodec()


def test_connections_beyond_the_cap_are_refused_typed() -> None:
    async def run() -> None:
        async with server_and_reader({"max_sessions": 2}) as (server, _):
            client = UcxWorker()
            held: list[UcxConnection] = []
            try:
                for _ in range(2):  # two open sessions (one handshaked, one silent)
                    held.append(await client.connect(HOST, server.port, timeout_s=5.0))
                await reader_handshake(held[0], CODEC, identity(READER_ID), SERVER_ID, 0,
                                       max_nbytes=1 << 20, timeout_s=5.0)
                await wait_until_async(lambda: len(server.ctx.sessions) == 2, 5.0,
                                       message="two sessions")
                extra = await client.connect(HOST, server.port, timeout_s=5.0)
                with pytest.raises(RejectedError, match="max_sessions") as refused:
                    await reader_handshake(extra, CODEC, identity(READER_ID), SERVER_ID, 0,
                                           max_nbytes=1 << 20, timeout_s=5.0)
                assert refused.value.reason == wire.RejectReason.BUSY
                assert server.ctx.num_sessions_refused == 1
                extra.abort()
                # the sessions already open are served as before
                await held[0].send_frame(CODEC.encode(wire.Ping(7)), timeout_s=5.0)
                pong = await recv_msg(held[0], CODEC, 1 << 20, 5.0)
                assert pong == wire.Pong(7)
                # a slot freed is taken again
                await held[0].close(CODEC.encode(wire.Bye("done")))
                await wait_until_async(lambda: len(server.ctx.sessions) == 1, 5.0,
                                       message="the session to end")
                again = await client.connect(HOST, server.port, timeout_s=5.0)
                held.append(again)
                await reader_handshake(again, CODEC, identity(READER_ID), SERVER_ID, 0,
                                       max_nbytes=1 << 20, timeout_s=5.0)
            finally:
                for conn in held:
                    conn.abort()
                await client.close()

    asyncio.run(run())
