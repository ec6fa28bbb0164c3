"""The HTTP server in-process (httpx ``ASGITransport``) over a real micro engine (TP 1, colocated).

Completions, streamed or not, must carry exactly the tokens the engine
generates; every kind of bad request gets a 4xx with an OpenAI-style error and
the server keeps serving; ``/metrics`` must parse as Prometheus text; a client
that disconnects mid-stream must leave no running request and no held block.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.reference.engine.async_engine import AsyncEngine
from kvbridge.reference.engine.engine import EngineStats
from kvbridge.reference.engine.engine_config import EngineConfig
from kvbridge.reference.engine.request import SamplingParams
from kvbridge.reference.engine.tokenizer import ByteTokenizer
from kvbridge.reference.server import _TextStream, build_app
from tests.reference.engine.helpers import MICRO
from tests.waiting import wait_until_async

T = TypeVar("T")
PROMPT = "The quick brown fox jumps over the lazy dog."
TOKENIZER = ByteTokenizer.for_model(MICRO)


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    engine = AsyncEngine(EngineConfig(model=MICRO, num_blocks=48, in_process=True))
    try:
        yield engine
    finally:
        engine.shutdown()


def run(engine: AsyncEngine, scenario: Callable[[httpx.AsyncClient], Awaitable[T]],
        **app_options: Any) -> T:
    """Run ``scenario`` against a fresh app over ``engine`` (one event loop per test)."""

    async def main() -> T:
        transport = httpx.ASGITransport(app=build_app(engine, **app_options))
        async with httpx.AsyncClient(transport=transport, base_url="http://server",
                                     timeout=60) as client:
            return await scenario(client)

    return asyncio.run(main())


def sse_events(body: str) -> list[Any]:
    """Decoded ``data:`` payloads of an SSE body; checks the framing on the way."""
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


async def reference(engine: AsyncEngine, prompt: str, max_tokens: int) -> list[int]:
    out = await engine.generate(f"ref-{prompt}-{max_tokens}", prompt,
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return out.new_token_ids


async def wait_idle(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    """Until no request runs and every block is free (fails after ``timeout_s``)."""

    def idle(stats: EngineStats) -> bool:
        s = stats.scheduler
        return s.num_running + s.num_waiting == 0 and s.num_free_blocks == s.num_usable_blocks

    await wait_until_async(engine.get_stats, timeout_s, until=idle,
                           message="no request running and every block free",
                           describe=lambda stats: stats.scheduler)


def test_completion_carries_the_engines_tokens(engine: AsyncEngine) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        expected = await reference(engine, PROMPT, 10)
        r = await client.post("/v1/completions", json={
            "model": "micro", "prompt": PROMPT, "max_tokens": 10, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        (choice,) = body["choices"]
        assert choice["token_ids"] == expected
        assert choice["text"] == TOKENIZER.decode(expected)
        assert choice["finish_reason"] == "length"
        assert body["object"] == "text_completion" and body["model"] == "micro"
        assert body["usage"] == {"prompt_tokens": len(PROMPT) + 1, "completion_tokens": 10,
                                 "total_tokens": len(PROMPT) + 11}
        assert body["kv_transfer_params"] is None  # no connector: nothing to hand out
        # Token ids as the prompt: the same as the text after BOS.
        r = await client.post("/v1/completions", json={
            "prompt": TOKENIZER.encode(PROMPT), "max_tokens": 10, "ignore_eos": True})
        assert r.json()["choices"][0]["token_ids"] == expected
        assert r.json()["kvbridge"]["num_cached_tokens"] > 0  # same prompt: prefix hit

    run(engine, scenario)


def test_streamed_completion_equals_the_unary_one(engine: AsyncEngine) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        request = {"prompt": PROMPT[:20], "max_tokens": 7, "ignore_eos": True,
                   "temperature": 0.8, "seed": 7}
        unary = (await client.post("/v1/completions", json=request)).json()
        r = await client.post("/v1/completions", json={**request, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert len(events) == 7  # one event per token
        choices = [e["choices"][0] for e in events]
        assert [c["finish_reason"] for c in choices] == [None] * 6 + ["length"]
        assert sum((c["token_ids"] for c in choices), []) == unary["choices"][0]["token_ids"]
        assert "".join(c["text"] for c in choices) == unary["choices"][0]["text"]
        assert events[-1]["usage"] == unary["usage"]
        assert len({e["id"] for e in events}) == 1

    run(engine, scenario)


def test_stop_strings_cut_the_text(engine: AsyncEngine) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        full = TOKENIZER.decode(await reference(engine, PROMPT, 24))
        stop = full[5:7]
        expected = full[: full.find(stop)]
        request = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stop": [stop]}
        unary = (await client.post("/v1/completions", json=request)).json()["choices"][0]
        assert unary["text"] == expected and unary["finish_reason"] == "stop"
        streamed = sse_events((await client.post("/v1/completions",
                                                 json={**request, "stream": True})).text)
        assert "".join(e["choices"][0]["text"] for e in streamed) == expected
        assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
        await wait_idle(engine)  # the rest of the request was aborted

    run(engine, scenario)


BAD_BODIES = {
    "malformed json": b'{"prompt": "x"',
    "not an object": b'["x"]',
    "wrong prompt type": b'{"prompt": 5}',
    "wrong max_tokens type": b'{"prompt": "x", "max_tokens": "3"}',
    "unknown field": b'{"prompt": "x", "best_of": 2}',
    "missing prompt": b'{"max_tokens": 3}',
    "max_tokens 0": b'{"prompt": "x", "max_tokens": 0}',
    "negative temperature": b'{"prompt": "x", "temperature": -1}',
    "top_p 0": b'{"prompt": "x", "top_p": 0}',
    "empty prompt": b'{"prompt": []}',
    "token outside vocabulary": json.dumps({"prompt": [1, MICRO.vocab_size]}).encode(),
    "prompt beyond max_model_len": json.dumps({"prompt": "y" * MICRO.max_model_len}).encode(),
    "prompt ids beyond max_model_len": json.dumps({"prompt": [7] * 1000}).encode(),
    "empty stop string": b'{"prompt": "x", "stop": ""}',
    "kv_transfer_params not an object": b'{"prompt": "x", "kv_transfer_params": [1]}',
    "kv_transfer_params bad field": b'{"prompt": "x", "kv_transfer_params": '
                                    b'{"remote_port": 70000}}',
    "kv_transfer_params incomplete": b'{"prompt": "x", "kv_transfer_params": '
                                     b'{"do_remote_prefill": true, "remote_host": "h"}}',
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_requests_get_400_and_the_server_keeps_serving(engine: AsyncEngine,
                                                           name: str) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        for stream in (False, True):
            body = BAD_BODIES[name]
            if stream and body.startswith(b'{"prompt"'):
                body = body.replace(b"{", b'{"stream": true, ', 1)
            r = await client.post("/v1/completions", content=body)
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
        ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200

    run(engine, scenario)
    asyncio.run(wait_idle(engine))


def test_other_client_errors(engine: AsyncEngine) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
        assert r.status_code == 404 and "micro" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", content=b'{"prompt": "' + b"z" * 600 + b'"}')
        assert r.status_code == 413 and "512" in r.json()["error"]["message"]
        r = await client.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await client.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()

    run(engine, scenario, max_body_nbytes=512)


def test_health_and_models(engine: AsyncEngine) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "model": "micro", "role": "both",
                                 "tp_size": 1, "engine_id": None}
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["micro"]

    run(engine, scenario)


def test_a_stopped_engine_answers_503() -> None:
    engine = AsyncEngine(EngineConfig(model=MICRO, num_blocks=48, in_process=True))
    engine.shutdown()

    async def scenario(client: httpx.AsyncClient) -> None:
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert (await client.get("/health")).status_code == 503
        assert (await client.get("/metrics")).status_code == 503

    run(engine, scenario)


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"(?:,[a-z_]+="[^"]*")*\})? '
                    r"(-?[0-9.e+-]+|\+Inf|NaN)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples by ``name{labels}``; checks HELP/TYPE headers, histogram buckets and counts."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types and kind in ("counter", "gauge", "histogram")
            types[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, f"bad sample line {line!r}"
        name, labels, value = match.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"{name} has no TYPE line"
        samples[name + (labels or "")] = float(value)
    for name, kind in types.items():
        if kind == "histogram":
            buckets = [v for k, v in samples.items() if k.startswith(f"{name}_bucket")]
            assert buckets == sorted(buckets), f"{name} buckets are not cumulative"
            assert buckets[-1] == samples[f"{name}_count"]
        if kind == "counter":
            assert all(v >= 0 for k, v in samples.items() if k.startswith(name))
    return samples


def test_metrics_parse_and_count(engine: AsyncEngine) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        before = parse_prometheus((await client.get("/metrics")).text)
        for max_tokens in (3, 5):
            r = await client.post("/v1/completions", json={"prompt": "metrics please",
                                                           "max_tokens": max_tokens,
                                                           "ignore_eos": True})
            assert r.status_code == 200
        await client.post("/v1/completions", content=b"{")
        r = await client.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        after = parse_prometheus(r.text)
        # A fresh app has fresh HTTP counters; engine counters only grow.
        assert after['kvbridge_http_completion_responses_total{code="200"}'] == 2
        assert after['kvbridge_http_completion_responses_total{code="400"}'] == 1
        assert after["kvbridge_generation_tokens_total"] == 8
        assert after["kvbridge_time_to_first_token_seconds_count"] == 2
        assert after["kvbridge_engine_steps_total"] >= before["kvbridge_engine_steps_total"] + 8
        assert after["kvbridge_cache_total_blocks"] == 47  # one of 48 is the null block
        assert after["kvbridge_cache_free_blocks"] == 47
        assert after["kvbridge_requests_running"] == 0
        assert after["kvbridge_kv_transfers_total"] == 0
        assert 0 <= after["kvbridge_prefix_cache_hit_rate"] <= 1

    run(engine, scenario)


async def _disconnecting_call(app: Any, body: dict[str, Any], after_chunks: int) -> list[bytes]:
    """Drive the ASGI app by hand: the client vanishes after ``after_chunks`` body chunks."""
    chunks: list[bytes] = []
    gone = asyncio.Event()
    if after_chunks == 0:
        gone.set()
    request_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
        if len(chunks) >= after_chunks:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    async with asyncio.timeout(30):
        await app(scope, receive, send)
    return chunks


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(engine: AsyncEngine, stream: bool) -> None:
    async def scenario() -> None:
        app = build_app(engine)
        long_request = {"prompt": PROMPT, "max_tokens": 150, "ignore_eos": True,
                        "stream": stream}
        chunks = await _disconnecting_call(app, long_request, after_chunks=2 if stream else 0)
        assert len(chunks) < 150 if stream else chunks == []  # it stopped early
        await wait_idle(engine)
        assert app.state.completion_server.metrics.num_aborted == 1

    asyncio.run(scenario())


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6),
       stop=st.text(min_size=1, max_size=3) | st.none())
def test_text_stream_matches_one_shot_decoding(data: bytes, cuts: list[int],
                                               stop: str | None) -> None:
    tokens = list(data)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    text = _TextStream([stop] if stop else [])
    pieces = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        pieces.append(text.push(tokens[a:b], final=b == len(tokens)))
        if text.stopped:
            break  # as the server does
    if len(bounds) == 1:
        pieces.append(text.push([], final=True))
    full = TOKENIZER.decode(tokens)
    if stop and stop in full:
        assert "".join(pieces) == full[: full.find(stop)] and text.stopped
    else:
        assert "".join(pieces) == full and not text.stopped
