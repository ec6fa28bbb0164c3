"""The reading half of a transfer agent (D's side): links to remote ranks, reads.

Modules (import from them; this package exports nothing):

- :mod:`.reads`: ``Reads``, the jobs in flight on the agent's loop: plans,
  cached links, lease renewals, outcomes for the engine thread;
- :mod:`.jobs`: ``ReadJob`` (one ``start_read``) and ``ReadStats`` (what it cost);
- :mod:`.link`: ``PeerLink``, the handshaked connection to one remote rank,
  its reply waiters and heartbeat; it picks each read's strategy;
- :mod:`.strategy`: the interface every read strategy implements
  (``BegunRead``: begin, finish or abandon) and what they share
  (``ReaderContext``, ``ItemResult``, ``ReadSetup``);
- one module per read strategy: :mod:`.staged` (staging buffers, unpack),
  :mod:`.direct` (straight into our blocks), :mod:`.same_host` (we copy the
  server's blocks ourselves, on its grant board's word or after its go);
- :mod:`.inline`: the same-host copy on the board's word made on the thread
  calling ``start_read``, before a job reaches the loop;
- :mod:`.copier`: ``process_vm_readv`` copies out of a server on this host;
- :mod:`.tokens`: which tokens land where (``TokenWindow``).

Never imports ``serving/`` (nor the reverse): what both halves need lives in
``ucx/``, ``protocol/`` or ``blocks/``.
"""
