"""End-to-end benchmark: TTFT and decode tokens/s of P/D hand-off versus colocated serving.

Called by ``kvbridge bench e2e`` (``kvbridge/bench/cli.py``); also a script
(``python -m kvbridge.bench.e2e_bench --quick``).

Three ``LLMEngine``s of the reference model (``tiny`` by default, seeded
weights, CPU) run in this process, each with one TP worker process:

- *colocated*: no connector; a request is prefilled and decoded in one engine
  (with the cache layout the connector picks for P and D, HND);
- *P* and *D*: connector engines on loopback. A request runs on P with
  ``max_tokens=1`` and ``do_remote_decode`` (what the proxy sends), then with
  P's ``kv_transfer_params`` on D, which loads the prompt's KV from P through
  the transfer agents and decodes.

Per request, timed in this process::

    colocated  add ----prefill----> first token ---decode---> last token
    P/D        P.generate(1 token) | D add --load KV--> first token ---decode---> last
               t0                                       TTFT           tokens/s

Worker processes start with ``OMP_WAIT_POLICY=PASSIVE`` (unless set): on a
machine with fewer free cores than busy threads, OpenMP threads that spin at
barriers turned the tiny model's 5-25 ms steps into 50-700 ms ones here, at
random, in either mode.

TTFT runs from submitting the request to its first token on the engine that
streams the answer (D for P/D); decode tokens/s is ``(tokens - 1)`` over the
time from the first to the last token. One thread drives all engines, so P
does not step while D decodes (P's agent serves reads from its own thread). Every
prompt is fresh random bytes (no prefix-cache hits), and the P/D answer must
equal the colocated one token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.cli.demo.procs import reserve_ports
from kvbridge.reference.engine.engine import LLMEngine
from kvbridge.reference.engine.engine_config import ConnectorSettings, EngineConfig
from kvbridge.reference.engine.request import SamplingParams
from kvbridge.topology import KVLayout

Progress = Callable[[str, int, int], None]
"""``progress(what just finished, steps done, total steps)``."""

_IDLE_S = 0.0005
_DEADLINE_S = 300.0
_NUM_BLOCKS = 256


class E2EError(RuntimeError):
    """A request failed or did not finish in time."""


def _free_port() -> int:
    """A free port below the ephemeral range (see ``reserve_ports``)."""
    [port] = reserve_ports([1])
    return port


def _engine(model: str, name: str | None, layout: KVLayout | None = None) -> LLMEngine:
    """An engine whose worker process inherits ``OMP_WAIT_POLICY=PASSIVE``."""
    connector = None if name is None else ConnectorSettings(
        engine_id=f"bench-{name}", transfer_base_port=_free_port())
    config = EngineConfig(model=model, num_blocks=_NUM_BLOCKS, connector=connector,
                          kv_layout=layout)
    had_policy = "OMP_WAIT_POLICY" in os.environ
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        return LLMEngine(config)
    finally:
        if not had_policy:
            del os.environ["OMP_WAIT_POLICY"]


def _finish(engine: LLMEngine, request_id: str, t0: float) -> tuple[list[int], float, float]:
    """Step ``engine`` until ``request_id`` finishes; tokens, first- and last-token times."""
    tokens: list[int] = []
    t_first = 0.0
    deadline = t0 + _DEADLINE_S
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.error is not None:
                raise E2EError(f"{request_id}: {out.error}")
            if out.new_token_ids and not tokens:
                t_first = time.perf_counter()
            tokens += out.new_token_ids
            if out.finished:
                return tokens, t_first, time.perf_counter()
        if time.perf_counter() > deadline:
            raise E2EError(f"{request_id} did not finish in {_DEADLINE_S:.0f} s")
        if engine.last_step_num_tokens == 0:
            time.sleep(_IDLE_S)


def _timings(tokens: list[int], t0: float, t_first: float, t_end: float) -> dict[str, Any]:
    decode_s = t_end - t_first
    return {"ttft_ms": (t_first - t0) * 1e3,
            "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None,
            "num_tokens": len(tokens)}


def run_colocated(engine: LLMEngine, request_id: str, prompt: list[int],
                  params: SamplingParams) -> tuple[list[int], dict[str, Any]]:
    """One request prefilled and decoded on ``engine``."""
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    tokens, t_first, t_end = _finish(engine, request_id, t0)
    return tokens, _timings(tokens, t0, t_first, t_end)


def run_pd(p: LLMEngine, d: LLMEngine, request_id: str, prompt: list[int],
           params: SamplingParams) -> tuple[list[int], dict[str, Any]]:
    """One request prefilled on P and decoded on D after loading its KV."""
    before = d.get_stats().connector
    t0 = time.perf_counter()
    (first,) = p.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True),
                          kv_transfer_params=[{"do_remote_decode": True}])
    t_prefill = time.perf_counter()
    if first.kv_transfer_params is None:
        raise E2EError(f"{request_id}: P returned no kv_transfer_params ({first.error})")
    d.add_request(request_id, prompt, params, first.kv_transfer_params)
    tokens, t_first, t_end = _finish(d, request_id, t0)
    after = d.get_stats().connector
    _settle(p)
    row = _timings(tokens, t0, t_first, t_end)
    row["prefill_ms"] = (t_prefill - t0) * 1e3
    if before is not None and after is not None:
        row["transfer_nbytes"] = after.nbytes - before.nbytes
        row["transfer_ms"] = (after.duration_sum_s - before.duration_sum_s) * 1e3
    return tokens, row


def _settle(engine: LLMEngine) -> None:
    """Step P until its readers' reports freed the held blocks."""
    deadline = time.monotonic() + 30.0
    while engine.has_pending_transfers() and time.monotonic() < deadline:
        engine.step()
        time.sleep(_IDLE_S)


