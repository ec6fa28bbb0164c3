"""The reading half of a transfer agent (D's side): links to remote ranks, reads.

Modules (import from them; this package exports nothing):

- :mod:`.reads`: ``Reads``, the jobs in flight on the agent's loop, run to
  their outcome (and cancelled);
- :mod:`.jobs`: ``ReadJob`` (one ``start_read``) and ``ReadStats`` (what it cost);
- :mod:`.links`: ``LinkCache``, links by (engine, rank), read plans, stale links
  dropped and the job tried again;
- :mod:`.renewal`: ``LeaseRenewal``, a grant's lease renewed while a read runs long;
- :mod:`.done_reports`: ``DoneReports``, ``ReadDone`` sent without waiting
  (inline reads' in batches);
- :mod:`.outcomes`: ``Outcomes``, finished ids, failed blocks and stats for the
  engine thread;
- :mod:`.link`: ``PeerLink``, the handshaked connection to one remote rank,
  its reply waiters and heartbeat;
- :mod:`.base`: the interface every read strategy implements
  (``BegunRead``: begin, finish or abandon) and what they share
  (``ReaderContext``, ``ItemResult``, ``ReadSetup``);
- :mod:`.strategy`: what to ask for (``prepare``) and which strategy reads a
  plan item (``choose``);
- one module per read strategy: :mod:`.staged` (staging buffers, unpack),
  :mod:`.direct` (straight into our blocks), :mod:`.same_host` (we copy the
  server's blocks ourselves, on its grant board's word or after its go);
- :mod:`.inline`: the same-host copy on the board's word made on the thread
  calling ``start_read``, before a job reaches the loop;
- same-host copies: :mod:`.copy_source` (``CopySource``: the server process,
  its board), :mod:`.cache_maps` (our maps of its caches), :mod:`.copier`
  (one copy shared out over threads), :mod:`.libc` (``process_vm_readv``,
  ``memmove`` through ctypes);
- :mod:`.tokens`: which tokens land where (``TokenWindow``);
- :mod:`.server_meta`: the server's metadata checked against our cache.

Never imports ``serving/`` (nor the reverse): what both halves need lives in
``ucx/``, ``protocol/`` or ``blocks/``.
"""
