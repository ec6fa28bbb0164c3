"""A worker's KV blocks as both halves of the agent move them.

Modules (import from them; this package exports nothing):

- :mod:`.ranges`: where a read's bytes sit in a rank's own cache blocks, for
  direct reads and same-host copies (both ends list ranges in one order);
- :mod:`.staging`: bounded pools of staging buffers for packed chunks;
- :mod:`.launching`: how a staged chunk's pack or unpack runs (the copy thread, or
  launched on the agent's loop) and how the loop learns it ended.

The cache itself (shapes, strides, plane origins) is ``config.LocalKV``.
"""
