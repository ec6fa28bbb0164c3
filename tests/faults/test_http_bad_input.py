"""Bad HTTP input against real ``kvbridge serve`` (P, D) and ``kvbridge proxy`` processes.

Every malformed or hostile body must get a 4xx with an OpenAI-style error
message, and leave the servers as they were: a good request right after it is
answered correctly, nothing stays running or allocated, and P holds no block
for a decode that will never come. ``tests/reference/engine/test_server.py`` checks the
in-process app's validation; here the same bodies go through sockets, uvicorn
and the proxy, plus the ones that only break there (bytes that are not UTF-8,
``NaN``, nesting deeper than the proxy's JSON parser, bodies over the size
limit, ``kv_transfer_params`` that pass validation but point at nothing).

The reference answer of a prompt is D's own answer without ``kv_transfer_params``
(D then prefills locally, as a colocated engine does).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.integration.served import (
    Served,
    metrics,
    spawn,
    wait_all_ready,
    wait_metrics,
    wait_ready,
)
from tests.ports import free_port

pytestmark = pytest.mark.faults

MAX_MODEL_LEN = 512
MAX_BODY_NBYTES = 16 << 20  # the servers' and the proxy's default limit
GOOD = {"prompt": "The servers keep serving after bad input.", "max_tokens": 6,
        "ignore_eos": True}
GRANT = "A" * 22  # the shape of a grant token, issued by nobody


@dataclass
class PD:
    prefill: Served
    decode: Served
    proxy: Served
    p_transfer_port: int

    def targets(self) -> dict[str, str]:
        return {"prefill": self.prefill.url, "decode": self.decode.url, "proxy": self.proxy.url}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    tmp = tmp_path_factory.mktemp("bad-input")
    common = ["serve", "--port", "0", "--model", "tiny", "--max-model-len", str(MAX_MODEL_LEN)]
    p_port = free_port()
    started: list[Served] = []
    try:
        pending = [
            # a long lease: blocks held for a decode that never comes would show
            spawn(tmp, "prefill", *common, "--role", "prefill", "--num-blocks", "80",
                  "--transfer-port", str(p_port), "--engine-id", "p-bad", "--lease", "600"),
            spawn(tmp, "decode", *common, "--role", "decode", "--block-size", "32",
                  "--num-blocks", "40", "--transfer-port", str(free_port())),
        ]
        started += wait_all_ready(pending)
        started.append(wait_ready(*spawn(tmp, "proxy", "proxy", "--port", "0", "--prefill",
                                         started[0].url, "--decode", started[1].url,
                                         "--timeout", "60")))
        yield PD(started[0], started[1], started[2], p_port)
    finally:
        codes = [served.stop() for served in reversed(started)]
        assert codes == [0] * len(started), codes


def post(url: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/completions", content=content, timeout=60,
                      headers={"content-type": "application/json"})


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text[:300]
    ids: list[int] = response.json()["choices"][0]["token_ids"]
    return ids


def reference(pd: PD, body: dict[str, Any]) -> list[int]:
    local = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    return tokens(post(pd.decode.url, local))


def assert_settled(pd: PD) -> None:
    """Nothing running anywhere, every block free, P holds nothing for a transfer."""
    for served in (pd.prefill, pd.decode):
        total = metrics(served.url)["kvbridge_cache_total_blocks"]
        wait_metrics(served.url, {"kvbridge_requests_running": 0,
                                  "kvbridge_cache_free_blocks": total,
                                  "kvbridge_cache_blocks_held_for_transfer": 0})


def _remote(**overrides: Any) -> dict[str, Any]:
    params = {"do_remote_prefill": True, "remote_engine_id": "p-bad", "remote_host": "127.0.0.1",
              "remote_port": 1, "remote_block_size": 16, "grant": GRANT,
              "remote_num_tokens": 20, "remote_block_ids": [1, 2]}
    return {**params, **overrides}


def _with(**fields: Any) -> bytes:
    return json.dumps({"prompt": "hello", "max_tokens": 3, **fields}).encode()


BAD_BODIES: dict[str, bytes] = {
    "malformed json": b'{"prompt": "x"',
    "empty body": b"",
    "not an object": b'["x"]',
    "null": b"null",
    "not utf-8": b'{"prompt": "\xff\xfe"}',
    "NaN": b'{"prompt": "x", "temperature": NaN}',
    "nested 100k deep": b"[" * 100_000 + b"]" * 100_000,
    "unknown field": _with(best_of=2),
    "unknown fields, several": _with(n=2, logprobs=5, echo=True),
    "prompt wrong type": _with(prompt=5),
    "prompt ids wrong type": _with(prompt=[1, "a"]),
    "prompt id negative": _with(prompt=[-1, 3]),
    "prompt id huge": _with(prompt=[2**70]),
    "prompt empty": _with(prompt=[]),
    "max_tokens negative": _with(max_tokens=-3),
    "max_tokens zero": _with(max_tokens=0),
    "max_tokens string": _with(max_tokens="3"),
    "max_tokens float": _with(max_tokens=1.5),
    "max_tokens bool": _with(max_tokens=True),
    "max_tokens null": _with(max_tokens=None),
    "temperature string": _with(temperature="hot"),
    "top_p above 1": _with(top_p=2),
    "seed negative": _with(seed=-1),
    "stop wrong type": _with(stop=5),
    "stream string": _with(stream="yes"),
    "huge prompt text": _with(prompt="y" * 200_000),
    "huge prompt ids": _with(prompt=[7] * 50_000),
}
#: Bad kv_transfer_params: 400 from P and D; the proxy replaces a client's params.
BAD_PARAMS: dict[str, bytes] = {
    "params not an object": _with(kv_transfer_params=[1]),
    "params a string": _with(kv_transfer_params="do it"),
    "params port out of range": _with(kv_transfer_params={"remote_port": 70000}),
    "params block ids string": _with(kv_transfer_params={"remote_block_ids": "abc"}),
    "params block id negative": _with(kv_transfer_params={"remote_block_ids": [-1]}),
    "params grant empty": _with(kv_transfer_params=_remote(grant="")),
    "params incomplete": _with(kv_transfer_params={"do_remote_prefill": True,
                                                   "remote_host": "h"}),
    "params too few blocks": _with(kv_transfer_params=_remote(remote_num_tokens=2**40)),
    "params tp size zero": _with(kv_transfer_params=_remote(remote_tp_size=0)),
}


@pytest.mark.parametrize("target", ["prefill", "decode", "proxy"])
def test_bad_bodies_get_400_and_the_servers_carry_on(pd: PD, target: str) -> None:
    url = pd.targets()[target]
    expected = reference(pd, GOOD)
    cases = {**BAD_BODIES, **(BAD_PARAMS if target != "proxy" else {})}
    for name, body in cases.items():
        r = post(url, body)
        assert r.status_code == 400, (name, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (name, error)
        assert tokens(post(url, GOOD)) == expected, name
    assert_settled(pd)


def test_oversized_body_gets_413(pd: PD) -> None:
    body = _with(prompt="z" * (MAX_BODY_NBYTES + 1024))
    for name, url in pd.targets().items():
        r = post(url, body)
        assert r.status_code == 413, (name, r.text[:300])
        assert str(MAX_BODY_NBYTES) in r.json()["error"]["message"]
    assert tokens(post(pd.proxy.url, GOOD)) == reference(pd, GOOD)
    assert_settled(pd)


def test_proxy_ignores_a_clients_kv_transfer_params(pd: PD) -> None:
    """The proxy owns the params: a client's (bad or hostile) never reach P or D."""
    expected = reference(pd, GOOD)
    for name, body in BAD_PARAMS.items():
        params = json.loads(body)["kv_transfer_params"]
        assert tokens(post(pd.proxy.url, {**GOOD, "kv_transfer_params": params})) == expected, \
            name
    assert_settled(pd)


