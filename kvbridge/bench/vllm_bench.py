"""vLLM benchmark: TTFT and KV load time of P/D through kvbridge, NixlConnector and colocated.

Called by ``kvbridge bench vllm`` (``kvbridge/bench/cli.py``). For each
configuration in turn (never two at once: the machine may have two cores) it
starts vLLM OpenAI servers of one model (``kvbridge/bench/vllm_servers.py``),
sends the same token-id prompts, and stops them:

- ``colocated``: one server, no connector; TTFT = first streamed token.
- ``kvbridge`` / ``nixl``: a P and a D with ``KVBridgeConnector`` / vLLM's
  ``NixlConnector`` (``kv_buffer_device`` cpu, UCX over tcp/sm), stock settings.
- ``kvbridge-classic``: kvbridge's servers driven with the classic flow below
  (the one NIXL gets), to show what the connector alone does.

The model is one of ``vllm_models.MODEL_KINDS`` (dense, mla, moe, swa, linear),
built at run time, at that kind's block size.

One P/D request, as the client (a proxy) sees it. Classic flow (vLLM's toy
proxy; ``nixl``, ``kvbridge-classic``)::

    t0 POST P (max_tokens 1, do_remote_decode) ── t1 P answers with kv_transfer_params
       POST D (same prompt, those params, stream) ── D loads the KV ── t2 first token
    TTFT = t2 - t0      P = t1 - t0      D = t2 - t1

First-token flow (``kvbridge``: what ``kvbridge proxy`` does by default,
``kvbridge/proxy/first_token.py``): P's token is the client's first token,
and D continues after it::

    t0 POST P (max_tokens 1, do_remote_decode, return_token_ids) ── t1 P answers: token 1
       POST D (prompt + token 1, those params, stream) ── D loads the KV ── t2 token 2
    TTFT = t1 - t0      P = t1 - t0      D = t2 - t1 (D's first token: the answer's second)

Load time is the connector's own: kvbridge's per-read duration
(``vllm:kvbridge_transfer_seconds``) and NIXL's per-transfer duration
(``vllm:nixl_xfer_time_seconds``) from D's ``/metrics``, as sum / count over
the requests of one length. Every prompt is new (seeded random token ids: no
prefix-cache hits), the same list for every configuration; warm-up requests
of every length run first. After the traffic each pair sits idle and the CPU
time of every process and thread is read from /proc over ``idle_s``.

Placement (``cores``): "split" (default) puts P, and the colocated server, on
core 0 and D on core 1, each with one OpenMP thread: every instance has a
"device" of its own, as in a real deployment. "shared" lets every server use
both cores, as the vLLM tests do; there vLLM's worker, which busy-polls its
message queue for 1 s after each step (``shm_broadcast.SpinCondition``),
takes a core from the other server of the pair, and P's prefill or D's step
takes, at random, up to a second longer.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvbridge.bench.proc_cpu import idle_cpu
from kvbridge.bench.vllm_models import (
    BLOCK_SIZES,
    MODEL_KINDS,
    MODEL_LABELS,
    build_model,
    model_shape,
)
from kvbridge.bench.vllm_servers import (
    Sample,
    ServerError,
    VllmServer,
    scrape,
    scrape_when,
    start_all,
    total,
)
from kvbridge.cli.demo.procs import reserve_ports
from kvbridge.proxy import first_token

Progress = Callable[[str, int, int], None]

CONNECTORS: dict[str, dict[str, Any] | None] = {
    "colocated": None,
    # recompute: a load late for its deadline is recomputed, so small loads are
    # synchronous (under vLLM's default "fail" every load is asynchronous)
    "kvbridge": {"kv_connector": "KVBridgeConnector",
                 "kv_connector_module_path": "kvbridge.integrations.vllm",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute"},
    "nixl": {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
}
CONNECTORS["kvbridge-classic"] = CONNECTORS["kvbridge"]
# Per connector, D's metric names: (read-time histogram, bytes, failures).
_LOAD_METRICS = {
    "kvbridge": ("vllm:kvbridge_transfer_seconds", "vllm:kvbridge_transfer_bytes_total",
                 "vllm:kvbridge_transfer_failures_total"),
    "nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred_sum",
             "vllm:nixl_num_failed_transfers_total"),
}
_LOAD_METRICS["kvbridge-classic"] = _LOAD_METRICS["kvbridge"]
_SERVER_TTFT = "vllm:time_to_first_token_seconds"  # from arrival at the server
_QUEUE = "vllm:request_queue_time_seconds"  # waiting, incl. waiting for remote KV
_LOADED_TOKENS = ('vllm:prompt_tokens_by_source_total', 'source="external_kv_transfer"')
_FINISHED = "vllm:request_success_total"

D_MAX_TOKENS = 4  # D streams a few tokens; the first one stops the clock
FULL = {"lengths": [64, 256, 512, 1024, 1500], "requests": 10, "warmup": 2, "idle_s": 10.0}
QUICK = {"lengths": [64, 512], "requests": 2, "warmup": 1, "idle_s": 3.0}


class BenchError(RuntimeError):
    """A server answered with an error or broke a promise of the protocol."""


def text_token_ids(model: Path, vocab_size: int) -> list[int]:
    """Token ids whose text is printable ASCII: prompts of them are valid text.

    Random ids of a byte-level vocabulary make prompts of broken UTF-8, whose
    replacement characters vLLM's detokenizer then mixes into the answer's
    first text; a proxy cannot tell that text whole (``first_token.take``) and
    falls back to the classic flow. Real prompts are text.
    """
    from tokenizers import Tokenizer  # vLLM's dependency; only this benchmark needs it

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = [i for i in range(2, vocab_size)
           if (text := tokenizer.decode([i])) and text.isascii() and text.isprintable()]
    if len(ids) < 16:
        raise ValueError(f"{model}: only {len(ids)} printable ASCII tokens")
    return ids


def prompt_ids(length: int, key: str, vocab: list[int]) -> list[int]:
    """Seeded random token ids drawn from ``vocab`` (``text_token_ids``)."""
    rng = random.Random(f"{length}/{key}")
    return rng.choices(vocab, k=length)


def _body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}


def first_token_s(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    """POST a streamed completion; ``perf_counter()`` when its first token arrived.

    Reads the stream to its end, so the server is idle again on return.
    """
    first: float | None = None
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        if resp.is_error:
            raise BenchError(f"{resp.status_code} from {url}: {resp.read()[:2000]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise BenchError(f"{url} streamed an error: {chunk['error']}")
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
    if first is None:
        raise BenchError(f"{url} streamed no token")
    return first


def colocated_request(client: httpx.Client, servers: list[VllmServer],
                      prompt: list[int]) -> dict[str, float]:
    started = time.perf_counter()
    return {"ttft_s": first_token_s(client, servers[0].url, _body(prompt, D_MAX_TOKENS))
            - started}


def pd_request(client: httpx.Client, servers: list[VllmServer],
               prompt: list[int]) -> dict[str, float]:
    """One P/D request timed as in the module docstring."""
    prefill, decode = servers
    t0 = time.perf_counter()
    resp = client.post(f"{prefill.url}/v1/completions", json=_body(
        prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    t1 = time.perf_counter()
    if resp.is_error:
        raise BenchError(f"{resp.status_code} from P: {resp.text[:2000]}")
    params = resp.json().get("kv_transfer_params")
    if not params:
        raise BenchError(f"P's answer has no kv_transfer_params: {resp.text[:2000]}")
    t2 = first_token_s(client, decode.url, _body(prompt, D_MAX_TOKENS,
                                                  kv_transfer_params=params))
    return {"ttft_s": t2 - t0, "prefill_s": t1 - t0, "decode_s": t2 - t1}


def pd_first_token_request(client: httpx.Client, servers: list[VllmServer],
                           prompt: list[int]) -> dict[str, float]:
    """One P/D request in the first-token flow (module docstring), as ``kvbridge proxy``."""
    prefill, decode = servers
    body = _body(prompt, D_MAX_TOKENS + 1)
    if not first_token.plan(body):
        raise BenchError(f"the first-token flow does not apply to {body}")
    t0 = time.perf_counter()
    resp = client.post(f"{prefill.url}/v1/completions",
                       json=first_token.prefill_body(body, first_token=True))
    t1 = time.perf_counter()
    if resp.is_error:
        raise BenchError(f"{resp.status_code} from P: {resp.text[:2000]}")
    answer = resp.json()
    first, params = first_token.take(answer), answer.get("kv_transfer_params")
    if not params:
        raise BenchError(f"P's answer has no kv_transfer_params: {resp.text[:2000]}")
    if first is None:  # as the proxy: the classic flow for this request
        t2 = first_token_s(client, decode.url, _body(prompt, D_MAX_TOKENS,
                                                      kv_transfer_params=params))
        return {"ttft_s": t2 - t0, "prefill_s": t1 - t0, "decode_s": t2 - t1, "classic": 1.0}
    t2 = first_token_s(client, decode.url, first_token.decode_body(body, first, params))
    return {"ttft_s": t1 - t0, "prefill_s": t1 - t0, "decode_s": t2 - t1, "classic": 0.0}


def _mean_ms(before: list[Sample], after: list[Sample],
             histogram: str) -> tuple[float | None, float]:
    """Mean of a histogram's new observations in ms, and how many there were."""
    count = total(after, f"{histogram}_count") - total(before, f"{histogram}_count")
    seconds = total(after, f"{histogram}_sum") - total(before, f"{histogram}_sum")
    return (1e3 * seconds / count if count else None), count


