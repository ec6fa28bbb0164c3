"""Faults while serving behind vllm-router: a P or a D SIGKILLed under load, then restarted.

Four clients send greedy requests (each prompt once, streamed or not) through
vllm-router while a whole server's process group gets SIGKILL (a host dying:
no goodbye to its peers). Every request must end, within ``DEADLINE_S``, in
one of:

    right   the colocated answer, token for token (computed beforehand)
    error   an HTTP error status with a message, or an SSE error event
    torn    a stream the router cut when its D died: the tokens that came
            are the first ones of the colocated answer

and never with another token. What vllm-router does (measured, 0.1.17): it
sends each request to the backend its policy picks, dead or not, and answers
500 with a message ("Prefill request to ... failed", "Decode request failed
to ...") when that backend does not answer; a stream whose D dies is closed
without an error event. Only its health checks take a dead backend out of
rotation (and bring it back once it answers), by default after three failed
checks a minute apart; here every second, after one (``FAST_HEALTH_CHECKS``).

Servers: ``pd.router_specs``' three (shared with test_router.py); the third is the
P killed and restarted on the same HTTP port with the same engine id and transfer
ports (``base_port``), and has a short lease. The colocated answers are a P's, asked
without ``kv_transfer_params``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integrations.vllm.client import (
    NUM_REQUESTS_RUNNING,
    PROMPT_TOKENS,
    metrics,
    poll_metrics,
)
from tests.integrations.vllm.pd import (
    FAILURES,
    HELD_REQUESTS,
    PARAMS_REFUSED,
    ROUTER_THIRD_LEASE_S,
    TRANSFERS,
    counters,
    prefill,
    prompt_ids,
    router_specs,
    wait_usage,
)
from tests.integrations.vllm.router import (
    FAST_HEALTH_CHECKS,
    require_router,
    vllm_router,
    wait_health,
)
from tests.integrations.vllm.servers import ServersForTest, VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(900)]

NUM_TOKENS = 8
NUM_CLIENTS = 4
DEADLINE_S = 60.0  # every request through the router ends (answer or error) within this
LEASE_S = ROUTER_THIRD_LEASE_S  # the killed-and-restarted P's


@pytest.fixture(scope="module", autouse=True)
def router_installed() -> None:
    require_router()


@pytest.fixture
def servers(vllm_servers: ServersForTest, tiny_llama_fp32: Path
            ) -> tuple[VllmServer, VllmServer, VllmServer]:
    """test_router.py's P and D, and the third server (``pd.router_specs``: a fixed
    engine id and transfer port, lease ``LEASE_S``): shared, so both tests run on the
    same three."""
    p, d, third = vllm_servers.shared_all(*router_specs(tiny_llama_fp32))
    return p, d, third


@dataclass(frozen=True)
class Outcome:
    """How one request through the router ended."""

    kind: str  # right, error, torn, wrong, late
    detail: str
    started: float
    ended: float


def references(url: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    """The colocated greedy answers to ``prompts``, asked in one request (no params)."""
    body = {"model": model, "prompt": prompts, "max_tokens": NUM_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def ask(url: str, model: str, prompt: list[int], expected: list[int], *, stream: bool
        ) -> Outcome:
    """One request through the router, sorted into an ``Outcome`` (never raises)."""
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    started = time.monotonic()

    def ended(kind: str, detail: str) -> Outcome:
        return Outcome(kind, detail[:300], started, time.monotonic())

    tokens: list[int] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=DEADLINE_S) as response:
            if response.is_error:
                text = response.read().decode(errors="replace").strip()
                return ended("error" if text else "wrong",
                             f"{response.status_code} {text or '(no message)'}")
            if not stream:
                response.read()
                [choice] = response.json()["choices"]
                tokens = choice["token_ids"]
                return ended("right" if tokens == expected else "wrong",
                             f"{tokens} (colocated: {expected})")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return ended("right" if tokens == expected else "wrong",
                                 f"stream {tokens} (colocated: {expected})")
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    message = str(event["error"].get("message", ""))
                    return ended("error" if message and tokens == expected[:len(tokens)]
                                 else "wrong", f"stream error event {event['error']}")
                tokens += [t for c in event["choices"] for t in c.get("token_ids") or []]
            return ended("wrong", f"stream ended without [DONE] after {tokens}")
    except httpx.TimeoutException as exc:
        return ended("late", f"no end after {DEADLINE_S} s: {exc!r}")
    except httpx.TransportError as exc:  # the router cut the stream: D died under it
        ok = stream and tokens == expected[:len(tokens)]
        return ended("torn" if ok else "wrong", f"{exc!r} after {tokens}")


class Load:
    """``NUM_CLIENTS`` threads asking the router for ``prompts`` (each once, in turn,
    every other one streamed) until ``stop()`` or the prompts run out."""

    def __init__(self, url: str, model: str, prompts: list[list[int]],
                 expected: list[list[int]]) -> None:
        self._url, self._model = url, model
        self._work = iter(list(enumerate(zip(prompts, expected, strict=True))))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.outcomes: list[Outcome] = []
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(NUM_CLIENTS)]

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                item = next(self._work, None)
            if item is None:
                return
            i, (prompt, expected) = item
            outcome = ask(self._url, self._model, prompt, expected, stream=i % 2 == 1)
            with self._lock:
                self.outcomes.append(outcome)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ended(self, num_outcomes: int) -> None:
        """Until ``num_outcomes`` requests have ended (each ends by ``DEADLINE_S``)."""
        deadline = time.monotonic() + 4 * DEADLINE_S
        while len(self.outcomes) < num_outcomes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.outcomes) >= num_outcomes, self.outcomes

    def stop(self) -> list[Outcome]:
        """Let the requests in flight end; every outcome."""
        self._stop.set()
        for thread in self._threads:
            thread.join(DEADLINE_S + 30)
        assert not any(t.is_alive() for t in self._threads), "a request did not end"
        return self.outcomes


def check_outcomes(outcomes: list[Outcome], fault_at: float, *, torn_ok: bool
                   ) -> dict[str, int]:
    """Every request right, or a clean error (or a torn stream where allowed), none
    late; requests were in flight at the fault. Returns the count of each kind."""
    kinds = {kind: sum(o.kind == kind for o in outcomes)
             for kind in ("right", "error", "torn", "wrong", "late")}
    bad = [o for o in outcomes if o.kind in ("wrong", "late") or (o.kind == "torn"
                                                                  and not torn_ok)]
    assert not bad, (kinds, bad)
    assert any(o.started < fault_at < o.ended for o in outcomes), "nothing in flight"
    assert any(o.kind == "right" and o.started > fault_at for o in outcomes), outcomes
    return kinds


def kill_when_busy(server: VllmServer) -> float:
    """SIGKILL ``server``'s process group while it runs a request (or after 10 s of
    looking); returns when it was killed."""
    deadline = time.monotonic() + 10
    while (metrics(server.base_url).get(NUM_REQUESTS_RUNNING, 0) < 1
           and time.monotonic() < deadline):
        time.sleep(0.02)
    killed_at = time.monotonic()
    server.kill()
    return killed_at


def fresh_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts of 2 or 3 blocks no other test sends (so no prefix cache holds them)."""
    return [prompt_ids(130 + 97 * (i % 3), seed=seed + i) for i in range(num)]


