"""A raw UCX client in the test process that speaks the agent's protocol by hand.

Tests that must see exactly what a serving agent (in a child process) says or
pins attack or read it through these: a ``UcxWorker`` of this process, the
message codec and an identity for the handshake helpers of
``kvbridge.transfer.protocol.handshake``. Used by ``test_transfer_faults.py``
and ``test_local_copy.py``; their servers share :data:`SECRET` and the default
:class:`Spec` shape, so :func:`me` passes their compatibility check.
"""

from __future__ import annotations

from kvbridge.transfer.protocol import security, wire
from kvbridge.transfer.protocol.handshake import Identity
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.transfer.agent_proc import Spec

SECRET = b"correct horse battery staple 123"
CODEC = wire.MessageCodec()
MAX_FRAME = 1 << 20  # AgentConfig.max_frame_nbytes default

#: The model shape of the servers these tests attack (only the shape counts for compat).
SERVER_SHAPE = Spec("p-x")


def me(secret: bytes | None = SECRET, compat: str | None = None) -> Identity:
    """The raw client's identity: ``attacker`` rank 0, the servers' compat hash unless given."""
    return Identity("attacker", 0, compat or security.compat_hash(SERVER_SHAPE.compat()), secret)


async def connect(port: int) -> tuple[UcxWorker, UcxConnection]:
    """A fresh worker of this process and its connection to the agent on ``port``."""
    worker = UcxWorker()
    return worker, await worker.connect("127.0.0.1", port, timeout_s=5.0)
