"""``kvbridge demo``: a whole P/D deployment on loopback, checked token for token.

``kvbridge/cli/demo/__init__.py`` calls :func:`run_demo`. It starts three processes, each in
its own process group so that its TP workers go down with it::

    P      kvbridge serve --role prefill --tp 2 ...   (transfer agents on T..T+1)
    D      kvbridge serve --role decode  --tp 1 ...   (transfer agent on T')
    proxy  kvbridge proxy --prefill P --decode D

While they start, the same prompts run through an in-process ``LLMEngine``
(TP 1, greedy): the colocated reference. Then the prompts go through the proxy
(streamed, so the client sees the real time to first token), each answer is
compared with the reference and a progress line printed; the concurrent batch
goes last. The table and verdict come from ``report.py``. Every
process started here is stopped on the way out (SIGTERM to its group, SIGKILL
after :data:`STOP_TIMEOUT_S`), also after Ctrl-C, SIGTERM or an error.

Exit codes: 0 every answer matched, 1 a mismatch or an error, 2 bad flags,
130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType

import httpx

from kvbridge.cli.demo.procs import (
    ChildProcess,
    DemoError,
    reserve_ports,
    stop_children,
    wait_ready,
)
from kvbridge.cli.demo.report import (
    DemoPrompt,
    RequestResult,
    TransferDelta,
    build_workload,
    exit_code,
    progress_line,
    render_summary,
    render_table,
)
from kvbridge.errors import ConfigError, KVBridgeError

__all__ = ["DemoConfig", "run_demo", "run_reference"]

_REQUEST_TIMEOUT_S = 120.0
_HOST = "127.0.0.1"
_SAMPLE = re.compile(r"^(\w+) (\S+)$", re.M)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What ``kvbridge demo``'s flags ask for (``None`` flags resolved by ``--quick``)."""

    model: str = "tiny"
    p_tp: int = 2
    d_tp: int = 1
    p_block_size: int = 16
    d_block_size: int = 16
    p_layout: str = "HND"
    d_layout: str = "HND"
    num_prompts: int = 12
    max_tokens: int = 16
    quick: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoConfig:
        """Read the demo's flags; absent ones take the defaults (smaller with ``--quick``)."""
        quick = bool(getattr(args, "quick", False))
        num_prompts = getattr(args, "num_prompts", None)
        max_tokens = getattr(args, "max_tokens", None)
        if num_prompts is None:
            num_prompts = 6 if quick else 12
        if max_tokens is None:
            max_tokens = 8 if quick else 16
        return cls(getattr(args, "model", "tiny"), args.p_tp, args.d_tp, args.p_block_size,
                   args.d_block_size, args.p_layout, args.d_layout, num_prompts, max_tokens,
                   quick)

    def validate(self) -> None:
        """Check both sides as the engine would, before anything starts.

        Raises:
            ConfigError: a TP size the model cannot split over, a bad block
                size, layout or model, or a count below 1.
        """
        from kvbridge.reference.engine.engine_config import EngineConfig
        from kvbridge.topology import KVLayout

        if self.num_prompts < 1 or self.max_tokens < 1:
            raise ConfigError(f"--num-prompts ({self.num_prompts}) and --max-tokens "
                              f"({self.max_tokens}) must be >= 1")
        for tp, block_size, layout in ((self.p_tp, self.p_block_size, self.p_layout),
                                       (self.d_tp, self.d_block_size, self.d_layout)):
            EngineConfig(model=self.model, tp_size=tp, block_size=block_size,
                         kv_layout=KVLayout.parse(layout))


