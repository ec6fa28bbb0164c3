"""What the connector's scheduler side reads of the engine's objects (read-only).

The engine hands its own request and block objects to ``ConnectorScheduler``
(``scheduler.py``), which passes them on to its D side (``loads.py``) and its
P side (``held_grants.py``). These protocols name the few attributes they read,
so the reference engine's ``EngineRequest`` and vLLM's ``Request`` both fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvbridge.connector.params import KVTransferParams

__all__ = ["BlockIds", "ConnectorRequest"]


class ConnectorRequest(Protocol):
    """What the connector reads of an engine request (read-only)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def kv_transfer_params(self) -> KVTransferParams | None: ...

    @property
    def num_computed_tokens(self) -> int: ...


class BlockIds(Protocol):
    """A request's blocks as the engine hands them over (``paged.manager.KVCacheBlocks``,
    vLLM's ``KVCacheBlocks``): block ids per KV cache group."""

    def get_block_ids(self) -> tuple[list[int], ...]: ...
