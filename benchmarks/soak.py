"""Soak: mixed P/D load with client aborts and one prefill crash; every answer accounted for.

``python -m benchmarks.soak --duration 300`` starts on loopback, as real
processes (``python -m kvbridge.cli``, the code of ``kvbridge serve|proxy``):

    P  serve --role prefill   block 16, NHD, short lease   (killed and restarted once)
    D  serve --role decode    block 32, HND
    C  serve                  colocated reference
    X  proxy --prefill P --decode D

A pool of greedy requests (prompts sharing prefixes, 1-32 new tokens) is answered
by C first. Then ``--concurrency`` clients send pool requests through X for
``--duration`` seconds, unary or streamed; a fraction of them hang up early
(``--abort-fraction``: before the answer, or after a few streamed events). At
``--kill-at`` of the run P's whole process group gets SIGKILL (a prefill host
dying mid-transfer); P comes back on the same ports and engine id after
``--down-s``. Each request ends in exactly one bucket:

    right        200 (or a complete stream) with C's token ids
    clean error  an error status or SSE error event with a message (P down, ...)
    aborted      the client hung up on purpose
    wrong        anything else: other tokens, a torn stream, a body without error

After the load, every live engine must settle: nothing running, nothing held
for a transfer, free blocks == total blocks (``/metrics``); what is not free
then is counted as leaked. Prints one JSON summary (also ``--json PATH``);
exits 1 unless ``wrong == 0``, ``leaked == 0`` and some answers were right.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.soak_common import Job, Tally, print_summary
from kvbridge.cli.demo.procs import reserve_ports

_READY = re.compile(r"kvbridge (serve|proxy) ready on (http://\S+)$")
_START_TIMEOUT_S = 180.0
_MAX_MODEL_LEN = 512
_BASE_TEXTS = (
    "Disaggregated serving moves the prompt's KV cache from prefill to decode. ",
    "A transfer agent serves blocks over UCX and frees them when readers are done. ",
    "0123456789 abcdefghij ",
)


@dataclass
class Proc:
    """A started server process (its own process group) and its URL."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[str] | None = None
    url: str = ""
    #: how Python runs the CLI, and what is added to the environment
    command: tuple[str, ...] = ("-m", "kvbridge.cli")
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "UCX_LOG_LEVEL": "fatal", **self.env}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.command, *self.argv], stdout=subprocess.PIPE,
                stderr=log, text=True, env=env, start_new_session=True)

    def wait_ready(self) -> None:
        """Wait for the ready line (a reader thread: a silent process cannot block us)."""
        assert self.proc is not None and self.proc.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        stdout = self.proc.stdout

        def pump() -> None:
            for line in stdout:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                match = _READY.match(lines.get(timeout=0.5).strip())
            except queue.Empty:
                continue
            if match:
                self.url = match.group(2)
                return
        raise RuntimeError(f"{self.name} did not start; see {self.log}")

    def kill(self) -> None:
        """SIGKILL the whole process group (server and its workers): a host dying."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            self.kill()


def make_pool(rng: random.Random, num_requests: int) -> list[dict[str, Any]]:
    """Greedy requests whose prompts share prefixes (prefix-cache hits on P and D)."""
    pool = []
    for i in range(num_requests):
        base = rng.choice(_BASE_TEXTS) * rng.randint(1, 4)
        prompt = base[: rng.randint(8, len(base))] + f" #{i} " + "x" * rng.randint(0, 40)
        pool.append({"prompt": prompt[:400], "max_tokens": rng.randint(1, 32),
                     "ignore_eos": rng.random() < 0.7, "temperature": 0.0})
    return pool


async def _unary(client: httpx.AsyncClient, url: str, job: Job, tally: Tally) -> None:
    r = await client.post(f"{url}/v1/completions", json=job.body)
    if r.status_code == 200:
        got = tuple(r.json()["choices"][0]["token_ids"])
        if got == job.expected:
            tally.counts["right"] += 1
        else:
            tally.add("wrong", f"unary {job.body}: {got} != {job.expected}")
        return
    _count_error_status(r, tally)


async def _stream(client: httpx.AsyncClient, url: str, job: Job, tally: Tally,
                  hang_up_after: int | None) -> None:
    body = {**job.body, "stream": True}
    tokens: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return _count_error_status(r, tally)
        num_events, done = 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                tally.counts["clean_error"] += 1
                tally.errors[f"stream {event['error']['message'][:60]}"] += 1
                return None
            tokens += event["choices"][0]["token_ids"]
            num_events += 1
            if hang_up_after is not None and num_events >= hang_up_after:
                tally.counts["aborted"] += 1
                return None  # leaving the block closes the connection mid-stream
    if not done:
        tally.add("wrong", f"stream of {job.body} ended without [DONE]")
    elif tuple(tokens) != job.expected:
        tally.add("wrong", f"stream {job.body}: {tokens} != {list(job.expected)}")
    else:
        tally.counts["right"] += 1
    return None


def _count_error_status(r: httpx.Response, tally: Tally) -> None:
    """Count a non-200 answer (read already): a clean error if it names one, else wrong."""
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        tally.add("wrong", f"status {r.status_code} without an error message: {r.text[:200]}")
        return
    tally.counts["clean_error"] += 1
    tally.errors[f"{r.status_code} {message[:60]}"] += 1


async def _client(url: str, jobs: list[Job], end_at: float, rng: random.Random,
                  abort_fraction: float, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        while time.monotonic() < end_at:
            job = rng.choice(jobs)
            tally.counts["sent"] += 1
            aborting = rng.random() < abort_fraction
            started = time.monotonic()
            errors_before = tally.counts["clean_error"]
            try:
                if rng.random() < 0.4:
                    await _stream(client, url, job, tally, rng.randint(1, 3) if aborting else None)
                elif aborting:  # hang up before the answer (maybe during prefill or transfer)
                    try:
                        async with asyncio.timeout(rng.uniform(0.01, 0.5)):
                            await _unary(client, url, job, tally)
                    except TimeoutError:
                        tally.counts["aborted"] += 1
                else:
                    await _unary(client, url, job, tally)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                # the proxy never drops a connection, and answers only well-formed JSON
                tally.add("wrong", f"{exc!r}")
            tally.max_latency_s = max(tally.max_latency_s, time.monotonic() - started)
            if tally.counts["clean_error"] > errors_before:
                await asyncio.sleep(0.2)  # a client backs off after an error


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) (\S+)$", text, re.M)}


def settle(engines: dict[str, Proc], timeout_s: float) -> dict[str, dict[str, float]]:
    """Wait until every engine is idle with all blocks free; return their final figures."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = {name: _metrics(p.url) for name, p in engines.items()}
        idle = all(f["kvbridge_requests_running"] == 0
                   and f["kvbridge_cache_blocks_held_for_transfer"] == 0
                   and f["kvbridge_cache_free_blocks"] == f["kvbridge_cache_total_blocks"]
                   for f in figures.values())
        if idle or time.monotonic() > deadline:
            return figures
        time.sleep(0.25)


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvbridge-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    common = ["serve", "--model", "tiny", "--max-model-len", str(_MAX_MODEL_LEN)]
    p_http, p_transfer, d_transfer = reserve_ports([1, 1, 1])  # disjoint, below ephemeral
    p = Proc("prefill", [*common, "--port", str(p_http), "--role", "prefill", "--block-size",
                         "16", "--kv-layout", "NHD", "--num-blocks", "96", "--transfer-port",
                         str(p_transfer), "--engine-id", "soak-p", "--lease", str(args.lease),
                         *_options(args.prefill_option)],
             log_dir / "prefill.log")
    if args.prefill_chunk_delay_s:
        from tests import slow_serving  # a source checkout's test helper

        p.command = slow_serving.COMMAND
        p.env = slow_serving.chunk_delay_env(args.prefill_chunk_delay_s)
    d = Proc("decode", [*common, "--port", "0", "--role", "decode", "--block-size", "32",
                        "--kv-layout", "HND", "--num-blocks", "48", "--transfer-port",
                        str(d_transfer), *_options(args.decode_option)], log_dir / "decode.log")
    c = Proc("colocated", [*common, "--port", "0", "--num-blocks", "96"],
             log_dir / "colocated.log")
    procs = [p, d, c]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_ready()
        x = Proc("proxy", ["proxy", "--port", "0", "--prefill", p.url, "--decode", d.url,
                           "--timeout", str(args.timeout)], log_dir / "proxy.log")
        procs.append(x)
        x.start()
        x.wait_ready()
        rng = random.Random(args.seed)
        pool = make_pool(rng, args.pool)
        jobs = [Job(body, tuple(httpx.post(f"{c.url}/v1/completions", json=body, timeout=60)
                                .json()["choices"][0]["token_ids"])) for body in pool]
        return _load(args, p, {"prefill": p, "decode": d, "colocated": c}, x, jobs, log_dir)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _options(values: list[str]) -> list[str]:
    """``--transfer-option`` arguments for a server, one per ``NAME=VALUE``."""
    return [arg for value in values for arg in ("--transfer-option", value)]


