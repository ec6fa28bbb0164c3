"""kvbridge as an SGLang disaggregation transfer backend.

``--disaggregation-transfer-backend kvbridge`` on P and D.

Loaded by SGLang's plugin entry point (``sglang.srt.plugins``), never by
patching SGLang. Each TP rank's scheduler owns one kvbridge transfer agent;
P grants a request's pages when its prefill ends, D reads them into its own
pages (the same agents, grants and kernels as the vLLM connector).

    plugin.py     register(): the backend name, enum member and class hook
    conn.py       sender (P), receiver (D), bootstrap server: SGLang's Common*
                  classes, ending a request only when its pages are quiet
    manager.py    KVBridgeKVManager: the agent, control and outcome threads
    messages.py   control messages on SGLang's ZMQ sockets, authenticated
    caches.py     SGLang's KV buffers as kvbridge planes, topology, compat
    settings.py   KVBRIDGE_* environment variables

Only plugin.py, conn.py and manager.py import SGLang; the rest is tested in
kvbridge's own environment.
"""
