"""Helpers of the P/D tests: connector configs, prompts, references, a P/D round trip.

Equal tokens alone do not show a transfer (D recomputing everything answers
the same), so :func:`pd_complete` also returns how D's transfer counters moved.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import httpx

from tests.integrations.vllm.client import (
    EXTERNAL_PREFIX_CACHE_HITS,
    KV_CACHE_USAGE,
    Completion,
    complete,
    metrics,
    poll_metrics,
)
from tests.integrations.vllm.servers import ServerSpec
from tests.ports import free_port, free_port_base

T = TypeVar("T")

BLOCK_SIZE = 128
VOCAB_SIZE = 512  # tiny_model.VOCAB_SIZE (not imported: transformers stays out of pytest)
NUM_NEW_TOKENS = 12

TRANSFERS = "vllm:kvbridge_transfers_total"
FAILURES = "vllm:kvbridge_transfer_failures_total"
BYTES = "vllm:kvbridge_transfer_bytes_total"
SYNC_LOADS = "vllm:kvbridge_sync_loads_total"
PARAMS_REFUSED = "vllm:kvbridge_params_refused_total"
LATE_SYNC_LOADS = "vllm:kvbridge_sync_loads_late_total"
HELD_BYTES = "vllm:kvbridge_held_bytes"
HELD_REQUESTS = "vllm:kvbridge_held_requests"
#: The read timeline's histograms (kvbridge.connector.outputs.PHASE_METRICS): P's, D's.
P_TIMELINE = ("vllm:kvbridge_grant_publish_seconds_count",)
D_TIMELINE = tuple(f"vllm:kvbridge_read_{phase}_seconds_count"
                   for phase in ("queue", "grant", "copy", "collect"))

# per block on D: 2 layers x 2 KV heads x 128 slots x (K+V of 32) x 2 bytes
BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 64 * 2

#: The zero-config connector setting of the issue, as a user types it.
ZERO_CONFIG = {
    "kv_connector": "KVBridgeConnector",
    "kv_connector_module_path": "kvbridge.integrations.vllm",
    "kv_role": "kv_both",
}


def kv_config(policy: str | None = None, **extra: Any) -> str:
    """``--kv-transfer-config`` JSON: the zero config plus a failure policy and extra config."""
    config: dict[str, Any] = dict(ZERO_CONFIG)
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


def pd_spec(model: Path, instance: str) -> ServerSpec:
    """A P/D server of the tiny Llama (bf16, block 128) with the zero config; test_pd.py's
    P ("p") and D ("d"), which other modules share (a server is keyed by its spec)."""
    return ServerSpec(model, dtype="bfloat16", block_size=BLOCK_SIZE,
                      kv_transfer_config=json.dumps(ZERO_CONFIG), instance=instance)


#: A built-in chat template of vLLM's, by name (the float32 tiny Llama has none).
CHAT_TEMPLATE = "template_chatml.jinja"


def fp32_spec(model: Path, instance: str = "", *extra_args: str,
              kv_transfer_config: str = json.dumps(ZERO_CONFIG),
              worker_process: bool = False) -> ServerSpec:
    """A float32 tiny-Llama server (``tiny_llama_fp32``: wide logits, no near ties), by
    default with the zero config; no ``instance``/``extra_args``: test_pd_tp.py's TP 1."""
    return ServerSpec(model, dtype="float32", block_size=BLOCK_SIZE,
                      kv_transfer_config=kv_transfer_config, extra_args=extra_args,
                      instance=instance, worker_process=worker_process)


def tp_specs(model: Path) -> tuple[ServerSpec, ServerSpec]:
    """test_pd_tp.py's TP 1 and TP 2 servers of the float32 tiny Llama, each both P and D
    (TP 1 is ``fp32_spec(model)``); test_pd_mla.py starts them together."""
    return (fp32_spec(model),
            ServerSpec(model, dtype="float32", block_size=BLOCK_SIZE, tensor_parallel_size=2,
                       kv_transfer_config=json.dumps(ZERO_CONFIG)))


#: router_specs' third server: its engine id, and its lease (s) on unread prefills.
ROUTER_THIRD = "router-third"
ROUTER_THIRD_LEASE_S = 5


@cache
def router_third_transfer_port() -> int:
    """The third router server's transfer agent port, one per test run: a restart
    (test_router_faults.py) comes back on the port its first run announced."""
    return free_port_base(1)


