"""``kvbridge proxy`` in front of one P and two Ds (1P2D), and a D that fails after P's
token, with real vLLM servers: every answer equals colocated vLLM's, token for token
and in text.

Servers: test_router.py's three (``pd.router_specs``: the float32 tiny Llama, wide
logits), started here, together, and kept for test_router.py and
test_router_faults.py, which run right after (``conftest.MODULE_ORDER``). The
colocated answers are P's, asked without ``kv_transfer_params``.

A D that fails is a real D behind a small HTTP front (:class:`FailingFront`):
each request carrying P's params goes to D, which reads P's KV and answers;
the front then answers 500 (as vLLM does for a request whose KV load failed)
or, streamed, breaks the connection after three events (as a D that dies
mid-answer). The proxy must have the rest computed again, by the other D or by
the same one (a request without P's params passes the front untouched), from
where the client's tokens end.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.integrations.vllm.client import complete, poll_metrics
from tests.integrations.vllm.pd import (
    FAILURES,
    HELD_REQUESTS,
    NUM_NEW_TOKENS,
    TRANSFERS,
    answer,
    at_once,
    counters,
    kvbridge_proxy,
    prompt_ids,
    router_specs,
    wait_usage,
)
from tests.integrations.vllm.servers import ServersForTest, VllmServer
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RESENT = 'kvbridge_proxy_continuations_resent_total{role="%s"}'
UNFINISHED = "kvbridge_proxy_continuations_unfinished_total"


@pytest.fixture
def servers(vllm_servers: ServersForTest, tiny_llama_fp32: Path
            ) -> tuple[VllmServer, VllmServer, VllmServer]:
    """P, D and the second D (test_router.py's P, D and second P)."""
    p, d, d2 = vllm_servers.shared_all(*router_specs(tiny_llama_fp32))
    return p, d, d2


def body(model: str, prompt: list[int], *, stream: bool) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": NUM_NEW_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}


def colocated(p: VllmServer, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
    done = [complete(p.base_url, prompt, NUM_NEW_TOKENS) for prompt in prompts]
    return [(c.token_ids, c.text) for c in done]


def proxy_metrics(url: str) -> dict[str, float]:
    page = httpx.get(f"{url}/metrics", timeout=30).text
    samples = [line.rsplit(" ", 1) for line in page.splitlines() if not line.startswith("#")]
    return {name: float(value) for name, value in samples}


def test_one_p_two_ds_through_kvbridge_proxy(
    servers: tuple[VllmServer, VllmServer, VllmServer], tmp_path: Path
) -> None:
    """Six requests at once, half streamed: each answer is colocated's, each D read
    three prompts from P (round robin), and P holds nothing afterwards."""
    p, d, d2 = servers
    model = str(p.spec.model)
    prompts = [prompt_ids(n, seed=90 + i) for i, n in enumerate((150, 330, 40, 610, 9, 260))]
    expected = colocated(p, prompts)
    before = {s.base_url: counters(s.base_url) for s in (d, d2)}
    with kvbridge_proxy(p.base_url, [d.base_url, d2.base_url], tmp_path / "proxy.log") as proxy:
        got = at_once([partial(answer, proxy, body(model, prompt, stream=i % 2 == 1))
                       for i, prompt in enumerate(prompts)])
        assert got == expected
        assert proxy_metrics(proxy)[RESENT % "decode"] == 0
    for url, counts in before.items():
        after = poll_metrics(url, lambda m, c=counts: m.get(TRANSFERS, 0.0) + m.get(FAILURES, 0.0)
                             >= c[TRANSFERS] + c[FAILURES] + 3)
        moved = (after[TRANSFERS] - counts[TRANSFERS], after.get(FAILURES, 0) - counts[FAILURES])
        assert moved == (3, 0), (url, moved)
    poll_metrics(p.base_url, lambda m: m.get(HELD_REQUESTS, 1) == 0, timeout_s=15)
    for server in (p, d, d2):
        wait_usage(server.base_url)


class FailingFront:
    """An HTTP front for the D at ``d_url`` that fails every request carrying P's params
    after D has answered it (module docstring); others pass as they are."""

    def __init__(self, d_url: str) -> None:
        self.d_url = d_url
        self.url = f"http://127.0.0.1:{free_port()}"
        self.num_failed = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        async def completions(request: Request) -> Response:
            d_body = json.loads(await request.body())
            fail = bool((d_body.get("kv_transfer_params") or {}).get("do_remote_prefill"))
            self.num_failed += fail
            client = httpx.AsyncClient(base_url=self.d_url, timeout=300)
            if not d_body.get("stream"):
                async with client:
                    response = await client.post("/v1/completions", json=d_body)
                if fail:
                    error = {"message": "D failed after its load (injected by the test)",
                             "type": "InternalServerError", "code": 500}
                    return JSONResponse({"error": error}, 500)
                return Response(response.content, response.status_code,
                                media_type="application/json")
            return StreamingResponse(self._relay(client, d_body, 3 if fail else None),
                                     media_type="text/event-stream")

        async def health() -> Response:  # D's (the proxy probes a D whose stream broke)
            async with httpx.AsyncClient(base_url=self.d_url, timeout=30) as client:
                response = await client.get("/health")
            return Response(response.content, response.status_code)

        app.add_api_route("/v1/completions", completions, methods=["POST"])
        app.add_api_route("/health", health, methods=["GET"])
        return app

    @staticmethod
    async def _relay(client: httpx.AsyncClient, d_body: dict[str, Any], num_events: int | None
                     ) -> AsyncIterator[bytes]:
        """D's events; after ``num_events`` of them the connection breaks (the server's
        stream raises: uvicorn closes the connection mid-body)."""
        async with client, client.stream("POST", "/v1/completions", json=d_body) as response:
            pending, num_sent = b"", 0
            async for chunk in response.aiter_bytes():
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    yield event + b"\n\n"
                    num_sent += 1
                    if num_sent == num_events:
                        raise ConnectionResetError("D died mid-answer (injected by the test)")

    @contextmanager
    def serving(self) -> Iterator[FailingFront]:
        port = int(self.url.rsplit(":", 1)[1])
        server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port,
                                               log_level="critical", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the failing front did not start")
            time.sleep(0.05)
        try:
            yield self
        finally:
            server.should_exit = True
            thread.join(30)


@pytest.mark.parametrize("rest_from", ["other D", "same D"])
def test_a_d_failing_after_ps_token_still_gives_colocateds_answer(
    servers: tuple[VllmServer, VllmServer, VllmServer], tmp_path: Path, rest_from: str
) -> None:
    """A 500 (unary) and a connection broken after three events (streamed) from the D
    asked with P's params: the rest comes from the other D, or from the same one when it
    is the only one, computing the prompt itself; no token twice, none missing, and P
    holds nothing afterwards."""
    p, d, d2 = servers
    model = str(p.spec.model)
    # prompts whose first token is a whole character: they take the first-token flow
    candidates = [prompt_ids(n, seed=110 + i) for i, n in enumerate((200, 45, 380, 130, 70))]
    firsts = [complete(p.base_url, prompt, 1).text for prompt in candidates]
    prompts = [c for c, t in zip(candidates, firsts, strict=True) if t and "\ufffd" not in t][:2]
    assert len(prompts) == 2, firsts
    expected = colocated(p, prompts)
    with FailingFront(d.base_url).serving() as front:
        decode = [front.url, d2.base_url] if rest_from == "other D" else [front.url]
        with kvbridge_proxy(p.base_url, decode, tmp_path / "proxy.log") as proxy:
            got = [answer(proxy, body(model, prompt, stream=i == 1))
                   for i, prompt in enumerate(prompts)]
            resent = proxy_metrics(proxy)
    assert got == expected
    assert front.num_failed == 2
    assert (resent[RESENT % "decode"], resent[RESENT % "prefill"], resent[UNFINISHED]) == \
        (2, 0, 0)
    poll_metrics(p.base_url, lambda m: m.get(HELD_REQUESTS, 1) == 0, timeout_s=15)
    for server in (p, d, d2):
        wait_usage(server.base_url)
