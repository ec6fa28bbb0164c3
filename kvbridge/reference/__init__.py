"""The reference host: kvbridge's own small serving engine, which hosts the connector.

Not the product: a vLLM user runs ``kvbridge.integrations.vllm`` (with
``connector``, ``topology``, ``kernels``, ``transfer``) and ``kvbridge.proxy``.
This package exists so that a P/D hand-off runs end to end on any machine
without vLLM, for ``kvbridge demo``, the tests and the benchmarks.

Map (lower never imports higher)::

    paged/      the engine's paged KV cache manager (blocks, prefix hashes, tables)
    engine/     the engine: scheduler, TP workers, model, connector host
    metrics.py  the server's ``/metrics`` (engine + connector families)
    server.py   the engine's OpenAI-style HTTP server (``kvbridge serve``)

It stands on the connector side and never the other way round
(``tests/test_layering.py`` checks it).
"""