def router_specs(model: Path) -> tuple[ServerSpec, ServerSpec, ServerSpec]:
    """test_router.py's P, D and second server, which test_proxy_xpyd.py and
    test_router_faults.py share (started together, by whichever module runs first).
    P has the zero config, D loads asynchronously (a synchronous load the loaded CI
    machine makes miss its deadline fails its request under vLLM's default policy;
    test_pd.py covers synchronous loads); both serve chat. The third, a second P or a
    second D, has the zero config plus what test_router_faults.py needs of the P it
    kills and restarts: a fixed engine id and transfer port (``base_port``) and a short
    lease (``ROUTER_THIRD_LEASE_S``). All three run their worker in a process of its
    own, as vLLM's CPU build does by default (``ServerSpec.worker_process``): the
    deployment behind the router is laid out as a CPU user's is."""
    third = json.loads(kv_config(base_port=router_third_transfer_port(),
                                 lease_s=ROUTER_THIRD_LEASE_S))
    third["engine_id"] = ROUTER_THIRD
    return (fp32_spec(model, "router-p", "--chat-template", CHAT_TEMPLATE,
                      worker_process=True),
            fp32_spec(model, "router-d", "--chat-template", CHAT_TEMPLATE,
                      kv_transfer_config=kv_config(sync_load_max_bytes=0), worker_process=True),
            fp32_spec(model, ROUTER_THIRD, kv_transfer_config=json.dumps(third),
                      worker_process=True))


#: The mixed server's synchronous-load threshold, in blocks (larger loads are asynchronous).
SYNC_BLOCKS = 4


def mixed_spec(model: Path) -> ServerSpec:
    """The tiny Llama's second P/D server (bf16, block 128), shared by several modules:
    as D, loads of up to ``SYNC_BLOCKS`` blocks synchronous and larger ones
    asynchronous, a failed load recomputed; as P, an unread prefill held for 3 s."""
    return ServerSpec(
        model, dtype="bfloat16", block_size=BLOCK_SIZE, instance="mixed",
        kv_transfer_config=kv_config("recompute", sync_load_max_bytes=SYNC_BLOCKS * BLOCK_NBYTES,
                                     lease_s=3),
    )


#: The small P's KV cache, in blocks: what the longest context (8192 tokens) needs, and
#: vLLM's null block.
SMALL_P_BLOCKS = 65


def small_p_spec(model: Path) -> ServerSpec:
    """A P for tests that leave it changed: test_pd.py's cap on unread holds (a cache of
    ``SMALL_P_BLOCKS`` blocks, a 10 s lease), then test_pd_faults.py's P that is stopped
    and killed (no grant board: a same-host reader must ask P before it copies, so a
    stopped P stops its reads). One server for both: the package runs test_pd_api.py,
    which leaves it be, between them (``conftest.MODULE_ORDER``)."""
    return ServerSpec(
        model, dtype="bfloat16", block_size=BLOCK_SIZE, instance="small-p",
        kv_transfer_config=kv_config(lease_s=10, agent={"grant_board": False}),
        extra_args=("--num-gpu-blocks-override", str(SMALL_P_BLOCKS)),
    )


def prompt_ids(num_tokens: int, seed: int = 0) -> list[int]:
    """Random token ids without the special tokens 0 (BOS) and 1 (EOS)."""
    rng = random.Random(num_tokens * 7919 + seed)
    return rng.choices(range(2, VOCAB_SIZE), k=num_tokens)


_WORDS = ("the cache", "block token prefill", "decode memory", "head server", "model layer")
#: Text prompts (the server adds BOS): 40 short ones, and 16 of two to three blocks
#: (their ends differ). For some, a tiny model's first greedy token is half a UTF-8
#: character (a byte token of its byte-level BPE): :func:`first_texts` tells which, on
#: the model a server runs.
TEXT_PROMPTS = [f"{words} {i}" for words in _WORDS for i in range(8)] + [
    f"{' '.join(_WORDS) * 30} {words} {i}" for words in _WORDS[:2] for i in range(8)
]


