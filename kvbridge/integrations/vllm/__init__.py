"""kvbridge in vLLM: ``KVBridgeConnector``, a ``KVConnectorBase_V1``.

Load it with ``"kv_connector": "KVBridgeConnector", "kv_connector_module_path":
"kvbridge.integrations.vllm"`` in ``--kv-transfer-config``. Modules:

- ``connector``: the class vLLM builds, forwarding each call to one half;
- ``scheduler_side`` / ``worker_side``: the halves, onto kvbridge's
  ``ConnectorScheduler`` / ``ConnectorWorker``;
- ``facts``: the engine and its caches as kvbridge sees them;
- ``messages``: what crosses vLLM's process boundaries;
- ``settings``: ``kv_connector_extra_config``;
- ``stats``: transfer stats and their Prometheus metrics;
- ``tiny_model``: a random-weight Llama for trying it without a model hub.

vLLM is imported when ``KVBridgeConnector`` is first looked up (as vLLM's
connector factory does), not by importing this package: ``settings`` and
``facts`` work without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBridgeConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBridgeConnector":
        from kvbridge.integrations.vllm.connector import KVBridgeConnector

        return KVBridgeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