def test_hostile_params_straight_to_d_still_give_the_right_answer(pd: PD) -> None:
    """Well-formed params naming a forged grant, a dead host, the wrong engine or absurd
    sizes: D's load fails, D recomputes locally, the answer is right, nothing leaks."""
    prompt = "A prompt long enough to fill a couple of sixteen-token blocks on P."
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True}
    expected = reference(pd, body)
    p_port = pd.p_transfer_port
    hostile = {
        "forged grant": _remote(remote_port=p_port),
        "wrong engine": _remote(remote_port=p_port, remote_engine_id="someone-else"),
        "nobody listening": _remote(remote_port=free_port()),
        "unresolvable host": _remote(remote_host="no-such-host.invalid"),
        "200k block ids": _remote(remote_port=p_port, remote_block_ids=list(range(200_000))),
        "block size 1": _remote(remote_port=p_port, remote_block_size=1,
                                remote_block_ids=list(range(20))),
        "tp size 2**20": _remote(remote_port=p_port, remote_tp_size=2**20),
    }
    before = metrics(pd.decode.url)
    for name, params in hostile.items():
        got = tokens(post(pd.decode.url, {**body, "kv_transfer_params": params}))
        assert got == expected, name
    after = metrics(pd.decode.url)
    # every load failed (or was refused up front): not one byte was accepted from P
    assert after["kvbridge_kv_transfer_bytes_total"] == before["kvbridge_kv_transfer_bytes_total"]
    assert_settled(pd)
    assert tokens(post(pd.proxy.url, GOOD)) == reference(pd, GOOD)


