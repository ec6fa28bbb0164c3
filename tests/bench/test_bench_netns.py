"""``kvbridge bench transfer --netns``: every system between two namespace hosts over TCP.

Real namespaces, real processes (skipped where this process cannot make network
namespaces: not root, or no ``ip``). Checked: the report says which network ran
and where; kvbridge's bytes verified and crossed the serving host's eth0;
``ucx_perftest`` ran; the hosts are gone afterwards, also after an exception,
Ctrl-C or SIGTERM; without root the command says why and runs nothing. No
speed is asserted.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.bench import transfer_bench
from kvbridge.bench.peers.placement import NETNS_PREFIX, NetnsUnavailableError, check_netns
from kvbridge.bench.transfer_agents import _NUM_WARMUP
from kvbridge.bench.transfer_bench import PIECE_NBYTES
from kvbridge.cli.main import main as kvbridge_main

REPO = Path(__file__).resolve().parents[2]
LAB_SUBNET = ipaddress.ip_network("10.77.0.0/24")


def _why_no_netns() -> str | None:
    try:
        check_netns()  # root and `ip`, as tests/integration/conftest.py requires
    except NetnsUnavailableError as exc:
        return str(exc)
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             check=False)
    return None if listing.returncode == 0 else f"`ip netns list` failed: {listing.stderr}"


_NO_NETNS = _why_no_netns()
needs_netns = pytest.mark.skipif(_NO_NETNS is not None, reason=str(_NO_NETNS))
pytestmark = pytest.mark.integration


def _labs_of(pid: int) -> list[str]:
    """Namespaces of the bench's labs made by process ``pid``."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             check=True).stdout
    return [line.split()[0] for line in listing.splitlines()
            if line.startswith(f"{NETNS_PREFIX}-{pid}-")]


@needs_netns
def test_netns_run_reports_tcp_between_two_hosts_and_removes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = kvbridge_main(["bench", "transfer", "--netns", "--peers", "ucx_perftest",
                          "--pieces", "1,16", "--no-plot", "--out", str(tmp_path)])
    assert code == 0
    assert not _labs_of(os.getpid())
    assert not (tmp_path / "transfer.json").exists()  # the loopback run's file is left alone
    result = json.loads((tmp_path / "transfer_netns.json").read_text())["result"]
    assert result["network"] == "netns-tcp"
    placement = result["placement"]
    assert placement["child_env"] == {"UCX_TLS": "tcp"}
    serve_ip, read_ip = (ipaddress.ip_address(placement[k]) for k in ("serve_ip", "read_ip"))
    assert serve_ip != read_ip and serve_ip in LAB_SUBNET and read_ip in LAB_SUBNET
    ours = result["systems"]["kvbridge"]
    assert [r["nbytes"] for r in ours] == [PIECE_NBYTES, 16 * PIECE_NBYTES]
    assert all(r["verified"] and r["gbps_median"] > 0 for r in ours)
    # every byte kvbridge read left host a through its eth0: not loopback, not shared memory
    read_nbytes = sum(r["nbytes"] * (r["num_iters"] + _NUM_WARMUP) for r in ours)
    assert placement["serve_sent_nbytes"] >= read_nbytes
    perftest = result["systems"]["ucx_perftest"]
    assert isinstance(perftest, list), perftest  # not {"unavailable": ...}
    assert [r["nbytes"] for r in perftest] == [PIECE_NBYTES, 16 * PIECE_NBYTES]
    assert all(r["gbps_median"] > 0 for r in perftest)
    out = capsys.readouterr().out
    assert "two netns hosts over TCP (UCX_TLS=tcp)" in out and "x ucx_perftest" in out


@needs_netns
@pytest.mark.parametrize("interruption", [RuntimeError("a system failed"), KeyboardInterrupt()])
def test_hosts_are_removed_when_the_run_is_interrupted(
        monkeypatch: pytest.MonkeyPatch, interruption: BaseException) -> None:
    seen: list[list[str]] = []

    def fail(*_args: object) -> None:
        seen.append(_labs_of(os.getpid()))
        raise interruption

    monkeypatch.setattr(transfer_bench, "_run_all", fail)
    with pytest.raises(type(interruption)):
        transfer_bench.run(pieces=[1], netns=True)
    assert len(seen[0]) == 3  # hosts a and b and their switch existed during the run
    assert not _labs_of(os.getpid())


@needs_netns
def test_sigterm_mid_run_removes_the_hosts_and_their_processes() -> None:
    bench = subprocess.Popen([sys.executable, "-m", "kvbridge.bench.transfer_bench", "--netns",
                              "--quick"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        give_up = time.monotonic() + 60
        while not (agents := _agents_in(_labs_of(bench.pid))):  # kvbridge's server started
            assert bench.poll() is None and time.monotonic() < give_up
            time.sleep(0.1)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == -signal.SIGTERM  # dies of it, after cleaning up
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert not _labs_of(bench.pid)
    assert not [pid for pid in agents if _running(pid)]


def _agents_in(namespaces: list[str]) -> list[int]:
    """Pids of kvbridge's benchmark agents in ``namespaces`` (not the lab's own commands)."""
    pids = [int(pid) for ns in namespaces for pid in subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()]
    return [pid for pid in pids if b"kvbridge.bench.transfer_agents" in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait a while to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(("setting", "says"), [("euid", "euid=1000"), ("path", "`ip` not found")])
def test_without_root_or_ip_it_says_why_and_runs_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        setting: str, says: str) -> None:
    if setting == "euid":
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    else:
        monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no `ip`
    out = tmp_path / "out"
    code = kvbridge_main(["bench", "transfer", "--netns", "--peers", "", "--pieces", "1",
                          "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvbridge bench transfer --netns: ") and says in err
    assert "Traceback" not in err and not out.exists()