def first_texts(url: str, model: str, prompts: list[str]) -> list[str]:
    """The text of each prompt's first greedy token, in one request: "" for half a character."""
    body = {"model": model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0,
            "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c["text"] for c in choices]


def at_once(calls: Sequence[Callable[[], T]], timeout_s: float = 600.0) -> list[T]:
    """Run every call in a thread of its own, all at the same time; their results in order.

    Raises:
        AssertionError: naming each call (by index) that raised, or that had not
            returned after ``timeout_s`` (its thread is left to end on its own).
    """
    pool = ThreadPoolExecutor(max_workers=max(1, len(calls)))
    futures = [pool.submit(call) for call in calls]
    done, late = wait(futures, timeout=timeout_s)
    pool.shutdown(wait=False)  # every thread has ended, or is left to end on its own
    failed = {i: f.exception() for i, f in enumerate(futures)
              if f in done and f.exception() is not None}
    if failed or late:
        raise AssertionError(f"of {len(calls)} calls at once, these raised: {failed}; "
                             f"{len(late)} had not returned after {timeout_s:g} s")
    return [f.result() for f in futures]


def answer(url: str, body: dict[str, Any]) -> tuple[list[int], str]:
    """A greedy answer's (tokens, text); a stream's are its events' joined, and it is
    checked to have ended with ``[DONE]`` and no error event."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        if body.get("stream"):
            lines = [line for line in response.iter_lines() if line]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            assert not any("error" in event for event in events), events[-1]
            choices = [c for event in events for c in event["choices"]]
        else:
            response.read()
            choices = response.json()["choices"]
    return ([t for c in choices for t in c.get("token_ids") or []],
            "".join(c["text"] for c in choices))


def answers_at_once(
    url: str, model: str, prompts: list[str], max_tokens: int, *, stream: bool
) -> list[tuple[list[int], str]]:
    """Greedy answers (tokens, text) to ``prompts``, all asked at the same time (``answer``)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    return at_once([partial(answer, url, {**body, "prompt": prompt}) for prompt in prompts])


def prefill(p_url: str, prompt: list[int] | str, **extra: Any) -> dict[str, Any]:
    """Ask P for a prefill to be decoded elsewhere; returns the params it hands out."""
    done = complete(p_url, prompt, 1, kv_transfer_params={"do_remote_decode": True}, **extra)
    params = done.kv_transfer_params
    assert params is not None and params.get("do_remote_prefill"), done.response
    return params


class PDResult(NamedTuple):
    """A P/D completion and how D's counters moved for it."""

    completion: Completion
    params: dict[str, Any]
    num_transfers: float
    num_failures: float
    nbytes: float
    external_hits: float
    num_sync_loads: float


def counters(url: str) -> dict[str, float]:
    """D's transfer counters now (0 for those not exposed yet)."""
    now = metrics(url)
    names = (TRANSFERS, FAILURES, BYTES, EXTERNAL_PREFIX_CACHE_HITS, SYNC_LOADS, PARAMS_REFUSED,
             LATE_SYNC_LOADS)
    return {name: now.get(name, 0.0) for name in names}


def pd_complete(
    p_url: str,
    d_url: str,
    prompt: list[int],
    max_tokens: int = NUM_NEW_TOKENS,
    *,
    expect_transfers: int | None = None,
    **extra: Any,
) -> PDResult:
    """Prefill on P, decode on D with P's params; wait for D's counters to settle.

    Args:
        expect_transfers: worker reads D should count for this request (its TP
            size, or 0 when it needs none); the counters are polled until then.
    """
    before = counters(d_url)
    params = prefill(p_url, prompt)
    done = complete(d_url, prompt, max_tokens, kv_transfer_params=params, **extra)
    if expect_transfers:
        poll_metrics(
            d_url,
            lambda m: (
                m.get(TRANSFERS, 0.0) + m.get(FAILURES, 0.0)
                >= before[TRANSFERS] + before[FAILURES] + expect_transfers
            ),
        )
    after = counters(d_url)
    return PDResult(
        done,
        params,
        after[TRANSFERS] - before[TRANSFERS],
        after[FAILURES] - before[FAILURES],
        after[BYTES] - before[BYTES],
        after[EXTERNAL_PREFIX_CACHE_HITS] - before[EXTERNAL_PREFIX_CACHE_HITS],
        after[SYNC_LOADS] - before[SYNC_LOADS],
    )


def warm_up(p_url: str, d_url: str) -> None:
    """One P/D request, so D's later small loads from P are synchronous (a first
    load from a P is not: it connects to P's ranks)."""
    pd_complete(p_url, d_url, prompt_ids(3, seed=999), 1, expect_transfers=1)


def wait_usage(url: str, at_most: float = 0.0, timeout_s: float = 15.0) -> float:
    """Wait until the server's KV cache usage is ``<= at_most``; returns it."""
    return poll_metrics(
        url, lambda m: m.get(KV_CACHE_USAGE, 1.0) <= at_most + 1e-9, timeout_s=timeout_s
    )[KV_CACHE_USAGE]


@contextmanager
def kvbridge_proxy(p_url: str | list[str], d_url: str | list[str], log_path: Path, *,
                   classic: bool = False) -> Iterator[str]:
    """``kvbridge proxy`` in front of P and D (a URL each, or lists for xPyD; ``classic``:
    without the first-token flow); yields its URL."""
    p_urls = [p_url] if isinstance(p_url, str) else p_url
    d_urls = [d_url] if isinstance(d_url, str) else d_url
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbridge.cli",
                "proxy",
                "--prefill",
                *p_urls,
                "--decode",
                *d_urls,
                "--port",
                str(port),
                "--log-level",
                "warning",
                *(["--classic"] if classic else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvbridge proxy did not start: {log_path.read_text()}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)