def test_half_a_body_then_hang_up_is_an_abort_not_a_crash(pd: PD) -> None:
    """A client that leaves mid-body is counted as gone (499), not logged as a failure."""
    for name, url in pd.targets().items():
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                         b'{"prompt": "only half of')
        assert tokens(post(url, GOOD)) == reference(pd, GOOD), name
    for served in (pd.prefill, pd.decode, pd.proxy):
        log = served.stderr_path.read_text()
        assert "Exception in ASGI application" not in log, log[-3000:]
    assert_settled(pd)


def test_a_client_reaching_p_and_d_directly_cannot_poison_ds_prefix_cache(pd: PD) -> None:
    victim = "The victim's prompt: shared text that fills a few blocks, and a tail."
    other = "Attacker's text, exactly as long as the victim's prompt, but other!!!"
    assert len(victim) == len(other)
    body: dict[str, Any] = {"prompt": victim, "max_tokens": 6, "ignore_eos": True}
    expected = tokens(post(pd.prefill.url, body))  # P computes it all by itself
    before = metrics(pd.decode.url)
    # the attacker prefills `other` on P, then asks D for `victim` with other's params
    p_answer = post(pd.prefill.url, {"prompt": other, "max_tokens": 1,
                                     "kv_transfer_params": {"do_remote_decode": True}})
    params = p_answer.json()["kv_transfer_params"]
    attacked = post(pd.decode.url, {**body, "kv_transfer_params": params})
    assert attacked.status_code == 200
    # D refused P's params for another prompt before reading (P would refuse the read
    # too: the grant holds another prompt): D recomputed the victim's prompt
    assert tokens(attacked) == expected
    after = metrics(pd.decode.url)
    assert after["kvbridge_kv_transfer_bytes_total"] == before["kvbridge_kv_transfer_bytes_total"]
    assert after["kvbridge_kv_loads_failed_total"] == before["kvbridge_kv_loads_failed_total"]
    assert (after["kvbridge_kv_params_refused_total"]
            == before["kvbridge_kv_params_refused_total"] + 1)
    # an innocent client, through the proxy, must still get the right answer
    assert tokens(post(pd.proxy.url, body)) == expected
    assert_settled(pd)  # the refused grant was given back: P holds nothing for 600 s


def test_reordered_block_ids_cannot_poison_ds_prefix_cache(pd: PD) -> None:
    """The right prompt with P's blocks named in another order: the params are not what
    P signed, so D reads nothing (were they unsigned, P's grant is bound to the blocks'
    order too: a read names blocks only as a set), and D recomputes."""
    victim = "Another victim whose prompt spans several of P's sixteen-token blocks."
    body: dict[str, Any] = {"prompt": victim, "max_tokens": 6, "ignore_eos": True}
    expected = tokens(post(pd.prefill.url, body))
    p_answer = post(pd.prefill.url, {"prompt": victim, "max_tokens": 1,
                                     "kv_transfer_params": {"do_remote_decode": True}})
    params = p_answer.json()["kv_transfer_params"]
    assert len(params["remote_block_ids"]) >= 4, params
    before = metrics(pd.decode.url)
    reordered = {**params, "remote_block_ids": params["remote_block_ids"][::-1]}
    assert tokens(post(pd.decode.url, {**body, "kv_transfer_params": reordered})) == expected
    after = metrics(pd.decode.url)
    assert after["kvbridge_kv_transfer_bytes_total"] == before["kvbridge_kv_transfer_bytes_total"]
    # not what P signed: refused, and D told no one; P's own params then find the prompt
    # in D's prefix cache and D gives P's grant back
    assert (after["kvbridge_kv_params_refused_total"]
            == before["kvbridge_kv_params_refused_total"] + 1)
    assert tokens(post(pd.decode.url, {**body, "kv_transfer_params": params})) == expected
    assert tokens(post(pd.proxy.url, body)) == expected
    assert_settled(pd)
