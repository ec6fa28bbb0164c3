"""Tests of the multi-host harness (tests/integration/netns.py) with real namespaces.

Each peer runs as its own Python process inside a lab host (``ip netns exec``):
a TCP echo for reachability, cuts and delay, and a ucxx client/server pair for a
real UCX transfer over the lab's veth links.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import LabFactory
from tests.integration.netns import (
    DEFAULT_SUBNET,
    Host,
    NetnsLab,
    cleanup_stale,
    list_namespaces,
    netem_or_skip,
    ucx_env,
    wait_for_line,
)

pytestmark = pytest.mark.integration

ECHO_PORT = 7007
UCX_PORT = 13337
UCX_PAYLOAD_NBYTES = 4 << 20

ECHO_SERVER = """
import socketserver, sys
class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data)
socketserver.ThreadingTCPServer.allow_reuse_address = True
with socketserver.ThreadingTCPServer((sys.argv[1], int(sys.argv[2])), Echo) as server:
    print("READY", flush=True)
    server.serve_forever()
"""

# argv: ip port connect_deadline_s num_round_trips. Prints JSON; exit 3 if unreachable.
ECHO_CLIENT = """
import json, os, socket, sys, time
ip, port, num_trips = sys.argv[1], int(sys.argv[2]), int(sys.argv[4])
end = time.monotonic() + float(sys.argv[3])
while True:
    try:
        attempt_s = max(0.05, min(1.0, end - time.monotonic()))
        sock = socket.create_connection((ip, port), timeout=attempt_s)
        break
    except OSError as exc:
        if time.monotonic() >= end:
            print(json.dumps({"error": repr(exc)}))
            sys.exit(3)
        time.sleep(0.05)
sock.settimeout(10)
rtts = []
for trip in range(num_trips):
    msg = os.urandom(64)
    start = time.monotonic()
    sock.sendall(msg)
    got = b""
    while len(got) < len(msg):
        got += sock.recv(len(msg) - len(got))
    rtts.append(time.monotonic() - start)
    assert got == msg, (trip, got, msg)
print(json.dumps({"local_ip": sock.getsockname()[0], "rtts_s": rtts}))
"""

UCX_SERVER = """
import asyncio, sys
import numpy as np, ucxx
async def main():
    done = asyncio.Event()
    async def serve(ep):
        header = np.empty(1, dtype=np.uint64)
        await asyncio.wait_for(ep.recv(header), 30)
        payload = np.empty(int(header[0]), dtype=np.uint8)
        await asyncio.wait_for(ep.recv(payload), 30)
        await asyncio.wait_for(ep.send(payload[::-1].copy()), 30)  # reversed: proves it was read
        await ep.close()
        done.set()
    listener = ucxx.create_listener(serve, port=int(sys.argv[1]))
    print("READY", listener.port, flush=True)
    await asyncio.wait_for(done.wait(), 60)
    listener.close()
asyncio.run(main())
"""

UCX_CLIENT = """
import asyncio, sys
import numpy as np, ucxx
async def main():
    ep = await asyncio.wait_for(ucxx.create_endpoint(sys.argv[1], int(sys.argv[2])), 30)
    payload = np.random.default_rng(8).integers(0, 256, int(sys.argv[3]), dtype=np.uint8)
    await asyncio.wait_for(ep.send(np.array([payload.size], dtype=np.uint64)), 30)
    await asyncio.wait_for(ep.send(payload), 30)
    back = np.empty_like(payload)
    await asyncio.wait_for(ep.recv(back), 30)
    await ep.close()
    ok = np.array_equal(back, payload[::-1])
    print("VERIFIED" if ok else f"MISMATCH at {np.flatnonzero(back != payload[::-1])[:8]}")
    sys.exit(0 if ok else 1)
