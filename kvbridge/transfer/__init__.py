"""UCX transfer agent: wire messages, handshake, grants, reads across ranks.

Entry point: :class:`kvbridge.transfer.agent.TransferAgent` (one per worker).

Layout (each subpackage's ``__init__`` lists its modules)::

    agent.py    TransferAgent, its loop thread      agent_config.py  AgentConfig (tunables)
    local_kv.py LocalKV (the worker's caches)        clock.py  Clock for leases
    errors.py   typed transfer errors
    ucx/        UCX worker + progress, connection + framing, libucp ctypes, iov
    protocol/   wire messages, handshake, security, same-host identity, grant board
    blocks/     block byte ranges (direct reads), staging buffers
    serving/    P's side: sessions, grant table, one module per way of sending
    reading/    D's side: links, jobs, one module per read strategy

``serving/`` and ``reading/`` never import each other.
"""

from kvbridge.transfer.protocol.security import prompt_digest

__all__ = ["prompt_digest"]
