"""The P/D proxy in-process, against small backends that record what they get.

Most backends are plain ASGI apps behind a transport that routes by host (an
unknown host refuses the connection), so the tests see exactly what P and D
receive and can make either fail, stall or break a stream. The health tests at
the end run the same backends as real HTTP servers on loopback (uvicorn), with a
dead one being a bound port that does not listen (connections are refused). The
proxy against real ``kvbridge serve`` processes is in
``tests/integration/test_serve_http.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvbridge.errors import ConfigError
from kvbridge.proxy.app import PDProxy, build_proxy_app
from kvbridge.proxy.config import ProxyConfig, backend_urls
from tests.waiting import wait_until_async

T = TypeVar("T")
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "10.0.0.1",
          "remote_port": 5555, "remote_block_ids": [3, 4], "remote_block_size": 16,
          "remote_num_tokens": 20, "grant": "g"}


@dataclass
class Backend:
    """A fake instance: records bodies; ``mode`` picks how it answers."""

    name: str
    mode: str = "ok"
    bodies: list[dict[str, Any]] = field(default_factory=list)
    num_health_checks: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        async def completions(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            if self.mode == "400":
                return JSONResponse({"error": {"message": "bad max_tokens", "type": "x"}}, 400)
            if self.mode in ("500", "502", "503", "504"):
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}},
                                    int(self.mode))
            if self.mode == "stall":
                await asyncio.sleep(30)
            if body.get("stream"):
                return StreamingResponse(self._events(), media_type="text/event-stream")
            params = PARAMS if self.mode == "ok" and body.get("kv_transfer_params") else None
            return JSONResponse({"answered_by": self.name, "kv_transfer_params": params})

        async def health() -> JSONResponse:
            self.num_health_checks += 1
            return JSONResponse({"status": "ok"}, 200 if self.mode != "sick" else 503)

        app.add_api_route("/v1/completions", completions, methods=["POST"])
        app.add_api_route("/health", health, methods=["GET"])
        return app

    async def _events(self) -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {json.dumps({'from': self.name, 'i': i})}\n\n".encode()
        if self.mode == "break":
            raise httpx.ReadError("connection reset")
        yield b"data: [DONE]\n\n"


class _LiveStream(httpx.AsyncByteStream):
    """A response body read as it is produced (``ASGITransport`` would buffer it whole)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk


class Routes(httpx.AsyncBaseTransport):
    """Sends each request to the backend named by its host; unknown hosts refuse.

    A ``break`` backend's streams are served live, so they can fail mid-way; a
    ``drop`` backend reads the request and closes the connection unanswered.
    """

    def __init__(self, backends: list[Backend]) -> None:
        self._backends = {b.name: b for b in backends}
        self._apps = {b.name: httpx.ASGITransport(app=b.app()) for b in backends}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host not in self._apps:
            raise httpx.ConnectError("connection refused", request=request)
        backend = self._backends[host]
        if backend.mode == "drop":  # got the request, then the connection went away
            backend.bodies.append(json.loads(await request.aread()))
            raise httpx.RemoteProtocolError("server disconnected without a response")
        if backend.mode == "break":
            backend.bodies.append(json.loads(await request.aread()))
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_LiveStream(backend._events()))
        return await self._apps[host].handle_async_request(request)


def run(backends: list[Backend], prefill: list[str], decode: list[str],
        scenario: Callable[[httpx.AsyncClient], Awaitable[T]], **limits: Any) -> T:
    return run_with_proxy(backends, prefill, decode,
                          lambda client, _: scenario(client), **limits)


def run_with_proxy(backends: list[Backend], prefill: list[str], decode: list[str],
                   scenario: Callable[[httpx.AsyncClient, PDProxy], Awaitable[T]],
                   **limits: Any) -> T:
    """``run``, the scenario also given the proxy (to look at its pools)."""
    config = ProxyConfig(backend_urls(prefill), backend_urls(decode), **limits)

    async def main() -> T:
        app = build_proxy_app(config, transport=Routes(backends))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy", timeout=60) as client:
            return await scenario(client, app.state.proxy)

    return asyncio.run(main())


REQUEST = {"prompt": "hi", "max_tokens": 9, "temperature": 0.5, "seed": 3}


