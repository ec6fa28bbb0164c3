"""kvbridge in vLLM: ``KVBridgeConnector``, a ``KVConnectorBase_V1`` (imports vLLM).

Load it with ``"kv_connector": "KVBridgeConnector", "kv_connector_module_path":
"kvbridge.integrations.vllm"`` in ``--kv-transfer-config``. Modules:

- ``connector``: the class vLLM builds, forwarding each call to one half;
- ``scheduler_side`` / ``worker_side``: the halves, onto kvbridge's
  ``ConnectorScheduler`` / ``ConnectorWorker``;
- ``facts``: the engine and its caches as kvbridge sees them;
- ``messages``: what crosses vLLM's process boundaries;
- ``settings``: ``kv_connector_extra_config``;
- ``stats``: transfer stats and their Prometheus metrics.
"""

from kvbridge.integrations.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