def test_p_killed_under_load_then_restarted_on_its_port(
    servers: tuple[VllmServer, VllmServer, VllmServer], vllm_servers: ServersForTest,
    tmp_path: Path,
) -> None:
    """2P1D: P2 dies mid-load. Its requests end in an error, none in a wrong token; once
    the router's health check sees it gone, every request goes to P1 and is right. P2
    back on its port (same engine id and transfer port): D, not restarted, reads the
    prompts it prefills (D's link to the dead P2 is not reused)."""
    p1, d, p2 = servers
    model = str(p1.spec.model)
    load_prompts, later, again = (fresh_prompts(n, seed) for n, seed in
                                  ((40, 7000), (4, 7100), (6, 7200)))
    expected = references(p1.base_url, model, load_prompts + later + again)
    for server in servers:
        wait_usage(server.base_url)
    with vllm_router([p1, p2], [d], tmp_path / "router.log", *FAST_HEALTH_CHECKS) as router:
        with Load(router, model, load_prompts, expected[:40]) as load:
            load.wait_ended(4)
            killed_at = kill_when_busy(p2)
            num_before = len(load.outcomes)
            load.wait_ended(num_before + 8)
        print("P killed:", check_outcomes(load.outcomes, killed_at, torn_ok=False))
        wait_health(router, p2.base_url, healthy=False)
        for prompt, want in zip(later, expected[40:44], strict=True):
            assert ask(router, model, prompt, want, stream=False).kind == "right"

        p2 = vllm_servers.restart(p2)
        wait_health(router, p2.base_url, healthy=True)
        before = counters(d.base_url)
        outcomes = [ask(router, model, prompt, want, stream=i % 2 == 1)
                    for i, (prompt, want) in enumerate(zip(again, expected[44:], strict=True))]
        assert [o.kind for o in outcomes] == ["right"] * len(again), outcomes
    # round robin: P2 prefilled some of them, and D read every prompt, none failed
    assert poll_metrics(p2.base_url, lambda m: m.get(PROMPT_TOKENS, 0) > 0)
    after = poll_metrics(d.base_url, lambda m: m.get(TRANSFERS, 0) + m.get(FAILURES, 0)
                         >= before[TRANSFERS] + before[FAILURES] + len(again))
    assert {name: after.get(name, 0) - before[name] for name in
            (TRANSFERS, FAILURES, PARAMS_REFUSED)} == {TRANSFERS: len(again), FAILURES: 0,
                                                       PARAMS_REFUSED: 0}
    for server in (p1, p2, d):
        wait_usage(server.base_url)