asyncio.run(main())
"""


def start_echo(host: Host) -> subprocess.Popen[str]:
    server = host.popen([sys.executable, "-c", ECHO_SERVER, host.ip, str(ECHO_PORT)])
    wait_for_line(server, "READY", timeout_s=15)
    return server


def echo(client: Host, server: Host, *, deadline_s: float, num_trips: int = 3) -> dict[str, object]:
    args = [sys.executable, "-c", ECHO_CLIENT, server.ip, str(ECHO_PORT), str(deadline_s),
            str(num_trips)]
    proc = client.run(args, check=False, timeout_s=deadline_s + 20)
    assert proc.returncode in (0, 3), proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_hosts_on_one_switch_reach_each_other(netns_lab_factory: LabFactory) -> None:
    lab = netns_lab_factory(["a", "b", "c"])
    ips = [host.ip for host in lab.hosts.values()]
    assert len(set(ips)) == 3
    assert len(set(lab.namespaces())) == 4  # three hosts and the switch
    start_echo(lab["a"])
    for name in ("b", "c"):
        result = echo(lab[name], lab["a"], deadline_s=10)
        assert result.get("local_ip") == lab[name].ip, result  # came from the host's own NIC


def test_traffic_cannot_leave_the_lab(two_hosts: NetnsLab) -> None:
    for host in two_hosts.hosts.values():
        routes = host.run(["ip", "-4", "route", "show"]).stdout
        assert "default" not in routes
        assert routes.split()[0] == DEFAULT_SUBNET, routes
        links = host.run(["ip", "-o", "link", "show"]).stdout.splitlines()
        assert [line.split(":")[1].strip().split("@")[0] for line in links] == ["lo", "eth0"]
    outside = ("import socket\ntry: socket.create_connection(('192.0.2.1', 9), 2)\n"
               "except OSError as exc: print(exc.errno)\nelse: print('CONNECTED')\n")
    out = two_hosts["a"].run([sys.executable, "-c", outside]).stdout.strip()
    assert out == "101", out  # ENETUNREACH: no route, so no packet was even sent


def test_link_down_cuts_and_link_up_restores(two_hosts: NetnsLab) -> None:
    server, client = two_hosts["a"], two_hosts["b"]
    start_echo(server)
    assert "rtts_s" in echo(client, server, deadline_s=10)
    two_hosts.link_down(server)
    cut = echo(client, server, deadline_s=1.5)
    assert "error" in cut, cut
    two_hosts.link_up(server)
    assert "rtts_s" in echo(client, server, deadline_s=15)


def test_netem_delay_shows_in_round_trips(two_hosts: NetnsLab) -> None:
    server, client = two_hosts["a"], two_hosts["b"]
    start_echo(server)
    delay_ms = 100.0
    # tc netem, or the NFQUEUE delay line where the kernel has no sch_netem
    assert netem_or_skip(two_hosts, server, delay_ms=delay_ms) in ("tc", "nfqueue")
    result = echo(client, server, deadline_s=10, num_trips=3)
    rtts_s = result["rtts_s"]
    assert isinstance(rtts_s, list)
    # Every reply leaves the delayed host, so no round trip can beat the delay.
    assert min(rtts_s) >= 0.9 * delay_ms / 1000, rtts_s
    two_hosts.clear_netem(server)
    rtts_s = echo(client, server, deadline_s=10, num_trips=3)["rtts_s"]
    assert isinstance(rtts_s, list) and min(rtts_s) < 0.9 * delay_ms / 1000, rtts_s


# argv: ip port. Echoes UDP datagrams; READY once bound.
UDP_ECHO_SERVER = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind((sys.argv[1], int(sys.argv[2])))
print("READY", flush=True)
while True:
    data, peer = sock.recvfrom(2048)
    sock.sendto(data, peer)
"""

# argv: ip port num_trips. Prints how many of num_trips datagrams came back (0.3 s each).
UDP_ECHO_CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(0.3)
num_back = 0
for trip in range(int(sys.argv[3])):
    sock.sendto(trip.to_bytes(4, "big"), (sys.argv[1], int(sys.argv[2])))
    try:
        while int.from_bytes(sock.recv(64), "big") != trip:
            pass  # a late answer to an earlier trip
        num_back += 1
    except TimeoutError:
        pass
