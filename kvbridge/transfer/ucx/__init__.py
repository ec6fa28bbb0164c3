"""The UCX layer of the transfer agent: asyncio over ucxx's low-level API and libucp.

Modules (import from them; this package exports nothing):

- :mod:`.worker`: ``UcxWorker``, the UCX context and worker, its progress
  driver, listener and connects (``SAFE_TLS``: the transports it allows);
- :mod:`.connection`: ``UcxConnection``, one endpoint: tags, sends, receives,
  control frames (``MAX_CHANNEL``, ``ignore_outcome``);
- :mod:`.listener`: ``UcpListener``, bound to one address (ucxx's binds every
  interface), and the endpoints it accepts;
- :mod:`.iov`: tagged messages gathered from or scattered into memory ranges;
- :mod:`.ucp_lib`: the libucp calls made through ctypes, and their requests.

Nothing here knows the transfer protocol: above it are ``protocol/`` (messages,
handshake) and the agent's two halves, ``serving/`` and ``reading/``.
"""
