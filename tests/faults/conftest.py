"""Shared fixtures of the fault tests: one lab with P, D and a proxy, restarted as needed.

The session-scoped :class:`FaultCluster` runs, each on its own lab host (network
namespace, UCX over TCP on the host's veth):

    prefill 10.77.0.1  kvbridge serve --role prefill  (P, TP and layout per test)
    decode  10.77.0.2  kvbridge serve --role decode   (D: TP 1, block 32, HND)
    proxy   10.77.0.3  kvbridge proxy                 (and the tests' HTTP client)

Every server keeps its address across restarts, so a test may kill anything;
the ``cluster`` fixture brings back what is dead (or configured differently)
before the next test. Timeouts are short and explicit (:data:`AGENT_OPTIONS`),
and P waits before each data chunk (:data:`CHUNK_DELAY_S`, put in by
``tests/slow_serving.py``: kvbridge has no such knob) so that a read of a few
hundred tokens lasts seconds: long enough to kill, cut or hang up
"mid-transfer" on purpose rather than by luck.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.faults.cluster import (
    Answer,
    NetnsClient,
    Reference,
    Served,
    delta,
    kill_all,
    prompt_of,
    reference_engine,
    start,
)
from tests.integration.netns import NetnsLab, cleanup_stale

HTTP_PORT = 8100
TRANSFER_PORT = 5600
MAX_MODEL_LEN = 1024
#: The proxy's limit on a backend call; no client request may take longer.
REQUEST_DEADLINE_S = 30.0
#: P's lease on a finished prefill's blocks.
LEASE_S = 3.0
#: Longest wait for every engine to hold no block after a fault (lease + slack).
SETTLE_S = LEASE_S + 20.0
#: Transfer agent timeouts of P and D (``--transfer-option``); D's read gives up
#: within chunk_timeout_s of silence. Heartbeats are slow on purpose: an idle link
#: is only found dead by its next ping, heartbeat_s = 60 s after the last, longer
#: than a test takes, so a restarted P meets a D still holding a (stale) link to
#: the old one (UCX itself reports no peer failure).
AGENT_OPTIONS = {
    "connect_timeout_s": 2.0, "handshake_timeout_s": 2.0, "reply_timeout_s": 2.0,
    "chunk_timeout_s": 2.0, "read_timeout_s": 15.0, "heartbeat_s": 60.0,
    "server_idle_timeout_s": 300.0, "lease_s": LEASE_S, "renew_every_s": 1.0,
}
#: P waits this long before each data chunk (``tests/slow_serving.py``).
CHUNK_DELAY_S = 0.2
#: D asks for chunks of one block (one P block of the tiny model is >= 64 KiB).
D_CHUNK_NBYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class PConfig:
    """How P runs; a test asking for another one gets P restarted."""

    tp: int = 1
    block_size: int = 16
    layout: str = "NHD"


def _options(extra: dict[str, float]) -> list[str]:
    args: list[str] = []
    for name, value in {**AGENT_OPTIONS, **extra}.items():
        args += ["--transfer-option", f"{name}={value}"]
    return args


class FaultCluster:
    """P, D and proxy on lab hosts (see the module docstring)."""

    def __init__(self, lab: NetnsLab, log_dir: Path, reference: Reference) -> None:
        self.lab = lab
        self.log_dir = log_dir
        self.reference = reference
        self.client = NetnsClient(lab["proxy"].netns)
        self.p: Served | None = None
        self.d: Served | None = None
        self.proxy: Served | None = None
        self.p_config = PConfig()
        self.p_url = f"http://{lab['prefill'].ip}:{HTTP_PORT}"
        self.d_url = f"http://{lab['decode'].ip}:{HTTP_PORT}"
        self.proxy_url = f"http://{lab['proxy'].ip}:{HTTP_PORT}"

    # ------------------------------------------------------------------ servers
    def _p_argv(self, cfg: PConfig) -> list[str]:
        host = self.lab["prefill"].ip
        return ["serve", "--role", "prefill", "--host", host, "--port", str(HTTP_PORT),
                "--transfer-port", str(TRANSFER_PORT), "--engine-id", "p0",
                "--tp", str(cfg.tp), "--block-size", str(cfg.block_size),
                "--kv-layout", cfg.layout, "--num-blocks", str(2048 // cfg.block_size),
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "64",
                "--lease", str(LEASE_S), "--log-level", "info", *_options({})]

    def _d_argv(self) -> list[str]:
        host = self.lab["decode"].ip
        return ["serve", "--role", "decode", "--host", host, "--port", str(HTTP_PORT),
                "--transfer-port", str(TRANSFER_PORT), "--engine-id", "d0",
                "--block-size", "32", "--kv-layout", "HND", "--num-blocks", "64",
                "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "info",
                *_options({"chunk_nbytes": D_CHUNK_NBYTES})]

    def _proxy_argv(self) -> list[str]:
        return ["proxy", "--host", self.lab["proxy"].ip, "--port", str(HTTP_PORT),
                "--prefill", self.p_url, "--decode", self.d_url,
                "--timeout", str(REQUEST_DEADLINE_S), "--read-timeout", "20"]

    def _healthy(self, served: Served | None) -> bool:
        if served is None or not served.alive:
            return False
        try:
            return self.client.get(f"{served.url}/health", 5.0).status_code == 200
        except Exception:
            return False

    def ensure(self, p_config: PConfig | None) -> None:
        """Bring every server up (restarting the dead, sick or differently configured
        ones, all at once), then wait until no engine holds a block.

        Args:
            p_config: how P must run; ``None``: as it last ran.
        """
        cfg = p_config or self.p_config
        pending: list[Served] = []
        if not self._healthy(self.p) or cfg != self.p_config:
            self.p = self._restart(self.p, "prefill", self._p_argv(cfg), CHUNK_DELAY_S)
            self.p_config = cfg
            pending.append(self.p)
        if not self._healthy(self.d):
            self.d = self._restart(self.d, "decode", self._d_argv())
            pending.append(self.d)
        if self.proxy is None or not self.proxy.alive:
            self.proxy = self._restart(self.proxy, "proxy", self._proxy_argv())
            pending.append(self.proxy)
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(Served.wait_ready, pending))
        for url in (self.p_url, self.d_url):
            self.client.wait_all_blocks_free(url, timeout_s=SETTLE_S)

    def _restart(self, old: Served | None, host: str, argv: list[str],
                 chunk_delay_s: float = 0.0) -> Served:
        if old is not None:
            old.kill()  # same address: the old one must be gone first
        return start(host, self.lab[host], argv, self.log_dir, chunk_delay_s=chunk_delay_s)

    def restart_p(self, cfg: PConfig, *, graceful: bool) -> None:
        """Stop P (SIGTERM, or SIGKILL if not ``graceful``) and start it with ``cfg``."""
        assert self.p is not None
        if graceful:
            self.p.stop()
        else:
            self.p.kill()
        self.p = start("prefill", self.lab["prefill"], self._p_argv(cfg), self.log_dir,
                       chunk_delay_s=CHUNK_DELAY_S)
        self.p_config = cfg
        self.p.wait_ready()

    def kill_all(self) -> None:
        kill_all([s for s in (self.proxy, self.d, self.p) if s is not None])

    def log_tails(self) -> str:
        parts = []
        for served in (self.p, self.d, self.proxy):
            if served is not None:
                parts.append(f"===== {served.name} ({served.log_path})\n{served.log_tail()}")
        return "\n".join(parts)

    # ------------------------------------------------------------------ checks
    def metrics(self, which: str) -> dict[str, float]:
        return self.client.metrics(self.p_url if which == "p" else self.d_url)

    def assert_right(self, answer: Answer, prompt: str, max_tokens: int) -> None:
        """The answer is the colocated one, and came within the deadline."""
        assert answer.elapsed_s < REQUEST_DEADLINE_S, answer
        assert answer.status == 200, (answer.status, answer.text[:1000])
        assert answer.token_ids == self.reference.tokens(prompt, max_tokens)

    def assert_settled(self, *, p: bool = True, d: bool = True) -> None:
        """Every (living) engine's free blocks are back to its total, nothing held."""
        if p:
            self.client.wait_all_blocks_free(self.p_url, timeout_s=SETTLE_S)
        if d:
            self.client.wait_all_blocks_free(self.d_url, timeout_s=SETTLE_S)

    def assert_serves(self, tag: str, num_chars: int = 150, max_tokens: int = 4) -> Answer:
        """A fresh request through the proxy is answered right, with a transfer."""
        prompt = prompt_of(num_chars, tag)
        before = self.metrics("d")
        answer = self.client.complete(self.proxy_url, prompt, max_tokens)
        self.assert_right(answer, prompt, max_tokens)
        after = self.metrics("d")
        moved = delta(before, after, "kv_transfer_bytes_total")
        failed = delta(before, after, "kv_transfer_failures_total")
        assert moved > 0 and failed == 0, (moved, failed, answer.body)
        return answer


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "p_config(cfg): the PConfig P must run with "
                            "(None: any, as it runs)")


@pytest.fixture(scope="session")
def reference() -> Iterator[Reference]:
    with reference_engine(MAX_MODEL_LEN) as ref:
        yield ref


@pytest.fixture(scope="session")
def fault_cluster(tmp_path_factory: pytest.TempPathFactory,
                  reference: Reference) -> Iterator[FaultCluster]:
    """The lab and its servers, for the whole session; torn down even on failure."""
    cleanup_stale()
    log_dir = tmp_path_factory.mktemp("faults")
    with NetnsLab(["prefill", "decode", "proxy"]) as lab:
        cluster = FaultCluster(lab, log_dir, reference)
        try:
            yield cluster
        finally:
            with contextlib.suppress(Exception):
                cluster.kill_all()
            cluster.client.close()


@pytest.fixture
def cluster(fault_cluster: FaultCluster, request: pytest.FixtureRequest) -> Iterator[FaultCluster]:
    """The session's cluster, every server up and idle; log tails printed on failure."""
    marker = request.node.get_closest_marker("p_config")
    fault_cluster.ensure(marker.args[0] if marker else PConfig())
    yield fault_cluster
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(fault_cluster.log_tails())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