def test_d_killed_under_load_then_restarted_ps_holds_end_with_their_lease(
    servers: tuple[VllmServer, VllmServer, VllmServer], vllm_servers: ServersForTest,
    tmp_path: Path,
) -> None:
    """1P2D (test_router.py's P serves as the second D): D1 dies mid-load. Its requests
    end in an error or a stream cut short, none in a wrong token; P's blocks held for
    the prompts D1 will never read come back when their lease ends; the router sends
    later requests to D2; D1 back on its port decodes again."""
    d2, d1, p = servers
    model = str(p.spec.model)
    load_prompts, held, later, again = (fresh_prompts(n, seed) for n, seed in
                                        ((40, 8000), (2, 8100), (4, 8200), (6, 8300)))
    expected = references(p.base_url, model, load_prompts + later + again)
    for server in servers:
        wait_usage(server.base_url)
    with vllm_router([p], [d1, d2], tmp_path / "router.log", *FAST_HEALTH_CHECKS) as router:
        with Load(router, model, load_prompts, expected[:40]) as load:
            load.wait_ended(4)
            for prompt in held:  # prefilled for a D that never comes
                prefill(p.base_url, prompt)
            poll_metrics(p.base_url, lambda m: m.get(HELD_REQUESTS, 0) >= len(held))
            killed_at = kill_when_busy(d1)
            num_before = len(load.outcomes)
            load.wait_ended(num_before + 8)
        print("D killed:", check_outcomes(load.outcomes, killed_at, torn_ok=True))
        # what P held for D1 (those two, and prefills whose decode went to D1) ends
        # with its lease
        poll_metrics(p.base_url, lambda m: m.get(HELD_REQUESTS, 0) == 0, timeout_s=LEASE_S + 30)
        wait_usage(p.base_url)
        wait_health(router, d1.base_url, healthy=False)
        for prompt, want in zip(later, expected[40:44], strict=True):
            assert ask(router, model, prompt, want, stream=False).kind == "right"

        d1 = vllm_servers.restart(d1)
        wait_health(router, d1.base_url, healthy=True)
        outcomes = [ask(router, model, prompt, want, stream=i % 2 == 1)
                    for i, (prompt, want) in enumerate(zip(again, expected[44:], strict=True))]
        assert [o.kind for o in outcomes] == ["right"] * len(again), outcomes
    # round robin: the restarted D1 decoded some of them, reading their KV from P
    poll_metrics(d1.base_url, lambda m: m.get(TRANSFERS, 0) > 0 and not m.get(FAILURES, 0))
    for server in (p, d1, d2):
        wait_usage(server.base_url)