def _row(name: str, length: int, times: list[dict[str, float]], servers: list[VllmServer],
         before: list[list[Sample]], after: list[list[Sample]]) -> dict[str, Any]:
    """Medians of the client's times plus what the servers' metrics moved by."""
    row: dict[str, Any] = {"prompt_tokens": length, "num_requests": len(times)}
    if "classic" in times[0]:  # first-token flow: requests that fell back to the classic one
        row["num_classic"] = int(sum(t.pop("classic") for t in times))
    for key in times[0]:
        values = [1e3 * t[key] for t in times]
        row[key.removesuffix("_s") + "_ms"] = statistics.median(values)
        row[key.removesuffix("_s") + "_ms_all"] = [round(v, 2) for v in values]
    for server, b, a in zip(servers, before, after, strict=True):  # P's, D's: no HTTP
        row[f"{server.name.lower()}_server_ttft_ms"] = _mean_ms(b, a, _SERVER_TTFT)[0]
    row["d_queue_ms"] = _mean_ms(before[-1], after[-1], _QUEUE)[0]
    if name in _LOAD_METRICS:
        histogram, nbytes, failures = _LOAD_METRICS[name]
        d_before, d_after = before[-1], after[-1]
        row["load_ms"], row["num_reads"] = _mean_ms(d_before, d_after, histogram)
        row["mib_per_request"] = (total(d_after, nbytes) - total(d_before, nbytes)) \
            / len(times) / (1 << 20)
        row["num_failures"] = total(d_after, failures) - total(d_before, failures)
        row["loaded_tokens_per_request"] = (total(d_after, *_LOADED_TOKENS)
                                            - total(d_before, *_LOADED_TOKENS)) / len(times)
        loaded = row["loaded_tokens_per_request"]
        row["bytes_per_loaded_token"] = (row["mib_per_request"] * (1 << 20) / loaded
                                         if loaded else None)
    return row


