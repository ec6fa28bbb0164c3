"""The serving half of a transfer agent (P's side): sessions, grants, sending.

Modules (import from them; this package exports nothing):

- :mod:`.session`: ``serve_connection``, one session per accepted connection:
  handshake, message dispatch, which way each read is served;
- :mod:`.context`: ``ServerContext`` (what sessions share), ``Session``,
  waiting for grants not yet issued;
- :mod:`.checks`: a read request against this rank, pinning its grant;
- one module per way of sending, each the counterpart of a reading strategy
  (``reading/``): :mod:`.staged` (pack and send on credit), :mod:`.direct`
  (straight from the cache blocks), :mod:`.copy_hold` (a same-host reader
  copies; the grant is held meanwhile);
- :mod:`.grants`: ``GrantTable``, the finished prefills whose blocks are held
  for readers (it also keeps the grant board, ``protocol/grant_board.py``).

Never imports ``reading/`` (nor the reverse): what both halves need lives in
``ucx/``, ``protocol/`` or ``blocks/``.
"""
