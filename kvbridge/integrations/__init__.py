"""Adapters that plug kvbridge into serving engines (``vllm/``: vLLM's KV connector API).

Nothing here is imported by ``import kvbridge``: each adapter imports its engine,
which stays an optional dependency.
"""