def _load(args: argparse.Namespace, p: Proc, engines: dict[str, Proc], x: Proc,
          jobs: list[Job], log_dir: Path) -> dict[str, Any]:
    tally = Tally()
    started = time.monotonic()
    end_at = started + args.duration

    async def drive() -> None:
        clients = [_client(x.url, jobs, end_at, random.Random(args.seed * 1000 + i),
                           args.abort_fraction, tally) for i in range(args.concurrency)]
        await asyncio.gather(*clients, _fault(args, p, started))

    asyncio.run(drive())
    figures = settle(engines, args.settle_s)
    leaked = {name: int(f["kvbridge_cache_total_blocks"] - f["kvbridge_cache_free_blocks"])
              for name, f in figures.items()}
    d_figures = figures["decode"]
    counts = tally.counts
    return {
        "command": "python -m benchmarks.soak " + " ".join(sys.argv[1:]),
        "duration_s": args.duration, "concurrency": args.concurrency,
        "sent": counts["sent"], "right": counts["right"], "clean_error": counts["clean_error"],
        "aborted": counts["aborted"], "wrong": counts["wrong"],
        "leaked_blocks": leaked, "leaked_total": sum(leaked.values()),
        "held_for_transfer": {n: f["kvbridge_cache_blocks_held_for_transfer"]
                              for n, f in figures.items()},
        "max_latency_s": round(tally.max_latency_s, 2), "deadline_s": args.timeout,
        "d_transfers": d_figures.get("kvbridge_kv_transfers_total"),
        "d_transfer_failures": d_figures.get("kvbridge_kv_transfer_failures_total"),
        "d_aborted": d_figures.get("kvbridge_requests_aborted_total"),
        "p_restarts": 1 if args.kill_at < 1 else 0,
        "errors": dict(tally.errors.most_common(8)), "wrong_examples": tally.examples,
        "logs": str(log_dir),
    }


