"""``kvbridge bench serve --netns``: P and D on two namespace hosts, UCX over TCP.

Without root: each configuration's servers as placed (command, address,
environment, what each connector advertises), the refusal with ``--url``, the
report's and table's network. With root and ``ip`` (skipped otherwise): the
caller joins the hosts' switch and reaches a host's port, a second joined lab
is refused, and nothing is left after. One full-only run (``make test-full``:
two vLLM servers, vllm-router, ~2 min on 2 cores) sweeps ``kvbridge-router``
end to end and checks on D's ``/metrics`` that its reads went over UCX, not
same-host copies. No speed is asserted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.bench import serve_bench, serve_configs, serve_netns
from kvbridge.bench import tables as bench_tables
from kvbridge.bench.cli import build_parser
from kvbridge.bench.peers.placement import (
    LOOPBACK,
    NETNS_PREFIX,
    NetnsUnavailableError,
    Placement,
    Side,
    check_netns,
    netns_placement,
)
from kvbridge.bench.vllm_servers import VllmServer, scrape, total
from kvbridge.cli.main import main as kvbridge_main
from kvbridge.integrations.vllm.settings import parse_settings
from kvbridge.transfer.protocol import host as same_host

HOSTS = Placement("netns-tcp", Side(("ip", "netns", "exec", "ns-a"), "10.77.0.1"),
                  Side(("ip", "netns", "exec", "ns-b"), "10.77.0.2"), {"UCX_TLS": "tcp"},
                  caller_ip="10.77.0.254")
LAB_SUBNET = ipaddress.ip_network("10.77.0.0/24")


def _servers(name: str, tmp_path: Path) -> list[VllmServer]:
    return serve_configs.servers(name, tmp_path / "model", tmp_path, True, 128)


def _env(server: VllmServer, tmp_path: Path) -> dict[str, str]:
    from kvbridge.bench.vllm_servers import server_environ

    return server_environ(tmp_path, server.env)


@pytest.mark.parametrize("name", ["kvbridge-router", "kvbridge-proxy"])
def test_kvbridge_p_and_d_listen_and_advertise_their_host_over_tcp(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _servers(name, tmp_path)
    placed = serve_netns.place(before, HOSTS)
    assert [s.name for s in placed] == ["P", "D"]
    for server, side, core_of in zip(placed, (HOSTS.serve, HOSTS.read), before, strict=True):
        argv = server.argv()
        assert argv[:4] == ["ip", "netns", "exec", side.prefix[-1]]
        assert argv[argv.index("--host") + 1] == side.ip
        assert server.url == f"http://{side.ip}:{server.port}"
        assert server.cpus == core_of.cpus and server.cpus is not None  # pinned as today
        env = _env(server, tmp_path)
        assert env["UCX_TLS"] == "tcp"
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == core_of.env["VLLM_CPU_OMP_THREADS_BIND"]
        assert server.kv_transfer_config is not None
        config = json.loads(server.kv_transfer_config)
        assert config["kv_connector"] == "KVBridgeConnector"
        assert config["kv_load_failure_policy"] == "recompute"  # the rest as on loopback
        assert config["kv_connector_extra_config"] == {"host": side.ip}
        # the connector takes it: a non-loopback host with the pair's cluster secret, and
        # no same-host copies under UCX_TLS=tcp
        for key in ("KVBRIDGE_SECRET", "UCX_TLS"):
            monkeypatch.setenv(key, env[key])
        assert parse_settings(config["kv_connector_extra_config"]).secret() == \
            env["KVBRIDGE_SECRET"].encode()
        assert not same_host.allowed(True)
    assert placed[0].env["KVBRIDGE_SECRET"] == placed[1].env["KVBRIDGE_SECRET"]
    assert len(placed[0].env["KVBRIDGE_SECRET"]) == 64
    assert placed[0].env["KVBRIDGE_SECRET"] != serve_netns.place(
        _servers(name, tmp_path), HOSTS)[0].env["KVBRIDGE_SECRET"]  # one per configuration
    assert all(s.prefix == () and s.host == "127.0.0.1" for s in before)  # not changed


def test_nixl_p_and_d_advertise_their_host_and_use_tcp_only(tmp_path: Path) -> None:
    placed = serve_netns.place(_servers("nixl-router", tmp_path), HOSTS)
    for server, side in zip(placed, (HOSTS.serve, HOSTS.read), strict=True):
        env = _env(server, tmp_path)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == side.ip
        assert env["UCX_TLS"] == "tcp"  # not loopback's tcp,sm,self
        assert server.kv_transfer_config is not None
        assert json.loads(server.kv_transfer_config) == {
            "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        assert "KVBRIDGE_SECRET" not in server.env


def test_colocated_replicas_run_on_the_two_hosts_too(tmp_path: Path) -> None:
    placed = serve_netns.place(_servers("colocated", tmp_path), HOSTS)
    assert [(s.name, s.host, s.prefix[-1]) for s in placed] == [
        ("replica0", "10.77.0.1", "ns-a"), ("replica1", "10.77.0.2", "ns-b")]
    assert all(s.kv_transfer_config is None for s in placed)
    front = serve_configs.front_end("colocated", placed, tmp_path)
    urls = front.argv[front.argv.index("--worker-urls") + 1:]
    assert urls == [f"http://10.77.0.1:{placed[0].port}", f"http://10.77.0.2:{placed[1].port}"]
    assert front.url.startswith("http://127.0.0.1:")  # the caller's namespace


def test_on_loopback_the_servers_are_left_as_they_are(tmp_path: Path) -> None:
    servers = _servers("kvbridge-router", tmp_path)
    assert serve_netns.place(servers, LOOPBACK) is servers
    assert servers[0].argv()[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def test_netns_with_url_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="use one or the other"):
        serve_bench.run(quick=True, model="m", netns=True,
                        deployment=serve_bench.Deployment(("http://a:1",)))
    out = tmp_path / "out"
    code = kvbridge_main(["bench", "serve", "--netns", "--url", "http://a:1", "--model", "m",
                          "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"kvbridge bench serve --netns: {serve_netns.WITH_URL}\n"
    assert not out.exists()
    assert build_parser().parse_args(["serve", "--netns"]).netns


def test_without_root_it_says_why_and_runs_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = tmp_path / "out"
    code = kvbridge_main(["bench", "serve", "--netns", "--quick", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvbridge bench serve --netns: ")
    assert "euid=1000" in err and not out.exists()


def _run_recording(monkeypatch: pytest.MonkeyPatch, netns: bool) -> tuple[
        dict[str, Any], list[Placement]]:
    """serve_bench.run with fake hosts and configurations that start nothing."""
    seen: list[Placement] = []

    @contextlib.contextmanager
    def fake_hosts(join_caller: bool) -> Iterator[Placement]:
        assert join_caller
        yield HOSTS

    def fake_config(name: str, points: Any, model: Path, out: Path, plan: Any, tick: Any,
                    placement: Placement, *_: Any) -> dict[str, Any]:
        seen.append(placement)
        return {"points": []}

    monkeypatch.setattr(serve_bench, "netns_placement", fake_hosts)
    monkeypatch.setattr(serve_bench, "run_config", fake_config)
    report = serve_bench.run(quick=True, configs=["colocated", "kvbridge-router"],
                             model="m", netns=netns)
    return report, seen


def test_the_report_and_table_say_which_network_and_who_ran_where(
        monkeypatch: pytest.MonkeyPatch) -> None:
    report, seen = _run_recording(monkeypatch, netns=True)
    assert seen == [HOSTS, HOSTS]  # every configuration in the same layout
    assert report["network"] == "netns-tcp"
    assert report["placement"] == {
        "network": "netns-tcp", "serve_ip": "10.77.0.1", "read_ip": "10.77.0.2",
        "child_env": {"UCX_TLS": "tcp"}, "caller_ip": "10.77.0.254",
        "roles": {"P / replica 0": "10.77.0.1", "D / replica 1": "10.77.0.2",
                  "front end, client": "10.77.0.254"}}
    assert ("cores split; network netns-tcp (P / replica 0 10.77.0.1, D / replica 1 "
            "10.77.0.2, front end, client 10.77.0.254; UCX_TLS=tcp)") in \
        bench_tables.serve_table(report)
    report, seen = _run_recording(monkeypatch, netns=False)
    assert seen == [LOOPBACK, LOOPBACK] and report["network"] == "loopback"
    assert "cores split; network loopback;" in bench_tables.serve_table(report)


# ---------------------------------------------------------------- real namespaces


def _why_no_netns() -> str | None:
    try:
        check_netns()
    except NetnsUnavailableError as exc:
        return str(exc)
    return None


needs_netns = pytest.mark.skipif(_why_no_netns() is not None, reason=str(_why_no_netns()))


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def _ours() -> tuple[list[str], list[str]]:
    """This process's lab namespaces and links (``join_caller``'s end) in this namespace."""
    spaces = [line.split()[0] for line in _ip("netns", "list").splitlines()
              if line.startswith(f"{NETNS_PREFIX}-{os.getpid()}-")]
    links = [link["ifname"] for link in json.loads(_ip("-j", "link", "show"))
             if link["ifname"].startswith(f"{NETNS_PREFIX}-")]
    return spaces, links


@pytest.mark.integration
@needs_netns
def test_the_caller_joins_the_hosts_switch_and_leaves_nothing_behind() -> None:
    with netns_placement(join_caller=True) as placement:
        assert placement.caller_ip is not None
        assert ipaddress.ip_address(placement.caller_ip) in LAB_SUBNET
        spaces, [link] = _ours()
        assert len(spaces) == 3  # hosts a and b and their switch
        listener = subprocess.Popen(
            [*placement.serve.prefix, sys.executable, "-c",
             "import socket; s = socket.create_server((__import__('sys').argv[1], 0)); "
             "print(s.getsockname()[1], flush=True); c, a = s.accept(); "
             "c.sendall(a[0].encode())", placement.serve.ip],
            stdout=subprocess.PIPE, text=True)
        assert listener.stdout is not None
        port = int(listener.stdout.readline())
        with socket.create_connection((placement.serve.ip, port), timeout=10) as conn:
            seen_from = conn.recv(64).decode()
        assert seen_from == placement.caller_ip  # over the veths, from the caller's address
        assert listener.wait(timeout=10) == 0
        # a second joined lab on the same subnet would split the routes: refused, removed
        with pytest.raises(NetnsUnavailableError, match="already routes"), \
                netns_placement(join_caller=True):
            pass
        assert _ours() == (spaces, [link])
    assert _ours() == ([], [])
    assert not [r for r in json.loads(_ip("-4", "-j", "route", "show"))
                if r.get("dst", "").startswith("10.77.0.")]


@pytest.mark.integration  # two vLLM servers on two namespace hosts, vllm-router
@pytest.mark.full  # what the loopback run of test_bench_serve checks, between hosts
@pytest.mark.timeout(900)
@needs_netns
def test_kvbridge_router_between_two_hosts_reads_over_ucx(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if serve_configs.missing_tool("kvbridge-router"):
        pytest.skip(str(serve_configs.missing_tool("kvbridge-router")))
    d_metrics: list[list[Any]] = []
    sweep = serve_bench._sweep

    def sweep_then_read_d(target: serve_bench.Target, *args: Any) -> int:
        done = sweep(target, *args)
        d_metrics.append(scrape(target.server_urls[target.server_names.index("D")]))
        return done  # before run_config stops the servers

    monkeypatch.setattr(serve_bench, "_sweep", sweep_then_read_d)
    code = kvbridge_main(["bench", "serve", "--netns", "--quick", "--configs",
                          "kvbridge-router", "--no-plot", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "serve_netns.json").read_text())["result"]
    result = record["configs"]["kvbridge-router"]
    assert "error" not in result, result["error"]
    assert code == 0
    assert record["network"] == "netns-tcp" and _ours() == ([], [])
    assert result["warmup"]["completed"] == 4
    assert result["points"] and all(  # every request completed, every answer whole
        p["completed"] > 0 and (p["failed"], p["num_short"], p["missing_output_tokens"])
        == (0, 0, 0) for p in result["points"])
    [d] = d_metrics
    print("D:", {name: total(d, f"vllm:kvbridge_{name}_total") for name in (
        "transfers", "transfer_failures", "local_copies", "transfer_bytes", "sync_loads_late")})
    # a read may fail on a loaded machine (a synchronous load past its deadline): D
    # recomputes it (policy recompute), the request still completes; not asserted
    assert total(d, "vllm:kvbridge_transfers_total") > 0
    assert total(d, "vllm:kvbridge_local_copies_total") == 0  # UCX over TCP, not a copy
    # the KV D read left host a through its eth0
    assert record["placement"]["serve_sent_nbytes"] >= total(
        d, "vllm:kvbridge_transfer_bytes_total") > 0
