"""vLLM soak behind vllm-router: 2P1D with KVBridgeConnector, servers SIGKILLed at random.

``python -m benchmarks.soak_vllm --duration 300 --rate 2 --seed 1`` starts on
loopback, as real processes (the tiny float32 Llama of the vLLM tests, built
on the spot unless ``--model``)::

    P1, P2  vLLM, KVBridgeConnector (zero config, lease --lease)   killed at random
    D       vLLM, KVBridgeConnector (zero config, --d-policy)       killed at random (--kill-d)
    R       vllm-router --vllm-pd-disaggregation --kv-connector nixl, round robin,
            health checks every second (a dead backend leaves the rotation, a
            restarted one comes back)

A pool of greedy requests (prompts sharing prefixes, 1-16 new tokens) is
answered by P1 alone first (colocated). Then requests arrive through R as a
Poisson process at ``--rate`` per second (at most ``--max-in-flight`` at once),
40 % streamed. At random (exponential gaps, mean ``--fault-every`` s) one
server's whole process group gets SIGKILL: a P, or D with probability
``--kill-d``; it comes back on the same port ``--down-s`` later (as a new
engine: vLLM makes up an engine id at each start). Each request ends in one
bucket:

    right        the colocated token ids (a complete answer or stream)
    clean error  an HTTP error status with a message, or an SSE error event
    torn         a stream R closed when D died under it; its tokens so far are
                 the colocated answer's first ones
    wrong        anything else: other tokens, an error without a message
    late         no end within ``--timeout``

After the load every server must settle: nothing running, nothing held for a
transfer (``vllm:kvbridge_held_requests``), ``vllm:kv_cache_usage_perc`` 0;
what is not is counted as leaked. D must map the grant boards of the live
P's and its own only (``d_board_maps``: a dead P's would be its memory kept).
Prints one JSON summary (also ``--json PATH``); exits 1 unless ``wrong == 0``,
``late == 0``, nothing leaked and some answers were right. Not in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.soak_common import Job, Tally, print_summary
from kvbridge.bench.serve_configs import FrontEnd, vllm_router
from kvbridge.bench.vllm_servers import VllmServer, group_pids, scrape, total
from kvbridge.cli.demo.procs import reserve_ports

_HEALTH = ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "5",
           "--health-failure-threshold", "1", "--health-success-threshold", "1"]
_VOCAB = range(2, 512)  # the tiny model's, without BOS and EOS
_ZERO = {"kv_connector": "KVBridgeConnector",
         "kv_connector_module_path": "kvbridge.integrations.vllm", "kv_role": "kv_both"}


@dataclass
class Fleet:
    """The servers by name, each replaced by a new one when restarted."""

    servers: dict[str, VllmServer]
    log_dir: Path
    incarnation: Counter[str] = field(default_factory=Counter)
    faults: list[str] = field(default_factory=list)

    def kill(self, name: str) -> None:
        server = self.servers[name]
        assert server.pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        while group_pids(server.pid):
            time.sleep(0.05)
        server.stop()  # reaps it and removes its TMPDIR

    def relaunch(self, name: str) -> VllmServer:
        """Start ``name`` again on its port (``wait_ready`` it). On the main thread: a
        server gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG)."""
        self.incarnation[name] += 1
        old = self.servers[name]
        new = dataclasses.replace(
            old, log_path=self.log_dir / f"{name}-{self.incarnation[name]}.log")
        new.launch()
        self.servers[name] = new
        return new


def build_model(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "kvbridge.integrations.vllm.tiny_model", str(out),
                    "--dtype", "float32", "--initializer-range", "0.2"],
                   check=True, capture_output=True, timeout=300)
    return out


def make_pool(rng: random.Random, num: int) -> list[list[int]]:
    """Prompts of 20-700 token ids; about half start with one of four shared prefixes."""
    prefixes = [rng.choices(_VOCAB, k=rng.randint(100, 400)) for _ in range(4)]
    pool = []
    for _ in range(num):
        head = rng.choice(prefixes) if rng.random() < 0.5 else []
        pool.append(head + rng.choices(_VOCAB, k=rng.randint(20, 300)))
    return pool


def references(url: str, model: str, prompts: list[list[int]], max_tokens: list[int]
               ) -> list[Job]:
    jobs = []
    for prompt, num in zip(prompts, max_tokens, strict=True):
        body = {"model": model, "prompt": prompt, "max_tokens": num, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        jobs.append(Job(body, tuple(reply["choices"][0]["token_ids"])))
    return jobs


async def ask(client: httpx.AsyncClient, url: str, job: Job, stream: bool, tally: Tally,
              timeout_s: float) -> None:
    started = time.monotonic()
    tokens: list[int] = []
    want = list(job.expected)
    try:
        async with asyncio.timeout(timeout_s), client.stream(
                "POST", f"{url}/v1/completions", json={**job.body, "stream": stream}) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace").strip()
                if text:
                    tally.add("clean_error")
                    tally.errors[f"{r.status_code} {text[:70]}"] += 1
                else:
                    tally.add("wrong", f"status {r.status_code} without a message")
                return
            if not stream:
                got = json.loads(await r.aread())["choices"][0]["token_ids"]
                tally.add("right" if got == want else "wrong", f"{got} != {want}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    tally.add("right" if tokens == want else "wrong", f"{tokens} != {want}")
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    ok = bool(event["error"].get("message")) and tokens == want[:len(tokens)]
                    tally.add("clean_error" if ok else "wrong", f"stream error {event}")
                    tally.errors[f"stream {str(event['error'].get('message'))[:60]}"] += 1
                    return
                tokens += [t for c in event["choices"] for t in c.get("token_ids") or []]
            tally.add("wrong", f"stream without [DONE] after {tokens}")
    except TimeoutError:
        tally.add("late", f"{job.body['max_tokens']} tokens, stream {stream}")
    except httpx.TransportError as exc:  # R cut the stream (D died) or the connection
        torn = stream and tokens == want[:len(tokens)]
        tally.add("torn" if torn else "wrong", f"{exc!r} after {tokens}")
    finally:
        tally.max_latency_s = max(tally.max_latency_s, time.monotonic() - started)


async def load(args: argparse.Namespace, url: str, jobs: list[Job], tally: Tally,
               rng: random.Random) -> None:
    end_at = time.monotonic() + args.duration
    slots = asyncio.Semaphore(args.max_in_flight)
    tasks: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:

        async def one(job: Job, stream: bool) -> None:
            async with slots:
                await ask(client, url, job, stream, tally, args.timeout)

        while time.monotonic() < end_at:
            await asyncio.sleep(rng.expovariate(args.rate))
            tally.counts["sent"] += 1
            task = asyncio.create_task(one(rng.choice(jobs), rng.random() < 0.4))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


async def faults(args: argparse.Namespace, fleet: Fleet, rng: random.Random,
                 started: float) -> None:
    """Kill one server at a time at random, bring it back after ``down_s``; stop in time
    for the last one to be back before the load ends."""
    end_at = started + args.duration
    while True:
        gap = rng.expovariate(1 / args.fault_every)
        if time.monotonic() + gap + args.down_s + 60 > end_at:
            return
        await asyncio.sleep(gap)
        name = "D" if rng.random() < args.kill_d else rng.choice(["P1", "P2"])
        at = time.monotonic() - started
        await asyncio.to_thread(fleet.kill, name)
        await asyncio.sleep(args.down_s)
        await asyncio.to_thread(fleet.relaunch(name).wait_ready)
        fleet.faults.append(f"{name} killed at {at:.0f} s, back at "
                            f"{time.monotonic() - started:.0f} s")
        print(fleet.faults[-1], file=sys.stderr, flush=True)


def settle(fleet: Fleet, timeout_s: float) -> dict[str, dict[str, float]]:
    """Wait until every server is idle with nothing held and no block used."""
    names = ("vllm:num_requests_running", "vllm:kvbridge_held_requests",
             "vllm:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout_s
    while True:
        figures = {}
        for name, server in fleet.servers.items():
            samples = scrape(server.url)
            figures[name] = {metric: total(samples, metric) for metric in names}
        if all(not any(f.values()) for f in figures.values()) or time.monotonic() > deadline:
            return figures
        time.sleep(0.5)


def board_maps(server: VllmServer) -> int:
    """Grant boards mapped by ``server``'s processes (its own and its P's)."""
    assert server.pid is not None
    num = 0
    for pid in group_pids(server.pid):
        with contextlib.suppress(OSError):
            num += Path(f"/proc/{pid}/maps").read_text().count("kvbridge-grant-board")
    return num


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvbridge-soak-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_model(log_dir / "model")
    p_config = json.dumps({**_ZERO, "kv_connector_extra_config": {"lease_s": args.lease}})
    d_config = json.dumps({**_ZERO, "kv_load_failure_policy": args.d_policy})
    ports = reserve_ports([1, 1, 1])
    fleet = Fleet({name: VllmServer(name, model, port, log_dir / f"{name}-0.log", config,
                                    dtype="float32")
                   for name, port, config in zip(("P1", "P2", "D"), ports,
                                                 (p_config, p_config, d_config), strict=True)},
                  log_dir)
    router: FrontEnd | None = None
    try:
        for server in fleet.servers.values():
            server.launch()
        for server in fleet.servers.values():
            server.wait_ready()
        rng = random.Random(args.seed)
        prompts = make_pool(rng, args.pool)
        jobs = references(fleet.servers["P1"].url, str(model), prompts,
                          [rng.randint(1, 16) for _ in prompts])
        router = vllm_router([fleet.servers["P1"].url, fleet.servers["P2"].url],
                             [fleet.servers["D"].url], log_dir / "router.log")
        router.argv += _HEALTH
        router.start()
        tally = Tally()
        started = time.monotonic()

        async def drive() -> None:
            await asyncio.gather(load(args, router.url, jobs, tally, random.Random(args.seed + 1)),
                                 faults(args, fleet, random.Random(args.seed + 2), started))

        asyncio.run(drive())
        figures = settle(fleet, args.settle_s)
        d_figures = scrape(fleet.servers["D"].url)
        leaked = {name: f for name, f in figures.items() if any(f.values())}
        counts = tally.counts
        return {
            "command": "python -m benchmarks.soak_vllm " + " ".join(sys.argv[1:]),
            "duration_s": args.duration, "rate": args.rate,
            "sent": counts["sent"], "right": counts["right"],
            "clean_error": counts["clean_error"], "torn": counts["torn"],
            "wrong": counts["wrong"], "late": counts["late"],
            "faults": fleet.faults, "leaked": leaked, "settled": figures,
            "d_board_maps": board_maps(fleet.servers["D"]),
            "d_transfers_since_its_start": total(d_figures, "vllm:kvbridge_transfers_total"),
            "d_transfer_failures_since_its_start": total(
                d_figures, "vllm:kvbridge_transfer_failures_total"),
            "max_latency_s": round(tally.max_latency_s, 2), "deadline_s": args.timeout,
            "errors": dict(tally.errors.most_common(8)), "wrong_examples": tally.examples,
            "logs": str(log_dir),
        }
    finally:
        if router is not None:
            router.stop()
        for server in fleet.servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--max-in-flight", type=int, default=8, help="requests at once, at most")
    parser.add_argument("--fault-every", type=float, default=60.0,
                        help="mean seconds between kills (exponential)")
    parser.add_argument("--kill-d", type=float, default=0.25,
                        help="probability that a kill hits D rather than a P")
    parser.add_argument("--down-s", type=float, default=3.0,
                        help="a killed server stays dead this long before it restarts")
    parser.add_argument("--lease", type=float, default=10.0, help="P's lease_s")
    parser.add_argument("--d-policy", choices=("fail", "recompute"), default="fail",
                        help="D's kv_load_failure_policy")
    parser.add_argument("--timeout", type=float, default=120.0, help="the request deadline")
    parser.add_argument("--pool", type=int, default=60, help="distinct requests")
    parser.add_argument("--settle-s", type=float, default=60.0,
                        help="longest wait for every server to free all blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model folder (default: built)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    summary = run(args)
    print_summary(summary, args.json)
    ok = (summary["wrong"] == 0 and summary["late"] == 0 and not summary["leaked"]
          and summary["right"] > 0 and summary["d_board_maps"] <= 3)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
