"""kvbridge: KV-cache transfer connector for disaggregated LLM serving.

What a vLLM user runs, lower never importing higher: ``topology`` ->
``kernels`` -> ``transfer`` -> ``connector`` -> ``integrations.vllm``, and
beside them ``proxy`` (the P/D proxy; imports none of them). ``reference`` is
the host kvbridge brings for running without vLLM (its paged KV manager, its
engine and HTTP server); nothing on the connector side imports it. ``errors``
and ``http_common`` are shared leaves; ``cli`` (the ``kvbridge`` command) and
``bench`` (what ``kvbridge bench`` runs) sit on top. The map: docs/design.md;
the rule is checked by tests/test_layering.py.
"""

__version__ = "0.1.0"