def test_prefill_then_decode_with_round_robin() -> None:
    p1, p2, d1, d2 = Backend("p1"), Backend("p2"), Backend("d1"), Backend("d2")

    async def scenario(client: httpx.AsyncClient) -> list[str]:
        answers = []
        for _ in range(4):
            r = await client.post("/v1/completions",
                                  json={**REQUEST, "kv_transfer_params": {"grant": "forged"}})
            assert r.status_code == 200
            answers.append(r.json()["answered_by"])
        return answers

    answers = run([p1, p2, d1, d2], ["p1", "p2"], ["d1", "d2"], scenario)
    assert answers == ["d1", "d2", "d1", "d2"]
    assert len(p1.bodies) == len(p2.bodies) == 2
    for body in p1.bodies + p2.bodies:  # P: one token, unary, asked to keep the KV for D
        assert body == {**REQUEST, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True}}
    for body in d1.bodies + d2.bodies:  # D: the original request with P's params
        assert body == {**REQUEST, "kv_transfer_params": PARAMS}


def test_prefill_without_params_means_decode_prefills_locally() -> None:
    p, d = Backend("p", mode="no-params"), Backend("d")

    async def scenario(client: httpx.AsyncClient) -> int:
        r = await client.post("/v1/completions",
                              json={**REQUEST, "kv_transfer_params": {"x": 1}})
        return r.status_code

    assert run([p, d], ["p"], ["d"], scenario) == 200
    assert d.bodies == [REQUEST]