def _median(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def run(quick: bool = False, prompt_lens: Sequence[int] | None = None,
        max_tokens: int | None = None, num_repeats: int | None = None, model: str = "tiny",
        progress: Progress | None = None) -> dict[str, Any]:
    """Measure colocated and P/D at each prompt length.

    Args:
        quick: Prompt lengths 64 and 512, 16 output tokens, 2 repeats.
        prompt_lens: Prompt lengths in tokens (default 64, 512, 1536).
        max_tokens: Output tokens per request (default 64).
        num_repeats: Requests per length and mode (default 5); medians are reported.
        model: Reference model preset.
        progress: Called after each finished request pair.

    Returns:
        ``{"settings", "rows": [{prompt_tokens, mode, ttft_ms, decode_tokens_per_s,
        ...medians}], "requests": [...every request...], "all_match"}``.

    Raises:
        E2EError: a request failed or timed out.
    """
    lens = list(prompt_lens or ([64, 512] if quick else [64, 512, 1536]))
    params = SamplingParams(max_tokens=max_tokens or (16 if quick else 64), ignore_eos=True)
    repeats = num_repeats or (2 if quick else 5)
    rng = random.Random(0)
    engines: list[LLMEngine] = []
    requests: list[dict[str, Any]] = []
    try:
        p = _engine(model, "p")
        engines.append(p)
        d = _engine(model, "d")
        engines.append(d)
        # Same cache layout as P and D (the connector's choice), so that only the
        # hand-off differs; attention reads the cache differently per layout.
        colo = _engine(model, None, d.config.layout)
        engines.append(colo)
        warm = [256, *rng.randbytes(31)]  # handshake, first-step costs
        run_colocated(colo, "warm", warm, params)
        run_pd(p, d, "warm", warm, params)
        total = len(lens) * repeats
        for i, num_tokens in enumerate(x for x in lens for _ in range(repeats)):
            prompt = [256, *rng.randbytes(num_tokens - 1)]
            colo_tokens, colo_row = run_colocated(colo, f"c{i}", prompt, params)
            pd_tokens, pd_row = run_pd(p, d, f"pd{i}", prompt, params)
            match = colo_tokens == pd_tokens
            requests += [{"prompt_tokens": num_tokens, "mode": "colocated", **colo_row},
                         {"prompt_tokens": num_tokens, "mode": "pd", "match": match, **pd_row}]
            if progress is not None:
                progress(f"{num_tokens} tokens", i + 1, total)
    finally:
        for engine in engines:
            engine.shutdown()
    keys = ("ttft_ms", "decode_tokens_per_s", "prefill_ms", "transfer_ms", "transfer_nbytes")
    rows = []
    for num_tokens in lens:
        for mode in ("colocated", "pd"):
            group = [r for r in requests if r["prompt_tokens"] == num_tokens
                     and r["mode"] == mode]
            rows.append({"prompt_tokens": num_tokens, "mode": mode, "num_requests": len(group),
                         **{k: _median(group, k) for k in keys}})
    return {"settings": {"model": model, "max_tokens": params.max_tokens, "repeats": repeats,
                         "prompt_lens": lens, "num_blocks": _NUM_BLOCKS,
                         "kv_layout": str(d.config.layout)},
            "rows": rows, "requests": requests,
            "all_match": all(r.get("match", True) for r in requests)}


def main(argv: list[str] | None = None) -> int:
    """Script entry: print the report as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    json.dump(run(args.quick), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
