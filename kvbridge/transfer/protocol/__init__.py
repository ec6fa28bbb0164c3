"""What two transfer agents agree on: messages, handshake, secrets, shared memory formats.

Modules (import from them; this package exports nothing):

- :mod:`.wire`: every control message (``msgspec`` tagged union), its codec,
  and the data channel of a chunk (``channel_of``);
- :mod:`.handshake`: both halves of the handshake, framed message send/receive;
- :mod:`.security`: cluster secret, HMAC proofs, compatibility hashes,
  ``prompt_digest``;
- :mod:`.host`: same-host copies: whether they are on, and a server's proof of
  who it is on its host (``ProbeCell``);
- :mod:`.grant_board`: the server's board of live grants in its memory, which
  same-host readers read (slot format, writer and lookup).

Used by both halves of the agent (``serving/``, ``reading/``), which never
import each other: what both need lives here, in ``ucx/`` or in ``blocks/``.
"""