def core_placement(split: bool, index: int) -> dict[str, Any]:
    """``VllmServer`` arguments that keep a server on the ``index``-th core this process may
    run on (split: 0 is P's or colocated's, 1 D's; the ids come from the affinity mask,
    so a cpuset that starts elsewhere works) or on any (shared)."""
    if not split:
        return {"env": {}, "cpus": None}
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[index % len(allowed)]
    return {"env": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}, "cpus": frozenset({core})}


def config_servers(name: str, model: Path, log_dir: Path, extra: dict[str, Any],
                   split: bool, block_size: int) -> list[VllmServer]:
    """The servers of configuration ``name``: [colocated] or [P, D]."""
    config = CONNECTORS[name]
    if config is None:
        [port] = reserve_ports([1])
        return [VllmServer("colocated", model, port, log_dir / "colocated.log",
                           block_size=block_size, **core_placement(split, 0))]
    if name.startswith("kvbridge") and extra:
        config = {**config, "kv_connector_extra_config": extra}
    ports = reserve_ports([1, 1, 1, 1])
    servers = []
    for core, role, port, side_port in ((0, "P", ports[0], ports[2]),
                                        (1, "D", ports[1], ports[3])):
        placement = core_placement(split, core)
        if name == "nixl":
            placement["env"].update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                                    VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port),
                                    UCX_TLS="tcp,sm,self")
        servers.append(VllmServer(role, model, port, log_dir / f"{name}-{role}.log",
                                  json.dumps(config), block_size=block_size, **placement))
    return servers


