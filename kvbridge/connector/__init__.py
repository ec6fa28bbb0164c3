"""The connector: what an engine calls to hand KV from a prefill engine (P) to a decode engine (D).

It sits between an engine and the transfer agent (``kvbridge.transfer``), in
two halves that share one message per step, never one class switched by role:

- :class:`~kvbridge.connector.scheduler.ConnectorScheduler` (``scheduler.py``),
  beside the engine's scheduler: how many prompt tokens a remote P already has,
  what to load once blocks are allocated, what to hold for readers when a
  prefill ends, the ``kv_transfer_params`` to return, and after each step
  what the workers' output settled (``StepOutcome``: loads that ended and
  where their valid KV stops, kept blocks to free). What to do with a failed
  load is the host's policy (vLLM's own; the reference engine's in
  ``kvbridge.reference.engine.remote_kv``). It never touches KV memory or
  the network. Its docstring lists the engine's calls in order; its
  state is in ``loads.py`` (D: loads in flight) and ``held_grants.py`` (P:
  blocks held under a grant).
- :class:`~kvbridge.connector.worker.ConnectorWorker` (``worker.py``), in each
  TP/PP worker process: owns the worker's ``TransferAgent``, carries out each
  step's :class:`~kvbridge.connector.metadata.ConnectorMetadata`
  (``metadata.py``), and reports what finished as a ``WorkerOutput``
  (``outputs.py``).
- :class:`~kvbridge.connector.aggregator.KVOutputAggregator`
  (``aggregator.py``): merges the workers' outputs of one step into one for the
  scheduler side; a request is done only when every worker says so.

Also here: :class:`~kvbridge.connector.params.KVTransferParams` (``params.py``,
the signed params P hands D through the client or proxy), the prompt binding of
a grant (``binding.py``), the engine-facing protocol of a request
(``request.py``), and the connector's statistics and metrics (``stats.py``).

Who calls it: vLLM through the adapter in ``kvbridge.integrations.vllm``
(``scheduler_side.py``, ``worker_side.py``), and kvbridge's reference engine
(``kvbridge.reference.engine``: ``connector_host.py``, ``remote_kv.py``). Next: the call
order in ``scheduler.py``, then ``worker.py``; docs/design.md for the whole
hand-off.
"""