def test_streams_pass_through() -> None:
    p, d = Backend("p"), Backend("d")

    async def scenario(client: httpx.AsyncClient) -> str:
        r = await client.post("/v1/completions", json={**REQUEST, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.text

    text = run([p, d], ["p"], ["d"], scenario)
    expected = "".join(f"data: {json.dumps({'from': 'd', 'i': i})}\n\n" for i in range(3))
    assert text == expected + "data: [DONE]\n\n"
    assert p.bodies[0]["stream"] is False and d.bodies[0]["stream"] is True


def test_a_stream_that_breaks_ends_with_an_error_event() -> None:
    p, d = Backend("p"), Backend("d", mode="break")

    async def scenario(client: httpx.AsyncClient) -> str:
        return (await client.post("/v1/completions", json={**REQUEST, "stream": True})).text

    text = run([p, d], ["p"], ["d"], scenario)
    events = [e for e in text.split("\n\n") if e]
    assert [json.loads(e[6:])["i"] for e in events[:3]] == [0, 1, 2]
    assert "failed mid-stream" in json.loads(events[3][6:])["error"]["message"]
    assert events[4] == "data: [DONE]"


@pytest.mark.parametrize("failing, mode, stream, status, words", [
    ("p", "400", False, 400, "bad max_tokens"),  # the client's mistake: passed through
    ("p", "500", False, 502, "prefill http://p/v1/completions answered 500: boom"),
    ("p", "stall", False, 502, "prefill http://p/v1/completions did not answer within 0.5 s"),
    ("p", "gone", False, 503, "prefill http://p/v1/completions failed: ConnectError"),
    ("d", "500", False, 502, "decode http://d/v1/completions answered 500: boom"),
    ("d", "500", True, 502, "decode http://d/v1/completions answered 500: boom"),
    ("d", "stall", False, 502, "decode http://d/v1/completions did not answer within 0.5 s"),
    ("d", "stall", True, 502, "decode http://d/v1/completions did not answer within 0.5 s"),
    ("d", "gone", True, 503, "decode http://d/v1/completions failed: ConnectError"),
])
def test_backend_failures_give_clear_errors(failing: str, mode: str, stream: bool, status: int,
                                            words: str) -> None:
    backends = {"p": Backend("p"), "d": Backend("d")}
    backends[failing].mode = mode
    live = [b for b in backends.values() if b.mode != "gone"]

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        async with asyncio.timeout(10):  # never a hang
            return await client.post("/v1/completions", json={**REQUEST, "stream": stream})

    r = run(live, ["p"], ["d"], scenario, prefill_timeout_s=0.5, decode_timeout_s=0.5)
    assert r.status_code == status
    assert words in r.json()["error"]["message"]
    assert len(backends["p"].bodies) == (0 if backends["p"].mode == "gone" else 1)
    if failing == "p":
        assert backends["d"].bodies == []  # no decode after a failed prefill


@pytest.mark.parametrize("body, words", [(b"{", "invalid JSON"), (b"[1]", "JSON object"),
                                         (b'{"prompt": "x", "stream": 1}', "stream must be")])
def test_bad_bodies_get_400_without_backend_calls(body: bytes, words: str) -> None:
    p, d = Backend("p"), Backend("d")

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", content=body)

    r = run([p, d], ["p"], ["d"], scenario)
    assert r.status_code == 400 and words in r.json()["error"]["message"]
    assert p.bodies == d.bodies == []


@pytest.mark.parametrize("modes, status, overall", [
    ({"p1": "ok", "p2": "ok", "d": "ok"}, 200, "ok"),
    ({"p1": "sick", "p2": "ok", "d": "ok"}, 200, "degraded"),
    ({"p1": "ok", "p2": "gone", "d": "sick"}, 503, "down"),
])
def test_health_reports_every_backend(modes: dict[str, str], status: int, overall: str) -> None:
    backends = [Backend(name, mode) for name, mode in modes.items() if mode != "gone"]

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        return await client.get("/health")

    r = run(backends, ["p1", "p2"], ["d"], scenario)
    assert r.status_code == status
    body = r.json()
    assert body["status"] == overall
    reported = {c["url"]: c["ok"] for c in body["prefill"] + body["decode"]}
    assert reported == {f"http://{n}": m == "ok" for n, m in modes.items()}


def test_config_validation() -> None:
    assert backend_urls(["h:1", "https://x/"]) == ("http://h:1", "https://x/")
    assert ProxyConfig(("http://a/",), ("http://b",)).prefill_urls == ("http://a",)
    with pytest.raises(ConfigError, match="prefill_urls"):
        ProxyConfig((), ("http://b",))
    with pytest.raises(ConfigError, match="ftp://b"):
        ProxyConfig(("http://a",), ("ftp://b",))
    with pytest.raises(ConfigError, match="read_timeout_s"):
        ProxyConfig(("http://a",), ("http://b",), read_timeout_s=0)


def test_a_stream_is_never_retried_on_another_decode() -> None:
    p, d1, d2 = Backend("p"), Backend("d1", mode="break"), Backend("d2")

    async def scenario(client: httpx.AsyncClient) -> str:
        return (await client.post("/v1/completions", json={**REQUEST, "stream": True})).text

    text = run([p, d1, d2], ["p"], ["d1", "d2"], scenario)
    assert "failed mid-stream" in text and text.endswith("data: [DONE]\n\n")
    assert len(d1.bodies) == 1 and d2.bodies == []


# --- health: real HTTP servers on loopback -------------------------------------------------


def _bound_socket() -> socket.socket:
    """A loopback port that refuses connections until ``listen()`` (no other taker meanwhile)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()
    return f"http://{host}:{port}"


@contextlib.asynccontextmanager
async def serving(backend: Backend, sock: socket.socket) -> AsyncIterator[None]:
    """``backend`` as a uvicorn server on ``sock`` until the block ends."""
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(backend.app(), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))

    def started() -> bool:
        if task.done():
            task.result()  # raises what stopped it
        return server.started

    await wait_until_async(started, 10, message="the backend's server to start")
    try:
        yield
    finally:
        server.should_exit = True
        await task


@dataclass
class Clock:
    """Monotonic time the test moves by hand (no sleeping for back-offs)."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


def run_live(prefill: list[socket.socket], decode: list[socket.socket],
             scenario: Callable[[httpx.AsyncClient, PDProxy], Awaitable[T]], clock: Clock,
             live: list[tuple[Backend, socket.socket]], **limits: Any) -> T:
    """The proxy in-process, its backends real servers; the sockets not in ``live`` refuse."""
    config = ProxyConfig(tuple(map(_url, prefill)), tuple(map(_url, decode)), **limits)

    async def main() -> T:
        async with contextlib.AsyncExitStack() as stack:
            for backend, sock in live:
                await stack.enter_async_context(serving(backend, sock))
            app = build_proxy_app(config, clock=clock)
            client = await stack.enter_async_context(httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=30))
            proxy: PDProxy = app.state.proxy
            try:
                return await scenario(client, proxy)
            finally:
                await proxy.aclose()

    try:
        return asyncio.run(main())
    finally:
        for sock in prefill + decode:
            sock.close()


@contextlib.asynccontextmanager
async def dropping(sock: socket.socket, accepted: list[int]) -> AsyncIterator[None]:
    """A server on ``sock`` that closes every connection unanswered, counting them."""

    async def drop(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    server = await asyncio.start_server(drop, sock=sock)
    async with server:
        yield


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("death", ["refuses", "drops"])
def test_a_dead_prefill_backend_is_skipped_and_every_request_succeeds(
        death: str, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    dead, p_sock, d_sock = _bound_socket(), _bound_socket(), _bound_socket()
    p, d = Backend("p"), Backend("d")
    accepted: list[int] = []
    num_requests = 5

    async def scenario(client: httpx.AsyncClient, proxy: PDProxy) -> list[int]:
        async with contextlib.AsyncExitStack() as stack:
            if death == "drops":
                await stack.enter_async_context(dropping(dead, accepted))
            codes = []
            for _ in range(num_requests):
                r = await client.post("/v1/completions", json={**REQUEST, "stream": stream})
                codes.append(r.status_code)
            assert proxy.prefill_pool.is_down(_url(dead))
            assert not proxy.prefill_pool.is_down(_url(p_sock))
            return codes

    codes = run_live([dead, p_sock], [d_sock], scenario, Clock(), [(p, p_sock), (d, d_sock)])
    assert codes == [200] * num_requests
    assert len(p.bodies) == len(d.bodies) == num_requests  # the first one by retry
    retries = [r for r in caplog.records if "retrying on another prefill" in r.getMessage()]
    assert len(retries) == 1  # after the first failure the dead one was skipped
    assert accepted == ([1] if death == "drops" else [])
    assert p.num_health_checks == 0  # a healthy backend is not probed on the request path


def test_all_prefill_backends_dead_gives_503_with_each_reason() -> None:
    p1, p2, d_sock = _bound_socket(), _bound_socket(), _bound_socket()
    d = Backend("d")
    p_urls = [_url(p1), _url(p2)]

    async def scenario(client: httpx.AsyncClient, _proxy: PDProxy) -> list[httpx.Response]:
        return [await client.post("/v1/completions", json=REQUEST) for _ in range(2)]

    answers = run_live([p1, p2], [d_sock], scenario, Clock(), [(d, d_sock)])
    for r in answers:  # the first tried both; the second probed both, in vain
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["type"] == "service_unavailable"
        assert error["message"].startswith("no prefill backend is usable")
        assert all(f"{url}: " in error["message"] for url in p_urls)
    first = answers[0].json()["error"]["message"]
    for url in p_urls:
        assert f"prefill {url}/v1/completions failed: ConnectError" in first
    assert "health check: ConnectError" in answers[1].json()["error"]["message"]
    assert d.bodies == []


def test_no_usable_decode_refuses_before_prefill() -> None:
    p_sock, dead = _bound_socket(), _bound_socket()
    p = Backend("p")

    async def scenario(client: httpx.AsyncClient, _proxy: PDProxy) -> list[httpx.Response]:
        return [await client.post("/v1/completions", json=REQUEST) for _ in range(2)]

    answers = run_live([p_sock], [dead], scenario, Clock(), [(p, p_sock)])
    assert [r.status_code for r in answers] == [503, 503]
    assert all("no decode backend is usable" in r.json()["error"]["message"] for r in answers)
    assert len(p.bodies) == 1  # only the first request, before D was known to be down


def test_a_recovered_backend_is_used_again_after_the_backoff() -> None:
    p1_sock, p2_sock, d_sock = _bound_socket(), _bound_socket(), _bound_socket()
    p1, p2, d = Backend("p1"), Backend("p2"), Backend("d")
    clock = Clock()

    async def scenario(client: httpx.AsyncClient, _proxy: PDProxy) -> None:
        async def complete() -> None:
            assert (await client.post("/v1/completions", json=REQUEST)).status_code == 200

        await complete()  # p1 refuses -> marked down, retried on p2
        async with serving(p1, p1_sock):
            for _ in range(3):  # p1 is back, but its back-off still runs
                await complete()
            assert (len(p1.bodies), len(p2.bodies), p1.num_health_checks) == (0, 4, 0)
            clock.now_s += 2.5  # past the back-off: p1 is probed, then used again
            for _ in range(4):
                await complete()
            assert (len(p1.bodies), len(p2.bodies), p1.num_health_checks) == (2, 6, 1)

    run_live([p1_sock, p2_sock], [d_sock], scenario, clock, [(p2, p2_sock), (d, d_sock)],
             unhealthy_backoff_s=2.0)


def test_the_only_backend_serves_as_soon_as_it_is_back() -> None:
    p_sock, d_sock = _bound_socket(), _bound_socket()
    p, d = Backend("p"), Backend("d")

    async def scenario(client: httpx.AsyncClient, _proxy: PDProxy) -> list[int]:
        codes = [(await client.post("/v1/completions", json=REQUEST)).status_code]
        async with serving(p, p_sock):  # back within its back-off: no one else to use
            codes.append((await client.post("/v1/completions", json=REQUEST)).status_code)
        return codes

    assert run_live([p_sock], [d_sock], scenario, Clock(), [(d, d_sock)]) == [503, 200]
    assert (len(p.bodies), p.num_health_checks) == (1, 1)


def test_a_backend_failing_its_probe_stays_skipped() -> None:
    p1_sock, p2_sock, d_sock = _bound_socket(), _bound_socket(), _bound_socket()
    p1, p2, d = Backend("p1", mode="sick"), Backend("p2"), Backend("d")
    clock = Clock()

    async def scenario(client: httpx.AsyncClient, _proxy: PDProxy) -> None:
        assert (await client.post("/v1/completions", json=REQUEST)).status_code == 200
        async with serving(p1, p1_sock):
            clock.now_s += 1.5
            for _ in range(3):  # probed once, answers 503 on /health: a new back-off
                assert (await client.post("/v1/completions", json=REQUEST)).status_code == 200
        assert (p1.bodies, len(p2.bodies), p1.num_health_checks) == ([], 4, 1)

    run_live([p1_sock, p2_sock], [d_sock], scenario, clock, [(p2, p2_sock), (d, d_sock)],
             unhealthy_backoff_s=1.0)


@pytest.mark.parametrize("role", ["p", "d"])
def test_a_dropped_connection_is_retried_for_prefill_only(role: str) -> None:
    backends = {n: Backend(n) for n in ("p1", "p2", "d1", "d2")}
    backends[f"{role}1"].mode = "drop"

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", json=REQUEST)

    r = run(list(backends.values()), ["p1", "p2"], ["d1", "d2"], scenario)
    num_bodies = {n: len(b.bodies) for n, b in backends.items()}
    if role == "p":  # P's answer never reaches the client: safe to ask another P
        assert r.status_code == 200 and r.json()["answered_by"] == "d1"
        assert num_bodies == {"p1": 1, "p2": 1, "d1": 1, "d2": 0}
    else:  # D may already be reading P's blocks: no second reader
        assert r.status_code == 502
        assert "decode http://d1/v1/completions failed: RemoteProtocolError" in \
            r.json()["error"]["message"]
        assert num_bodies == {"p1": 1, "p2": 0, "d1": 1, "d2": 0}


def test_a_500_fails_its_request_only_and_the_backend_keeps_serving() -> None:
    p1, p2, d = Backend("p1", mode="500"), Backend("p2"), Backend("d")

    async def scenario(client: httpx.AsyncClient, proxy: PDProxy) -> list[int]:
        codes = [(await client.post("/v1/completions", json=REQUEST)).status_code
                 for _ in range(3)]
        assert not proxy.prefill_pool.is_down("http://p1")
        return codes

    # p1 answered (P may hold the prompt): no retry, 502; a 500 says nothing about
    # p1 itself (vLLM's answer to one failed request): round robin goes on through it
    assert run_with_proxy([p1, p2, d], ["p1", "p2"], ["d"], scenario) == [502, 200, 502]
    assert (len(p1.bodies), len(p2.bodies)) == (2, 1)


@pytest.mark.parametrize("status, num_later_on_d1", [
    ("500", 2),  # e.g. D's KV load failed under vLLM's kv_load_failure_policy "fail"
    ("503", 0), ("502", 0), ("504", 0),  # the server (or a gateway before it) cannot serve
    ("stall", 0),  # no answer within the limit
])
def test_only_answers_about_the_server_shift_load_away_from_a_decode(
        status: str, num_later_on_d1: int) -> None:
    """Two Ds: d1 fails one request; of the four later ones it gets its round-robin
    share, unless its failure said the server itself cannot serve (then d2 takes them
    for the back-off)."""
    p, d1, d2 = Backend("p"), Backend("d1", mode=status), Backend("d2")

    async def scenario(client: httpx.AsyncClient, proxy: PDProxy) -> list[int]:
        codes = [(await client.post("/v1/completions", json=REQUEST)).status_code]
        assert proxy.decode_pool.is_down("http://d1") == (num_later_on_d1 == 0)
        d1.mode = "ok"
        for _ in range(4):
            codes.append((await client.post("/v1/completions", json=REQUEST)).status_code)
        return codes

    codes = run_with_proxy([p, d1, d2], ["p"], ["d1", "d2"], scenario, decode_timeout_s=0.5)
    assert codes == [502, 200, 200, 200, 200]  # classic flow: D's failure is the client's
    assert (len(d1.bodies), len(d2.bodies)) == (1 + num_later_on_d1, 4 - num_later_on_d1)
