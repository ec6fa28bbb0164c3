"""The reference engine: a small, real LLM serving engine that hosts the connector.

Not the product (vLLM users run ``kvbridge.integrations.vllm``): it exists so
that a P/D hand-off runs end to end on any machine, with no vLLM, for the demo,
the tests and the benchmarks. A Llama-style decoder with seeded random weights
and a byte-level tokenizer, paged attention over ``kvbridge.reference.paged``'s KV cache
manager, continuous batching, TP workers as processes.

Main classes:

- :class:`~kvbridge.reference.engine.engine.LLMEngine` (``engine.py``): the synchronous
  core; add requests, call ``step()``; its docstring draws one step.
  :class:`~kvbridge.reference.engine.async_engine.AsyncEngine` (``async_engine.py``)
  steps it on a thread for asyncio callers (the HTTP server,
  ``kvbridge/reference/server.py``).
- :class:`~kvbridge.reference.engine.engine_config.EngineConfig` (``engine_config.py``):
  model, parallelism, cache sizing, batching, connector settings.
- :class:`~kvbridge.reference.engine.scheduler.Scheduler` (``scheduler.py``) with
  :class:`~kvbridge.reference.engine.remote_kv.RemoteKVTracker` (``remote_kv.py``: the
  request states that exist only because of transfers, and what becomes of a
  request whose load failed).
- :class:`~kvbridge.reference.engine.workers.WorkerGroup` (``workers.py``): one process
  per TP rank (``rank_worker.py``, messages in ``worker_ipc.py``), each running
  a :class:`~kvbridge.reference.engine.runner.ModelRunner` (``runner.py``: the model,
  ``model.py``, over paged caches, ``attention.py``).
- ``connector_host.py``: where the connector is plugged in, its scheduler side
  beside the scheduler and a ``ConnectorWorker`` per rank.

Next: ``engine.py``, then ``connector_host.py`` for how an engine hosts the
connector (what vLLM does through ``integrations/vllm``).
"""