async def _fault(args: argparse.Namespace, p: Proc, started: float) -> None:
    """Kill P's process group at ``kill_at`` of the run; bring it back after ``down_s``."""
    if args.kill_at >= 1:
        return
    await asyncio.sleep(args.kill_at * args.duration)
    p.kill()
    await asyncio.sleep(args.down_s)
    await asyncio.to_thread(p.start)
    await asyncio.to_thread(p.wait_ready)
    print(f"prefill killed at {args.kill_at * args.duration:.0f}s, serving again at "
          f"{time.monotonic() - started:.0f}s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=4, help="clients at once")
    parser.add_argument("--abort-fraction", type=float, default=0.15,
                        help="share of requests whose client hangs up early")
    parser.add_argument("--kill-at", type=float, default=0.4,
                        help="kill P at this fraction of the run (>= 1: never)")
    parser.add_argument("--down-s", type=float, default=2.0, help="P stays dead this long")
    parser.add_argument("--lease", type=float, default=5.0, help="P's lease (seconds)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="the proxy's limit on a backend call (the request deadline)")
    parser.add_argument("--pool", type=int, default=40, help="distinct requests")
    parser.add_argument("--settle-s", type=float, default=60.0,
                        help="longest wait for every engine to free all blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a transfer option of P (as serve --transfer-option)")
    parser.add_argument("--prefill-chunk-delay-s", type=float, default=0.0, metavar="SECONDS",
                        help="P waits this long before each data chunk it serves, to widen "
                             "the reads the kill lands in (tests/slow_serving.py: a source "
                             "checkout only)")
    parser.add_argument("--decode-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a transfer option of D (as serve --transfer-option)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    summary = run(args)
    print_summary(summary, args.json)
    ok = summary["wrong"] == 0 and summary["leaked_total"] == 0 and summary["right"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
