"""UCX transfer agent: wire messages, handshake, grants, reads across ranks.

Entry point: :class:`kvbridge.transfer.agent.TransferAgent` (one per worker).
"""

from kvbridge.transfer.security import prompt_digest

__all__ = ["prompt_digest"]
