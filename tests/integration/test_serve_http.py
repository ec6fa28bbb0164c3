"""``kvbridge serve`` and ``kvbridge proxy`` as real processes on loopback.

A prefill instance (P: block 16, NHD), a decode instance (D: block 32, HND), a
colocated instance (C) and a proxy in front of P and D. Every answer through the
proxy must equal C's token for token; afterwards nothing may stay running or
held. The processes start with ``python -m kvbridge.cli`` (the same code
as ``kvbridge serve|proxy``) and are stopped with SIGTERM in teardown, killed
if they do not exit in time. The flag-to-config tests at the end run in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbridge.cli.main import main
from kvbridge.cli.proxy import add_proxy_parser
from kvbridge.cli.serve import add_serve_parser, build_engine_config, parse_nbytes
from kvbridge.errors import ConfigError
from kvbridge.topology import KVLayout
from tests.integration.served import (
    Served,
    metrics,
    spawn,
    wait_all_ready,
    wait_metrics,
    wait_ready,
)
from tests.ports import free_port
from tests.waiting import wait_until

LONG = "Disaggregated serving moves the prompt's KV cache from prefill to decode. " * 2
PROMPTS = [
    "Hi!",  # shorter than one block
    LONG,  # several blocks and a partial one
    LONG[:64] + "and then a different tail follows here.",  # a prefix hit on both sides
    "0123456789" * 7,
]


@dataclass
class Deployment:
    prefill: Served
    decode: Served
    colocated: Served
    proxy: Served


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("serve")
    common = ["serve", "--port", "0", "--model", "tiny", "--max-model-len", "512"]
    started: list[Served] = []
    try:
        pending = [
            spawn(tmp, "prefill", *common, "--role", "prefill", "--block-size", "16",
                  "--kv-layout", "NHD", "--num-blocks", "80", "--transfer-port",
                  str(free_port()), "--engine-id", "p0"),
            spawn(tmp, "decode", *common, "--role", "decode", "--block-size", "32",
                  "--kv-layout", "HND", "--num-blocks", "40", "--transfer-port",
                  str(free_port())),
            spawn(tmp, "colocated", *common, "--num-blocks", "80"),
        ]
        started += wait_all_ready(pending)
        p, d = started[0].url, started[1].url
        started.append(wait_ready(*spawn(tmp, "proxy", "proxy", "--port", "0", "--prefill", p,
                                         "--decode", d, "--timeout", "60")))
        yield Deployment(*started)
    finally:
        codes = []
        for served in reversed(started):
            codes.append(served.stop())
        assert codes == [0] * len(started), codes


def complete(url: str, prompt: str, **options: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, **options}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


@pytest.mark.integration
def test_pd_answers_equal_colocated_ones(deployment: Deployment) -> None:
    num_first_token = 0
    for prompt in PROMPTS:
        expected = complete(deployment.colocated.url, prompt)
        got = complete(deployment.proxy.url, prompt)
        assert got["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"], prompt
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert got["usage"] == expected["usage"]
        stats = got["kvbridge"]
        # D reads from P what its own prefix cache lacks: the whole prompt when the proxy
        # sent P's token to the client and D continued after it (first-token flow), all
        # but the last prompt token when D computed that token itself (classic flow: the
        # proxy falls back to it e.g. when P's token holds half of a character)
        num_loaded = stats["num_remote_tokens"] + stats["num_cached_tokens"]
        num_prompt = got["usage"]["prompt_tokens"]
        assert num_loaded in (num_prompt, num_prompt - 1)
        num_first_token += num_loaded == num_prompt
    assert num_first_token > 0
    values = metrics(deployment.decode.url)
    assert values["kvbridge_kv_transfers_total"] >= 1
    assert values["kvbridge_kv_transfer_bytes_total"] > 0
    assert values["kvbridge_kv_transfer_failures_total"] == 0
    # the reads' timeline (issue #40): every read counted in each of D's phases, and P
    # timed each grant from the request's end
    for phase in ("queue", "grant", "copy", "collect"):
        count = values[f"kvbridge_kv_read_{phase}_seconds_count"]
        assert count == values["kvbridge_kv_transfers_total"], phase
    p_values = metrics(deployment.prefill.url)
    assert p_values["kvbridge_kv_grant_publish_seconds_count"] >= len(PROMPTS)


@pytest.mark.integration
def test_streamed_pd_answer_equals_colocated(deployment: Deployment) -> None:
    expected = complete(deployment.colocated.url, PROMPTS[3] + "!")["choices"][0]
    body = {"prompt": PROMPTS[3] + "!", "max_tokens": 12, "ignore_eos": True, "stream": True}
    r = httpx.post(f"{deployment.proxy.url}/v1/completions", json=body, timeout=60)
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [httpx.Response(200, content=e[6:]).json()["choices"][0] for e in events[:-1]]
    assert sum((c["token_ids"] for c in chunks), []) == expected["token_ids"]
    assert "".join(c["text"] for c in chunks) == expected["text"]


@pytest.mark.integration
def test_sixteen_concurrent_pd_requests(deployment: Deployment) -> None:
    prompts = [f"request {i}: " + LONG[: 10 + 7 * i] for i in range(16)]
    expected = [complete(deployment.colocated.url, p)["choices"][0]["token_ids"]
                for p in prompts]

    async def together() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=deployment.proxy.url, timeout=120) as client:
            answers = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": p, "max_tokens": 12, "ignore_eos": True}) for p in prompts))
        return [a.json()["choices"][0]["token_ids"] for a in answers]

    assert asyncio.run(together()) == expected


@pytest.mark.integration
def test_disconnect_mid_stream_frees_everything(deployment: Deployment) -> None:
    body = {"prompt": "a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{deployment.proxy.url}/v1/completions", json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    total = metrics(deployment.decode.url)["kvbridge_cache_total_blocks"]
    values = wait_metrics(deployment.decode.url, {"kvbridge_requests_running": 0,
                                                  "kvbridge_cache_free_blocks": total})
    assert values["kvbridge_requests_aborted_total"] >= 1
    # P gives every block back once D has read it: nothing stays held.
    p_total = metrics(deployment.prefill.url)["kvbridge_cache_total_blocks"]
    wait_metrics(deployment.prefill.url, {"kvbridge_cache_blocks_held_for_transfer": 0,
                                          "kvbridge_cache_free_blocks": p_total})


@pytest.mark.integration
def test_health_through_the_proxy(deployment: Deployment) -> None:
    r = httpx.get(f"{deployment.proxy.url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    health = httpx.get(f"{deployment.prefill.url}/health", timeout=10).json()
    assert health["role"] == "prefill" and health["engine_id"] == "p0"


@pytest.mark.integration
def test_tp2_server_answers_and_stops_cleanly(deployment: Deployment, tmp_path: Path) -> None:
    served = wait_ready(*spawn(tmp_path, "tp2", "serve", "--port", "0", "--tp", "2",
                               "--max-model-len", "512", "--num-blocks", "40"))
    try:
        prompt = PROMPTS[1]
        got = complete(served.url, prompt)["choices"][0]["token_ids"]
        assert got == complete(deployment.colocated.url, prompt)["choices"][0]["token_ids"]
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(served.proc.pid)],
                                  capture_output=True, text=True, timeout=10).stdout.split()
        assert len(children) >= 2  # the TP workers
    finally:
        code = served.stop()
    assert code == 0, served.stderr_path.read_text()[-2000:]
    pids = [int(pid) for pid in children]
    wait_until(lambda: [pid for pid in pids if _alive(pid)], 10, interval_s=0.1,
               until=lambda alive: not alive, message=f"workers {pids} to exit with their server",
               describe=lambda alive: f"still running: {alive}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_serve_parser(sub)
    add_proxy_parser(sub)
    return parser.parse_args(["serve", *flags])


def test_flags_build_the_engine_config(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    config = build_engine_config(serve_args(
        "--role", "decode", "--tp", "2", "--block-size", "32", "--kv-layout", "NHD",
        "--kv-memory", "64M", "--transfer-port", "7000", "--transfer-host", "10.1.2.3",
        "--host", "0.0.0.0", "--secret-file", str(secret), "--engine-id", "d7",
        "--max-model-len", "1024", "--lease", "5"))
    assert (config.tp_size, config.block_size, config.layout) == (2, 32, KVLayout.NHD)
    assert config.kv_memory_nbytes == 64 << 20 and config.num_blocks is None
    assert config.role.value == "decode" and config.max_model_len == 1024
    assert config.connector is not None
    assert (config.connector.engine_id, config.connector.host) == ("d7", "10.1.2.3")
    assert (config.connector.transfer_base_port, config.connector.lease_s) == (7000, 5.0)
    assert config.connector.secret == b"s3cret"
    insecure = build_engine_config(serve_args(
        "--transfer-port", "7000", "--transfer-host", "10.1.2.3", "--insecure",
        "--transfer-listen-host", "0.0.0.0"))
    assert insecure.connector is not None and insecure.connector.insecure
    assert insecure.connector.secret is None and insecure.connector.listen_host == "0.0.0.0"
    capped = build_engine_config(serve_args("--transfer-port", "7000", "--max-held-share", "0.2"))
    assert capped.connector is not None and capped.connector.max_held_share == 0.2
    with pytest.raises(ConfigError, match="max_held_share"):
        build_engine_config(serve_args("--transfer-port", "7000", "--max-held-share", "0"))
    colocated = build_engine_config(serve_args("--num-blocks", "50"))
    assert colocated.connector is None and colocated.num_blocks == 50


def test_zero_config_engines_authenticate_and_bind_the_advertised_address(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine hands its TP workers: the host secret, the listener's address."""
    from kvbridge.connector.params import parse_kv_transfer_params
    from kvbridge.reference.engine.connector_host import build
    from tests.connector.helpers import Req

    monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
    monkeypatch.setenv("KVBRIDGE_SECRET_DIR", str(tmp_path / "kvb"))
    scheduler, _, spec = build(build_engine_config(serve_args("--transfer-port", "7000")))
    assert spec.secret == (tmp_path / "kvb" / "secret").read_bytes().strip()
    assert spec.agent is not None and spec.agent.listen_host == "127.0.0.1"
    # the scheduler holds the same secret: params nobody signed plan no read
    unsigned = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
                "remote_port": 5600, "remote_block_ids": [1], "remote_block_size": 16,
                "remote_num_tokens": 16, "grant": "g" * 22}
    request = Req("r", list(range(17)), parse_kv_transfer_params(unsigned))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.get_stats().num_params_refused == 1
    _, _, spec = build(build_engine_config(serve_args(
        "--transfer-port", "7000", "--transfer-host", "10.1.2.3", "--insecure",
        "--transfer-listen-host", "0.0.0.0")))
    assert spec.secret is None and spec.host == "10.1.2.3"
    assert spec.agent is not None and spec.agent.listen_host == "0.0.0.0"