def run_config(name: str, model: Path, plan: dict[str, Any], log_dir: Path,
               tick: Callable[[str], None]) -> dict[str, Any]:
    """Start ``name``'s servers, time ``plan``'s requests, measure idle CPU, stop them.

    An error (a server that does not start, a failed request) is recorded in
    the result with the rows measured before it.
    """
    servers = config_servers(name, model, log_dir, plan["kvbridge_extra"],
                             plan["cores"] == "split", plan["block_size"])
    request = {"colocated": colocated_request,
               "kvbridge": pd_first_token_request}.get(name, pd_request)
    vocab = plan["prompt_vocab"]
    result: dict[str, Any] = {"rows": [], "idle_cpu": {},
                              "logs": [str(s.log_path) for s in servers]}
    try:
        start_all(servers)
        with httpx.Client(timeout=600.0) as client:
            for length in plan["lengths"]:
                for i in range(plan["warmup"]):
                    request(client, servers, prompt_ids(length, f"warmup{i}", vocab))
            for length in plan["lengths"]:
                before = [scrape(s.url) for s in servers]
                times = [request(client, servers, prompt_ids(length, str(i), vocab))
                         for i in range(plan["requests"])]
                counts = {_FINISHED: total(before[-1], _FINISHED) + len(times)}
                if name in _LOAD_METRICS:
                    counts[f"{_LOAD_METRICS[name][0]}_count"] = total(
                        before[-1], f"{_LOAD_METRICS[name][0]}_count") + len(times)
                after = [scrape(s.url) for s in servers[:-1]]
                after.append(scrape_when(servers[-1].url, counts))
                result["rows"].append(_row(name, length, times, servers, before, after))
                tick(f"{name} {length} tokens")
        result["idle_cpu"] = idle_cpu({s.name: s.pid for s in servers if s.pid is not None},
                                      plan["idle_s"])
    except (ServerError, BenchError, httpx.HTTPError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for server in servers:
            server.stop()
    return result


def run(quick: bool, lengths: list[int] | None = None, requests: int | None = None,
        connectors: list[str] | None = None, model: str | None = None,
        out: str = "bench-out", kvbridge_extra: dict[str, Any] | None = None,
        cores: str = "split", progress: Progress | None = None,
        model_kind: str = "dense") -> dict[str, Any]:
    """Run every configuration in ``connectors`` one after another; the report.

    Args:
        quick: 2 lengths, 2 requests each, 3 s of idle measurement.
        lengths: Prompt lengths in tokens (overrides the default).
        requests: Timed requests per length (overrides the default).
        connectors: Names from ``CONNECTORS`` in the order to run them.
        model: Model folder; default: the model of ``model_kind`` built into a temp dir.
        out: Server logs go to ``<out>/vllm-logs``.
        kvbridge_extra: ``kv_connector_extra_config`` for kvbridge's P and D.
        cores: "split": P (and colocated) on core 0, D on core 1, one OpenMP
            thread each, as if each instance had a device of its own;
            "shared": every server on every core (``VLLM_CPU_OMP_THREADS_BIND=nobind``).
        model_kind: the model built when ``model`` is not given (``MODEL_KINDS``,
            ``kvbridge/bench/vllm_models.py``); also sets the block size.

    Raises:
        ValueError: an unknown connector name, ``cores`` value or model kind,
            "split" on fewer than 2 cores, or a ``model`` that is not a model folder.
    """
    connectors = connectors or ["colocated", "kvbridge", "kvbridge-classic", "nixl"]
    unknown = set(connectors) - set(CONNECTORS)
    if unknown:
        raise ValueError(f"unknown connectors {sorted(unknown)}; known: {sorted(CONNECTORS)}")
    if model_kind not in MODEL_KINDS:
        raise ValueError(f"model kind {model_kind!r}: expected one of {MODEL_KINDS}")
    if cores not in ("split", "shared"):
        raise ValueError(f"cores {cores!r}: expected 'split' or 'shared'")
    num_cpus = len(os.sched_getaffinity(0))
    if cores == "split" and num_cpus < 2:
        raise ValueError(f"cores 'split' needs 2 cores, this process may use {num_cpus}")
    plan: dict[str, Any] = dict(QUICK if quick else FULL)
    plan["lengths"] = lengths or plan["lengths"]
    plan["requests"] = requests or plan["requests"]
    plan["kvbridge_extra"] = kvbridge_extra or {}
    plan["cores"] = cores
    plan["block_size"] = BLOCK_SIZES[model_kind]
    progress = progress or (lambda _label, _done, _total: None)
    with tempfile.TemporaryDirectory(prefix="kvb-bench-model-") as tmp:
        model_dir = Path(model) if model else build_model(Path(tmp) / "model", model_kind)
        shape = model_shape(model_dir)
        plan["prompt_vocab"] = text_token_ids(model_dir, shape["vocab_size"])
        settings = {**{k: v for k, v in plan.items() if k != "prompt_vocab"},
                    "num_prompt_vocab": len(plan["prompt_vocab"]), "model": str(model) if model else
                    f"{MODEL_LABELS[model_kind]} (built)", "model_kind": model_kind,
                    "shape": shape, "d_max_tokens": D_MAX_TOKENS,
                    "connectors": connectors}
        num_steps, done = len(connectors) * len(plan["lengths"]), []

        def tick(label: str) -> None:
            done.append(label)
            progress(label, len(done), num_steps)

        configs = {name: run_config(name, model_dir, plan, Path(out) / "vllm-logs", tick)
                   for name in connectors}
    return {"settings": settings, "configs": configs}
