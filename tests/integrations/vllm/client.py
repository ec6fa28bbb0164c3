"""HTTP helpers for the vLLM tests: greedy completions and Prometheus metrics.

Metric names as vLLM 0.32 exposes them on ``/metrics`` (counters carry the
``_total`` suffix that prometheus_client adds; each sample is labelled
``engine`` and ``model_name``):

======================================  ============================================
``PREFIX_CACHE_QUERIES`` / ``_HITS``     local prefix cache, in prompt tokens
``EXTERNAL_PREFIX_CACHE_QUERIES/_HITS``  the KV connector's ("external") hits, tokens
``PROMPT_TOKENS_BY_SOURCE``              label ``source``: local_compute,
                                         local_cache_hit, external_kv_transfer
``KV_CACHE_USAGE``                       fraction of KV blocks in use (0..1); blocks
                                         held only by the prefix cache count as free
``CACHE_CONFIG_INFO``                    value 1; labels ``num_gpu_blocks``,
                                         ``block_size``, ``enable_prefix_caching``...
======================================  ============================================

The counters are updated by the API server after it has answered, so a test
reading them right after a completion polls (``poll_metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import httpx

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
CACHE_CONFIG_INFO = "vllm:cache_config_info"


class Completion(NamedTuple):
    """One choice of a ``/v1/completions`` answer."""

    text: str
    token_ids: list[int]  # the generated tokens (``return_token_ids``)
    prompt_token_ids: list[int]  # the prompt as the server tokenized it (BOS included)
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None  # the connector's, when there is one
    response: dict[str, Any]  # the whole JSON answer


def complete(
    base_url: str,
    prompt: str | Sequence[int],
    max_tokens: int = 16,
    *,
    timeout_s: float = 120.0,
    **extra: Any,
) -> Completion:
    """A greedy completion (``temperature`` 0, ``ignore_eos``, token ids returned).

    Args:
        base_url: ``http://127.0.0.1:PORT`` of a vLLM OpenAI server.
        prompt: Text (the server adds BOS) or token ids (sent as they are).
        max_tokens: Tokens to generate; with ``ignore_eos`` exactly this many.
        timeout_s: For the whole request.
        **extra: Further request fields, overriding the defaults above, e.g.
            ``kv_transfer_params={...}``, ``ignore_eos=False``, ``logprobs=1``.

    Raises:
        httpx.HTTPStatusError: the server answered with an error status (its
            message is in the exception's ``response.text``).
    """
    body: dict[str, Any] = {
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    if response.is_error:
        raise httpx.HTTPStatusError(
            f"{response.status_code} from {base_url}/v1/completions: {response.text[:2000]}",
            request=response.request,
            response=response,
        )
    answer = response.json()
    [choice] = answer["choices"]
    return Completion(
        text=choice["text"],
        token_ids=choice.get("token_ids") or [],
        prompt_token_ids=choice.get("prompt_token_ids") or [],
        finish_reason=choice.get("finish_reason"),
        kv_transfer_params=answer.get("kv_transfer_params"),
        response=answer,
    )


class Sample(NamedTuple):
    """One line of Prometheus text: ``name{labels} value``."""

    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of Prometheus text format 0.0.4 (comments and timestamps dropped)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line.split(" ", 1)[0]:
            name, rest = line.split("{", 1)
            labels_text, rest = rest.rsplit("}", 1)  # values are numbers: the last } closes
            labels = _parse_labels(labels_text)
        else:
            name, rest = line.split(" ", 1)
            labels = {}
        samples.append(Sample(name, labels, float(rest.split()[0])))
    return samples


def _parse_labels(text: str) -> dict[str, str]:
    """``a="x",b="y \\"q\\""`` -> {"a": "x", "b": 'y "q"'}."""
    labels = {}
    i = 0
    while i < len(text):
        eq = text.index("=", i)
        key = text[i:eq].strip().lstrip(",").strip()
        i = eq + 2  # past ="
        value = []
        while text[i] != '"':
            if text[i] == "\\":
                i += 1
                value.append({"n": "\n"}.get(text[i], text[i]))
            else:
                value.append(text[i])
            i += 1
        labels[key] = "".join(value)
        i += 1  # past the closing quote
    return labels


def metric_samples(base_url: str, name: str | None = None) -> list[Sample]:
    """The samples on ``/metrics`` (those named ``name`` if given), labels kept."""
    response = httpx.get(f"{base_url}/metrics", timeout=10.0)
    response.raise_for_status()
    samples = parse_prometheus(response.text)
    return [s for s in samples if name is None or s.name == name]


def metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value summed over all label sets}."""
    sums: dict[str, float] = {}
    for sample in metric_samples(base_url):
        sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def poll_metrics(
    base_url: str,
    until: Callable[[dict[str, float]], bool],
    *,
    timeout_s: float = 10.0,
) -> dict[str, float]:
    """``metrics(base_url)`` once ``until`` holds for it.

    Raises:
        TimeoutError: ``until`` still false after ``timeout_s``; the message has
            the vllm: metrics last read.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        now = metrics(base_url)
        if until(now):
            return now
        if time.monotonic() > deadline:
            shown = {k: v for k, v in now.items() if k.startswith("vllm:") and "_bucket" not in k}
            raise TimeoutError(f"metrics of {base_url} never matched in {timeout_s} s: {shown}")
        time.sleep(0.2)


def cache_config(base_url: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (e.g. "num_gpu_blocks", "block_size").

    With several engines (data parallel) these are engine 0's.
    """
    samples = metric_samples(base_url, CACHE_CONFIG_INFO)
    if not samples:
        raise LookupError(f"{base_url}/metrics has no {CACHE_CONFIG_INFO}")
    return samples[0].labels