print(num_back)
"""


def test_netem_loss_drops_some_datagrams(two_hosts: NetnsLab) -> None:
    server, client = two_hosts["a"], two_hosts["b"]
    echo_server = server.popen([sys.executable, "-c", UDP_ECHO_SERVER, server.ip, "7001"])
    wait_for_line(echo_server, "READY", timeout_s=15)

    def num_back(num_trips: int) -> int:
        args = [sys.executable, "-c", UDP_ECHO_CLIENT, server.ip, "7001", str(num_trips)]
        return int(client.run(args, timeout_s=60).stdout)

    assert num_back(5) == 5
    netem_or_skip(two_hosts, server, loss_pct=50.0)
    try:
        lossy = num_back(40)
    finally:
        two_hosts.clear_netem(server)
    # every answer leaves the lossy host once: about half come back, surely not 0 or all
    assert 0 < lossy < 40, lossy
    assert num_back(5) == 5


def test_netem_rejects_bad_parameters(two_hosts: NetnsLab) -> None:
    for kwargs in ({"delay_ms": -1.0}, {"loss_pct": 101.0}, {"jitter_ms": 5.0}):
        with pytest.raises(ValueError, match=r"delay_ms=.*loss_pct="):
            two_hosts.netem("a", **kwargs)
    with pytest.raises(KeyError, match="'nosuch'"):
        two_hosts.netem("nosuch", delay_ms=1.0)


def test_ucx_transfer_between_namespaces(two_hosts: NetnsLab) -> None:
    server, client = two_hosts["a"], two_hosts["b"]
    env = ucx_env()
    listener = server.popen([sys.executable, "-c", UCX_SERVER, str(UCX_PORT)], env=env)
    wait_for_line(listener, "READY", timeout_s=30)
    before = server.link_stats()
    args = [sys.executable, "-c", UCX_CLIENT, server.ip, str(UCX_PORT), str(UCX_PAYLOAD_NBYTES)]
    result = client.run(args, env=env, check=False, timeout_s=60)
    assert result.returncode == 0 and "VERIFIED" in result.stdout, result.stdout + result.stderr
    assert listener.wait(timeout=30) == 0
    after = server.link_stats()
    # The payload crossed the lab's wire both ways, not shared memory.
    assert after.rx_bytes - before.rx_bytes >= UCX_PAYLOAD_NBYTES
    assert after.tx_bytes - before.tx_bytes >= UCX_PAYLOAD_NBYTES


def test_teardown_after_failure_kills_processes_and_namespaces() -> None:
    lab = NetnsLab(["a", "b"])
    with pytest.raises(RuntimeError, match="test body failed"), lab:
        sleeper = lab["a"].popen(["sleep", "600"])
        names = lab.namespaces()
        assert set(names) <= set(list_namespaces())
        raise RuntimeError("test body failed")
    assert sleeper.poll() == -signal.SIGKILL
    assert not set(names) & set(list_namespaces())
    assert not [ns for ns in list_namespaces() if ns.startswith(lab.base)]
    lab.close()  # idempotent


def test_sigterm_tears_the_lab_down(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    script = ("import sys, time\nfrom tests.integration.netns import NetnsLab\n"
              "with NetnsLab(['a', 'b']) as lab:\n"
              "    lab['b'].popen(['sleep', '600'])\n"
              "    print('UP', lab.base, flush=True)\n"
              "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=repo, stdout=subprocess.PIPE,
                            text=True)
    try:
        base = wait_for_line(proc, "UP", timeout_s=30)[-1].split()[1]
        assert [ns for ns in list_namespaces() if ns.startswith(base)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM  # torn down, then died of it
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert not [ns for ns in list_namespaces() if ns.startswith(base)]


def test_cleanup_stale_removes_only_dead_runs(two_hosts: NetnsLab) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names a run that no longer exists
    stale = f"kvb-{dead.pid}-abc123-a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
        removed = cleanup_stale()
        assert stale in removed
        assert stale not in list_namespaces()
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert set(two_hosts.namespaces()) <= set(list_namespaces())  # a live run: kept
    finally:
        subprocess.run(["ip", "netns", "del", stale], check=False, capture_output=True)


def test_bad_lab_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="'Bad'"):
        NetnsLab(["a", "Bad"])
    with pytest.raises(ValueError, match="'switch'"):
        NetnsLab(["switch"])
    with pytest.raises(ValueError, match=r"\['a', 'a'\]"):
        NetnsLab(["a", "a"])
    with pytest.raises(ValueError, match="8.8.8.0/24"):
        NetnsLab(["a"], subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="has 2"):
        NetnsLab(["a", "b", "c"], subnet="10.77.0.0/30")