def run_reference(model: str, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """The colocated answers: an in-process ``LLMEngine`` (TP 1), greedy, EOS ignored.

    Returns:
        One list of completion token ids per prompt.
    """
    from kvbridge.reference.engine.engine import LLMEngine
    from kvbridge.reference.engine.engine_config import EngineConfig
    from kvbridge.reference.engine.request import SamplingParams

    with LLMEngine(EngineConfig(model=model, tp_size=1, in_process=True)) as engine:
        outputs = engine.generate(list(prompts),
                                  SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [out.new_token_ids for out in outputs]


@dataclass(frozen=True, slots=True)
class _Answer:
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_remote_tokens: int
    ttft_s: float | None


async def _complete(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> _Answer:
    """One streamed completion through the proxy.

    Raises:
        DemoError: an error status or an error event.
        httpx.HTTPError: the connection failed.
    """
    body = {"prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    ttft_s: float | None = None
    token_ids: list[int] = []
    final: dict[str, object] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise DemoError(f"proxy answered {response.status_code}: "
                            f"{(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise DemoError(str(event["error"].get("message", event["error"])))
            new = event["choices"][0]["token_ids"]
            if new and ttft_s is None:
                ttft_s = time.monotonic() - start
            token_ids += new
            final = event
    if "kvbridge" not in final:
        raise DemoError("the stream ended without a final event")
    stats, usage = final["kvbridge"], final["usage"]
    assert isinstance(stats, dict) and isinstance(usage, dict)
    return _Answer(token_ids, usage["prompt_tokens"], stats["num_cached_tokens"],
                   stats["num_remote_tokens"], ttft_s)


async def _scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """``/metrics`` of ``url`` as ``{name: value}`` (samples without labels)."""
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return {m[1]: float(m[2]) for m in _SAMPLE.finditer(response.text)}


async def _ask(client: httpx.AsyncClient, proxy_url: str, prompt: DemoPrompt,
               expected: list[int], max_tokens: int) -> RequestResult:
    try:
        answer = await _complete(client, proxy_url, prompt.text, max_tokens)
    except (DemoError, httpx.HTTPError, ValueError, KeyError) as exc:
        return RequestResult(prompt, expected, [], error=str(exc) or repr(exc))
    return RequestResult(prompt, expected, answer.token_ids, answer.num_prompt_tokens,
                         answer.num_cached_tokens, answer.num_remote_tokens, answer.ttft_s)


@dataclass(frozen=True, slots=True)
class _Run:
    results: list[RequestResult]
    batch: TransferDelta | None
    total: TransferDelta
    num_p_held: int


async def _drive(proxy_url: str, p_url: str, d_url: str, prompts: Sequence[DemoPrompt],
                 expected: Sequence[list[int]], max_tokens: int) -> _Run:
    """Send the sequential prompts one by one, then the concurrent ones together."""
    num_total = len(prompts)
    results: list[RequestResult] = []

    def done(result: RequestResult) -> RequestResult:
        print(progress_line(result, num_total), flush=True)
        return result

    async with httpx.AsyncClient(timeout=_REQUEST_TIMEOUT_S) as client:
        start = before = after = await _scrape(client, d_url)
        for prompt in (p for p in prompts if not p.concurrent):
            result = await _ask(client, proxy_url, prompt, expected[prompt.index], max_tokens)
            after = await _scrape(client, d_url)
            results.append(done(_with_transfer(result, TransferDelta.between(before, after))))
            before = after
        batch_prompts = [p for p in prompts if p.concurrent]
        batch = None
        if batch_prompts:
            async def one(prompt: DemoPrompt) -> RequestResult:
                return done(await _ask(client, proxy_url, prompt, expected[prompt.index],
                                       max_tokens))

            results += await asyncio.gather(*(one(p) for p in batch_prompts))
            after = await _scrape(client, d_url)
            batch = TransferDelta.between(before, after)
        num_p_held = await _wait_released(client, p_url)
    return _Run(results, batch, TransferDelta.between(start, after), num_p_held)


async def _wait_released(client: httpx.AsyncClient, p_url: str, timeout_s: float = 5.0) -> int:
    """Prefills whose blocks P still holds for readers, after waiting up to ``timeout_s``
    for D's last completion notices to arrive."""
    deadline = time.monotonic() + timeout_s
    while True:
        num_held = int((await _scrape(client, p_url)).get("kvbridge_kv_held_requests", 0))
        if num_held == 0 or time.monotonic() > deadline:
            return num_held
        await asyncio.sleep(0.1)


def _with_transfer(result: RequestResult, delta: TransferDelta) -> RequestResult:
    return RequestResult(result.prompt, result.expected_token_ids, result.token_ids,
                         result.num_prompt_tokens, result.num_cached_tokens,
                         result.num_remote_tokens, result.ttft_s, delta, result.error)


def _start(config: DemoConfig, children: list[ChildProcess]) -> None:
    """Start P, D and the proxy (appending each to ``children`` as soon as it runs)."""
    p_http, d_http, proxy_http, p_xfer, d_xfer = reserve_ports(
        [1, 1, 1, config.p_tp, config.d_tp])  # rank r's agent listens on base + r
    common = ["--model", config.model, "--host", _HOST]
    sides = [("P", "prefill", config.p_tp, config.p_block_size, config.p_layout, p_http, p_xfer),
             ("D", "decode", config.d_tp, config.d_block_size, config.d_layout, d_http, d_xfer)]
    for name, role, tp, block_size, layout, http_port, xfer_port in sides:
        children.append(ChildProcess(name, [
            "serve", "--role", role, *common, "--tp", str(tp), "--block-size", str(block_size),
            "--kv-layout", layout, "--port", str(http_port), "--transfer-port", str(xfer_port),
            "--engine-id", f"demo-{role}"]))
    children.append(ChildProcess("proxy", [
        "proxy", "--prefill", f"http://{_HOST}:{p_http}", "--decode", f"http://{_HOST}:{d_http}",
        "--host", _HOST, "--port", str(proxy_http)]))
    for child in children:
        print(f"  {child.name:<5} {child.command}   (pid {child.proc.pid})", flush=True)


def _run(config: DemoConfig, children: list[ChildProcess]) -> int:
    prompts = build_workload(config.num_prompts, min(config.p_block_size, config.d_block_size),
                             config.quick)
    print(f"kvbridge demo: model {config.model}; P: TP {config.p_tp}, block "
          f"{config.p_block_size}, {config.p_layout} -> D: TP {config.d_tp}, block "
          f"{config.d_block_size}, {config.d_layout}; {len(prompts)} prompts x "
          f"{config.max_tokens} tokens", flush=True)
    _start(config, children)
    start = time.monotonic()
    expected = run_reference(config.model, [p.text for p in prompts], config.max_tokens)
    print(f"colocated reference (in-process LLMEngine, TP 1, greedy): {len(expected)} answers "
          f"in {time.monotonic() - start:.1f} s", flush=True)
    wait_ready(children)
    num_batch = sum(p.concurrent for p in prompts)
    print(f"sending {len(prompts)} prompts through the proxy ({len(prompts) - num_batch} one at "
          f"a time, then {num_batch} at once)", flush=True)
    prefill, decode, proxy = (c.url for c in children)
    assert prefill is not None and decode is not None and proxy is not None  # all ready
    run = asyncio.run(_drive(proxy, prefill, decode, prompts, expected, config.max_tokens))
    results = sorted(run.results, key=lambda r: r.prompt.index)
    print()
    print(render_table(results))
    print(render_summary(results, run.batch, run.total, run.num_p_held), flush=True)
    return exit_code(results)


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


_Handler = Callable[[int, FrameType | None], object] | signal.Handlers


@contextlib.contextmanager
def _signals(handler: _Handler) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` within (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def run_demo(args: argparse.Namespace) -> int:
    """Entry of ``kvbridge demo`` (flags: see ``kvbridge/cli/demo/__init__.py``).

    Returns:
        0 every answer matched, 1 a mismatch or an error, 2 bad flags, 130
        interrupted (Ctrl-C or SIGTERM). Every process started is gone by then.
    """
    config = DemoConfig.from_args(args)
    try:
        config.validate()
    except (ConfigError, ValueError) as exc:
        print(f"kvbridge demo: error: {exc}", file=sys.stderr)
        return 2
    children: list[ChildProcess] = []
    with _signals(_raise_interrupt):
        try:
            return _run(config, children)
        except KeyboardInterrupt:
            print("\nkvbridge demo: interrupted; stopping", file=sys.stderr, flush=True)
            return 130
        except (DemoError, KVBridgeError, httpx.HTTPError, OSError) as exc:
            print(f"kvbridge demo: error: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            with _signals(signal.SIG_IGN):  # a second Ctrl-C must not cut the clean-up short
                start = time.monotonic()
                stop_children(children)
                if children:
                    print(f"stopped {', '.join(c.name for c in children)} in "
                          f"{time.monotonic() - start:.1f} s", flush=True)