def test_bad_flags_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="--transfer-port"):
        build_engine_config(serve_args("--role", "prefill"))
    with pytest.raises(ConfigError, match="--transfer-host"):
        build_engine_config(serve_args("--host", "0.0.0.0", "--transfer-port", "7000"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        build_engine_config(serve_args("--transfer-port", "7000", "--secret-file",
                                       str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="tp_size"):
        build_engine_config(serve_args("--tp", "3"))
    # a non-loopback address needs a secret (or --insecure): peers there cannot know
    # this host's own secret
    with pytest.raises(ConfigError, match=r"'10.1.2.3' is reachable.*--secret-file.*--insecure"):
        build_engine_config(serve_args("--transfer-port", "7000", "--transfer-host", "10.1.2.3"))
    before = signal.getsignal(signal.SIGTERM)
    assert main(["serve", "--role", "decode"]) == 2
    assert "kvbridge serve: error: --role decode needs --transfer-port" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
    with pytest.raises(SystemExit):
        serve_args("--kv-memory", "lots")
    with pytest.raises(SystemExit):
        serve_args("--num-blocks", "5", "--kv-memory", "1G")


@pytest.mark.parametrize("text, nbytes", [("4096", 4096), ("256M", 256 << 20),
                                          ("1GiB", 1 << 30), ("1.5k", 1536), ("2gb", 2 << 30)])
def test_parse_nbytes(text: str, nbytes: int) -> None:
    assert parse_nbytes(text) == nbytes
