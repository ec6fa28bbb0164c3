"""P/D across emulated hosts: 1P1D and 2P1D, TP 2 on one side, on a slow link too.

One lab (tests/integration/netns.py), every process on its own host, UCX over
TCP on the hosts' veth links (``ucx_env``)::

    prefa  10.77.0.1  P1: kvbridge serve --role prefill, TP 2, block 16, NHD
    prefb  10.77.0.2  P2: kvbridge serve --role prefill, TP 1, block 16, HND
    decode 10.77.0.3  D:  kvbridge serve --role decode,  TP 1, block 32, HND
    proxy  10.77.0.4  proxy :8000 -> P1 + D (1P1D); proxy :8001 -> P1, P2 + D (2P1D)

Every answer through a proxy must equal the colocated one (an in-process TP-1
engine, greedy), and the KV must really cross the lab network: D's transfer
counters grow and its NIC receives at least as many bytes. The slow-link test
shapes P1's NIC with ``tc tbf``; the netem variant adds delay, jitter and loss on
both ends of the P1 <-> D path (``tc netem``, or where the kernel lacks
``sch_netem`` the lab's NFQUEUE delay line).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.faults.cluster import (
    NetnsClient,
    Reference,
    Served,
    delta,
    kill_all,
    prompt_of,
    start,
)
from tests.integration.netns import HOST_IFNAME, NetnsLab, cleanup_stale, netem_or_skip

pytestmark = pytest.mark.integration

HTTP_PORT = 8100
TRANSFER_PORT = 5600
MAX_MODEL_LEN = 1024
MAX_TOKENS = 6
#: Agent timeouts: generous for a shaped link, still far below the proxy's limit.
AGENT = ["--transfer-option", "chunk_timeout_s=20", "--transfer-option", "read_timeout_s=60"]
SERVE = ["serve", "--port", str(HTTP_PORT), "--transfer-port", str(TRANSFER_PORT),
         "--max-model-len", str(MAX_MODEL_LEN), "--lease", "60", *AGENT]
LONG = "Disaggregated serving moves the prompt's KV cache from prefill to decode. " * 3
PROMPTS = [
    "Hi!",  # shorter than one block: only the last token, nothing to move
    LONG,  # many blocks and a partial one
    LONG[:96] + "and then a tail of its own follows here.",  # prefix hit on D
    "0123456789" * 9,
]


@dataclass
class Deployment:
    lab: NetnsLab
    client: NetnsClient
    reference: Reference
    servers: dict[str, Served]
    one_p: str  # proxy URL, 1P1D
    two_p: str  # proxy URL, 2P1D

    def url(self, name: str) -> str:
        return self.servers[name].url

    def metrics(self, name: str) -> dict[str, float]:
        return self.client.metrics(self.url(name))

    def assert_right(self, proxy_url: str, prompt: str) -> None:
        answer = self.client.complete(proxy_url, prompt, MAX_TOKENS)
        assert answer.status == 200, f"{answer.text[:500]}\n{self.log_tails()}"
        assert answer.token_ids == self.reference.tokens(prompt, MAX_TOKENS), prompt

    def log_tails(self) -> str:
        return "\n".join(f"===== {s.name}\n{s.log_tail(2000)}" for s in self.servers.values())


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    cleanup_stale()
    log_dir = tmp_path_factory.mktemp("multihost")
    with NetnsLab(["prefa", "prefb", "decode", "proxy"]) as lab, \
            ThreadPoolExecutor(1) as background:
        # the reference engine loads while the servers start
        reference_future = background.submit(Reference, MAX_MODEL_LEN)
        client = NetnsClient(lab["proxy"].netns)
        servers: dict[str, Served] = {}
        try:
            for name, host, flags in [
                ("p1", "prefa", ["--role", "prefill", "--tp", "2", "--block-size", "16",
                                 "--kv-layout", "NHD", "--num-blocks", "128",
                                 "--engine-id", "p1"]),
                ("p2", "prefb", ["--role", "prefill", "--block-size", "16", "--kv-layout",
                                 "HND", "--num-blocks", "128", "--engine-id", "p2"]),
                ("d", "decode", ["--role", "decode", "--block-size", "32", "--kv-layout",
                                 "HND", "--num-blocks", "64", "--engine-id", "d"]),
            ]:
                servers[name] = start(name, lab[host], [*SERVE, "--host", lab[host].ip, *flags],
                                      log_dir)
            for name in ("p1", "p2", "d"):
                servers[name].wait_ready()
            proxy_ip = lab["proxy"].ip
            for name, port, prefills in [("one_p", 8000, ["p1"]), ("two_p", 8001, ["p1", "p2"])]:
                servers[name] = start(name, lab["proxy"], [
                    "proxy", "--host", proxy_ip, "--port", str(port), "--timeout", "90",
                    "--prefill", *(servers[p].url for p in prefills),
                    "--decode", servers["d"].url], log_dir).wait_ready()
            yield Deployment(lab, client, reference_future.result(), servers,
                             servers["one_p"].url, servers["two_p"].url)
        finally:
            kill_all(list(servers.values()))
            client.close()
            if reference_future.done() and reference_future.exception() is None:
                reference_future.result().close()


def test_1p1d_tp2_prefill_answers_equal_colocated(deployment: Deployment) -> None:
    d_before = deployment.metrics("d")
    rx_before = deployment.lab["decode"].link_stats().rx_bytes
    for prompt in PROMPTS:
        deployment.assert_right(deployment.one_p, prompt)
    d_after = deployment.metrics("d")
    moved = delta(d_before, d_after, "kv_transfer_bytes_total")
    assert moved > 0
    assert d_after["kvbridge_kv_transfer_failures_total"] == 0
    # the KV came over D's NIC (UCX over TCP, not shared memory)
    assert deployment.lab["decode"].link_stats().rx_bytes - rx_before >= moved


def test_2p1d_answers_equal_colocated_and_use_both_prefills(deployment: Deployment) -> None:
    before = {name: deployment.metrics(name) for name in ("p1", "p2", "d")}
    tx_before = {h: deployment.lab[h].link_stats().tx_bytes for h in ("prefa", "prefb")}
    prompts = [prompt_of(100 + 40 * i, f"2p1d-{i}") for i in range(4)]
    for prompt in prompts:  # round robin: P1, P2, P1, P2
        deployment.assert_right(deployment.two_p, prompt)
    after = {name: deployment.metrics(name) for name in ("p1", "p2", "d")}
    for name, host in (("p1", "prefa"), ("p2", "prefb")):
        assert delta(before[name], after[name], "kv_grants_issued_total") == 2, name
        assert deployment.lab[host].link_stats().tx_bytes > tx_before[host]
    moved = delta(before["d"], after["d"], "kv_transfer_bytes_total")
    assert moved > 0 and after["d"]["kvbridge_kv_transfer_failures_total"] == 0


def _qdisc_stats(deployment: Deployment, host: str) -> dict[str, object]:
    out = subprocess.run(["tc", "-n", deployment.lab[host].netns, "-s", "-j", "qdisc", "show",
                          "dev", HOST_IFNAME], capture_output=True, text=True, check=True,
                         timeout=10).stdout
    [root] = [q for q in json.loads(out) if q.get("root")]
    return dict(root)


def test_slow_link_tbf_still_correct(deployment: Deployment) -> None:
    """P1's NIC shaped to 40 Mbit/s with a token bucket: the KV crawls, answers stay right."""
    netns = deployment.lab["prefa"].netns
    subprocess.run(["tc", "-n", netns, "qdisc", "replace", "dev", HOST_IFNAME, "root", "tbf",
                    "rate", "40mbit", "burst", "32kb", "latency", "500ms"],
                   check=True, capture_output=True, timeout=10)
    try:
        d_before = deployment.metrics("d")
        for i, num_chars in enumerate((300, 700)):
            deployment.assert_right(deployment.one_p, prompt_of(num_chars, f"tbf-{i}"))
        d_after = deployment.metrics("d")
        stats = _qdisc_stats(deployment, "prefa")
    finally:
        subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", HOST_IFNAME, "root"],
                       capture_output=True, timeout=10)
    moved = delta(d_before, d_after, "kv_transfer_bytes_total")
    assert stats["kind"] == "tbf"
    # the shaper carried the KV and had to hold packets back (it really limited the link)
    assert int(str(stats["bytes"])) >= moved > 0
    assert int(str(stats["overlimits"])) > 0, stats
    assert d_after["kvbridge_kv_transfer_failures_total"] == 0


def test_netem_delay_and_loss_still_correct(deployment: Deployment) -> None:
    """Delay and loss on both ends of the P1 <-> D path (needs the kernel's sch_netem)."""
    lab = deployment.lab
    try:
        for host in ("prefa", "decode"):  # tc netem, or the NFQUEUE delay line without sch_netem
            netem_or_skip(lab, host, delay_ms=15, jitter_ms=5, loss_pct=1.0)
        d_before = deployment.metrics("d")
        durations_s = []
        for i, num_chars in enumerate((200, 500)):
            started = time.monotonic()
            deployment.assert_right(deployment.one_p, prompt_of(num_chars, f"netem-{i}"))
            durations_s.append(time.monotonic() - started)
        d_after = deployment.metrics("d")
    finally:
        for host in ("prefa", "decode"):
            lab.clear_netem(host)
    assert delta(d_before, d_after, "kv_transfer_bytes_total") > 0
    assert d_after["kvbridge_kv_transfer_failures_total"] == 0
    # slower, not wrong: D asks P (delayed leaving D) and P answers (delayed leaving P)
    assert min(durations_s) >= 2 * (15 - 5) / 1e3, durations_s

