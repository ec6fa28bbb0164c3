"""Smoke tests of ``kvbridge bench serve``: options, the sweep plan, result parsing, table,
plot, skipped configurations, and one real run of one configuration.

``fixtures/vllm_bench_serve.json`` is what ``vllm bench serve --save-result``
wrote in a real ``kvbridge bench serve --quick`` run (the colocated
configuration at 2 req/s). The real run here (two vLLM servers, ``kvbridge proxy``,
4 short requests) checks that vLLM's load generator accepts the arguments,
reaches the servers through the front end, and that its JSON becomes a row;
a second one points ``--url`` at a vLLM server the test started, as a user
points it at a deployment. No time or speed is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbridge.bench import serve_bench, serve_configs
from kvbridge.bench import tables as bench_tables
from kvbridge.bench.cli import build_parser
from kvbridge.bench.plots import save_plot
from kvbridge.bench.serve_client import MAIN_RUN_MARK, client_argv, parse_result, wait_for_mark
from kvbridge.bench.vllm_models import build_model
from kvbridge.bench.vllm_servers import VllmServer, start_all
from kvbridge.cli.demo.procs import reserve_ports
from kvbridge.cli.main import main as kvbridge_main

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_bench_serve.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _raw() -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(FIXTURE.read_text())
    return raw


def _point(raw: dict[str, Any], rate: float, **changes: Any) -> dict[str, Any]:
    row = {"workload": "short", "sweep": "rate", "rate": rate, "concurrency": None,
           "seed": 1000, "input_len": 256, "output_len": 64, "loadavg": 1.0,
           **parse_result(raw, 64)}
    row.update(changes)
    return row


def test_a_saved_vllm_bench_serve_result_becomes_a_row() -> None:
    raw = _raw()
    row = parse_result(raw, 64)
    assert row["completed"] + row["failed"] == raw["num_prompts"]
    assert (row["num_short"], row["missing_output_tokens"], row["first_error"]) == (
        None, 0, None)  # saved without --save-detailed: no per-request lengths
    assert row["slo_attainment"] == pytest.approx(
        raw["request_goodput"] / raw["request_throughput"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert row[f"p50_{metric}_ms"] <= row[f"p99_{metric}_ms"]


def test_an_answer_cut_after_its_first_token_counts_as_short_not_whole() -> None:
    # vllm bench serve counts a request completed once a first token came
    raw = {**_raw(), "completed": 2, "failed": 1, "total_output_tokens": 65,
           "output_lens": [64, 1, 0], "errors": ["", "", "Bad Gateway"]}
    row = parse_result(raw, 64)
    assert (row["num_short"], row["missing_output_tokens"], row["first_error"]) == (
        1, 63, "Bad Gateway")
    report = {"settings": {"model": "m", "cores": "split", "repeats": 1, "workloads": {}},
              "configs": {"kvbridge-proxy": {"points": [
                  {"workload": "short", "sweep": "rate", "rate": 2.0, "concurrency": None,
                   "loadavg": 1.0, **row}]}}}
    assert not bench_tables.passed("serve", report)
    table = bench_tables.serve_table(report)
    assert "2/1/1" in table  # ok/short/failed
    assert "kvbridge-proxy short 2/s, first error: Bad Gateway" in table


def test_a_result_without_goodput_or_percentiles_is_refused_by_name() -> None:
    raw = _raw()
    del raw["p99_tpot_ms"], raw["request_goodput"]
    with pytest.raises(ValueError, match=r"missing \['request_goodput', 'p99_tpot_ms'\]"):
        parse_result(raw, 64)


def test_every_point_gets_its_own_seed_and_enough_prompts_for_its_concurrency() -> None:
    workload = serve_bench.WORKLOADS["short"]
    points = serve_bench.plan_points({"short": workload}, repeats=2)
    assert len(points) == 2 * (len(workload.rates) + len(workload.load_fractions)
                               + len(workload.concurrency))
    assert len({p.seed for _, _, p in points}) == len(points)
    c16 = [p for _, kind, p in points if kind == "concurrency" and p.concurrency == 16]
    assert all(p.num_prompts >= 32 and p.rate is None for p in c16)
    argv = client_argv(c16[0], "http://127.0.0.1:1", Path("/m"), Path("/r.json"))
    assert argv[argv.index("--request-rate") + 1] == "inf"
    assert argv[argv.index("--max-concurrency") + 1] == "16"
    assert argv[argv.index("--goodput") + 1:argv.index("--goodput") + 3] == [
        "ttft:1000", "tpot:100"]


def test_workloads_are_named_or_given_as_in_over_out() -> None:
    assert serve_bench.parse_workload("long")[1].input_len == 2048
    name, workload = serve_bench.parse_workload("64/8")
    assert (name, workload.input_len, workload.output_len) == ("64/8", 64, 8)
    with pytest.raises(ValueError, match="expected short or long or IN/OUT"):
        serve_bench.parse_workload("huge")
    with pytest.raises(ValueError, match=">= 2 output tokens"):
        serve_bench.parse_workload("64/1")


def test_the_command_line_takes_the_sweep() -> None:
    args = build_parser().parse_args(["serve", "--configs", "kvbridge-proxy", "--workloads",
                                      "short", "512/32", "--rates", "0.5,2", "--concurrency",
                                      "", "--repeats", "3", "--slo-tpot-ms", "50"])
    assert (args.workloads, args.rates, args.concurrency) == (["short", "512/32"],
                                                              [0.5, 2.0], [])
    assert (args.repeats, args.slo_tpot_ms, args.configs) == (3, 50.0, "kvbridge-proxy")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--rates", "0,1"])
    with pytest.raises(ValueError, match="unknown configuration 'dynamo'"):
        serve_bench.run(quick=True, configs=["dynamo"])
    with pytest.raises(ValueError, match="no rate and no concurrency point"):
        serve_bench.run(quick=True, rates=[], concurrency=[])


def _child_printing(log_path: Path, script: str) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen([sys.executable, "-u", "-c", script], stdout=log)


def test_the_profile_window_opens_when_the_client_starts_its_timed_part(tmp_path: Path) -> None:
    # the child: a start-up, the mark in the middle of a line's chunks, then the timed part
    log = tmp_path / "client.log"
    mark = MAIN_RUN_MARK.decode()
    proc = _child_printing(log, "import sys, time; print('loading the tokenizer'); "
                                f"time.sleep(0.3); sys.stdout.write({mark[:9]!r}); "
                                f"sys.stdout.flush(); time.sleep(0.2); print({mark[9:]!r}); "
                                "time.sleep(0.5)")
    seen: list[bytes] = []
    wait_for_mark(proc, log, time.monotonic() + 30, lambda: seen.append(log.read_bytes()))
    assert proc.returncode == 0 and len(seen) == 1 and MAIN_RUN_MARK in seen[0]
    # a client that never says so: no window start (the caller keeps its first snapshot)
    proc = _child_printing(log, "print('an older vllm bench serve')")
    wait_for_mark(proc, log, time.monotonic() + 30, lambda: seen.append(b""))
    assert proc.returncode == 0 and len(seen) == 1
    proc = _child_printing(log, "import time; time.sleep(30)")
    with pytest.raises(subprocess.TimeoutExpired):
        wait_for_mark(proc, log, time.monotonic() + 0.3, lambda: None)
    proc.kill()
    proc.wait()


def test_a_configuration_without_its_tool_is_skipped_with_the_install_command(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(serve_configs, "router_command", lambda: None)
    points = serve_bench.plan_points({"short": serve_bench.WORKLOADS["short"]}, 1)
    ticks: list[str] = []
    result = serve_bench.run_config("colocated", points, tmp_path, tmp_path,
                                    {"cores": "split"}, ticks.append)
    assert result == {"skipped": f"vllm-router is not installed ({serve_configs.ROUTER_INSTALL})"}
    assert len(ticks) == len(points)  # the progress bar still reaches its end
    assert serve_configs.missing_tool("kvbridge-proxy") is None  # needs kvbridge only


def _report() -> dict[str, Any]:
    raw = _raw()
    short = serve_bench.WORKLOADS["short"]
    missed = _point(raw, 4.0, slo_attainment=0.5, request_goodput=1.0)
    return {"settings": {"model": "m", "cores": "split", "repeats": 1,
                         "workloads": {"short": {**vars(short), "rates": (2.0, 4.0)}}},
            "configs": {"colocated": {"skipped": "vllm-router is not installed (pip ...)"},
                        "kvbridge-proxy": {"points": [_point(raw, 2.0), missed]},
                        "nixl-router": {"points": [_point(raw, 2.0, failed=3)],
                                        "error": "ClientError: ran past 300 s"}}}


def test_the_table_shows_each_point_goodput_rate_skips_and_failures(tmp_path: Path) -> None:
    report = _report()
    table = bench_tables.serve_table(report)
    rows = [[cell.strip() for cell in line.split("|")[1:-1]]
            for line in table.splitlines() if line.startswith("|")]
    assert [row[:3] for row in rows[2:]] == [["short", "2/s", "kvbridge-proxy"],
                                             ["short", "2/s", "nixl-router"],
                                             ["short", "4/s", "kvbridge-proxy"]]
    assert rows[4][7] == "50%"
    share = report["configs"]["kvbridge-proxy"]["points"][0]["slo_attainment"]
    expected = "2 req/s" if share >= 0.9 else "none"
    assert f"kvbridge-proxy: highest rate with >= 90% within SLO: {expected}" in table
    assert "colocated SKIPPED: vllm-router is not installed" in table
    assert "nixl-router FAILED after 1 point(s): ClientError" in table
    assert "where the time went" not in table  # no point has a profile
    points = report["configs"]["kvbridge-proxy"]["points"]
    for point, cpu in zip(points, (90.0, 100.0), strict=True):
        point["profile"] = {"P": {"cpu_percent": cpu, "queue_ms": 1000.0, "prefill_ms": 50.0,
                                  "decode_ms": None, "requests": 2},
                            "front": {"cpu_percent": 4.0}}
    points[1]["rate"] = 2.0  # a repeat of 2/s
    profile_rows = [line for line in bench_tables.serve_table(report).splitlines()
                    if "P / front" in line]
    assert [[c.strip() for c in row.split("|")[4:9]] for row in profile_rows] == [
        ["P / front", "95 / 4", "1,000", "50", "-"]]  # the repeats' mean
    points[1]["rate"] = 4.0
    # a failed request counts against kvbridge only
    assert bench_tables.passed("serve", report)
    report["configs"]["kvbridge-proxy"]["points"][0]["failed"] = 1
    assert not bench_tables.passed("serve", report)
    save_plot("serve", report, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == PNG_MAGIC


def test_a_deployments_report_counts_its_failures_and_draws(tmp_path: Path) -> None:
    short = serve_bench.WORKLOADS["short"]
    url = "http://router:8000"
    report = {"settings": {"model": "m", "repeats": 1, "deployment": True,
                           "workloads": {"short": {**vars(short), "rates": (2.0,)}}},
              "configs": {url: {"url": url, "points": [_point(_raw(), 2.0)]}}}
    table = bench_tables.serve_table(report)
    assert "model m; running front ends (--url); 1 repeat(s)" in table
    assert f"- {url}: highest rate with >= 90% within SLO: " in table
    assert bench_tables.passed("serve", report)
    report["configs"][url]["points"][0]["failed"] = 1  # not named kvbridge-*, still counts
    assert not bench_tables.passed("serve", report)
    save_plot("serve", report, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == PNG_MAGIC


def test_goodput_rate_is_the_highest_rate_every_repeat_met() -> None:
    points = [{"sweep": "rate", "rate": r, "slo_attainment": s}
              for r, s in ((1.0, 1.0), (2.0, 0.95), (2.0, 0.85), (4.0, 0.9))]
    points.append({"sweep": "concurrency", "rate": None, "slo_attainment": 1.0})
    assert bench_tables.serve_goodput_rate(points) == 4.0
    assert bench_tables.serve_goodput_rate(points[:3]) == 1.0
    assert bench_tables.serve_goodput_rate(points[2:3]) is None


def _vllm_or_skip() -> None:
    if importlib.util.find_spec("vllm") is None:
        reason = "vllm is not installed (make setup-vllm)"
        if os.environ.get("KVBRIDGE_REQUIRE_VLLM") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


@pytest.mark.integration  # two vLLM servers, kvbridge proxy, vllm bench serve
@pytest.mark.timeout(600)
def test_one_configuration_runs_vllm_bench_serve_end_to_end(tmp_path: Path) -> None:
    _vllm_or_skip()
    code = kvbridge_main(["bench", "serve", "--quick", "--configs", "kvbridge-proxy",
                          "--workloads", "64/8", "--rates", "4", "--concurrency", "",
                          "--num-prompts", "4", "--no-plot", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "serve.json").read_text())
    result = record["result"]["configs"]["kvbridge-proxy"]
    assert "error" not in result, result["error"]
    [point] = result["points"]
    # a request may fail (a synchronous load past its deadline, under vLLM's default
    # kv_load_failure_policy): counted, and the exit code says so
    assert point["completed"] + point["failed"] == 4 and point["completed"] >= 1
    assert point["num_short"] is not None  # per-request lengths saved (--save-detailed)
    assert code == (1 if point["failed"] or point["num_short"] else 0)
    raw = json.loads(Path(point["result_file"]).read_text())
    assert (raw["num_prompts"], raw["request_rate"]) == (4, 4.0)
    assert point["p99_ttft_ms"] > 0 and point["p50_tpot_ms"] > 0
    # the profile: each process's CPU, and vLLM's phases for every request both served
    profile = point["profile"]
    assert set(profile) == {"P", "D", "front"}
    assert profile["P"]["requests"] == profile["D"]["requests"] == 4
    assert all(profile[name]["cpu_percent"] > 0 for name in profile)
    assert profile["P"]["prefill_ms"] > 0 and profile["D"]["decode_ms"] > 0
    assert profile["D"]["read_ms"] > 0 and profile["P"]["read_ms"] is None  # D reads, P not
    # kvbridge's read timeline: P's grants and D's reads, each from its own server
    assert profile["P"]["grant_publish_ms"] is not None and profile["D"]["grant_publish_ms"] is None
    assert all(profile["D"][key] is not None for key in (
        "read_queue_ms", "read_grant_ms", "read_copy_ms", "read_collect_ms"))
    assert "kvbridge's read timeline" in bench_tables.serve_profile_table(record["result"])


def test_the_timeline_table_shows_ps_and_ds_phases_and_only_where_measured() -> None:
    def point(load: float, p: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
        return {"workload": "short", "sweep": "rate", "rate": load,
                "profile": {"P": p, "D": d}}

    timeline = {"grant_publish_ms": 4.0, "grant_wait_ms": None}
    reads = {"read_queue_ms": 0.5, "read_grant_ms": 0.0, "read_copy_ms": 1.0,
             "read_collect_ms": 0.75, "read_ms": 1.5}
    report = {"configs": {
        "kvbridge-router": {"points": [point(2.0, timeline, reads),
                                       point(2.0, {**timeline, "grant_publish_ms": 6.0},
                                             reads)]},
        "nixl-router": {"points": [point(2.0, {}, {"read_ms": 9.0})]}}}
    lines = bench_tables.serve_timeline_table(report)
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in "\n".join(lines).splitlines() if "router" in line]
    assert rows == [["short", "2/s", "kvbridge-router", "5.00", "-", "0.50", "0.00", "1.00",
                     "0.75", "1.50"]]  # the mean of the repeats; NIXL has no timeline
    assert bench_tables.serve_timeline_table({"configs": {"nixl-router": report["configs"][
        "nixl-router"]}}) == []


def test_url_refuses_what_would_start_servers_and_needs_a_model() -> None:
    args = build_parser().parse_args(["serve", "--url", "http://a:1", "--url", "http://b:2",
                                      "--model", "m", "--tokenizer", "t",
                                      "--server-url", "http://a:9"])
    assert (args.url, args.model, args.tokenizer, args.server_url) == (
        ["http://a:1", "http://b:2"], "m", "t", ["http://a:9"])
    deployment = serve_bench.Deployment(("http://a:1",))
    with pytest.raises(ValueError, match="--configs and --cores .* do not apply"):
        serve_bench.run(quick=True, configs=["colocated"], model="m", deployment=deployment)
    with pytest.raises(ValueError, match="--configs and --cores .* do not apply"):
        serve_bench.run(quick=True, cores="split", model="m", deployment=deployment)
    with pytest.raises(ValueError, match="--url needs --model"):
        serve_bench.run(quick=True, deployment=deployment)
    with pytest.raises(ValueError, match="expected http"):
        serve_bench.run(quick=True, model="m", deployment=serve_bench.Deployment(("a:1",)))


@pytest.mark.integration  # one vLLM server, vllm bench serve
@pytest.mark.timeout(600)
def test_url_measures_a_running_server_and_leaves_it_running(tmp_path: Path) -> None:
    _vllm_or_skip()
    model = build_model(tmp_path / "model", "dense")
    [port] = reserve_ports([1])
    server = VllmServer("deployment", model, port, tmp_path / "server.log")
    start_all([server])
    try:
        code = kvbridge_main(["bench", "serve", "--quick", "--url", server.url,
                              "--server-url", server.url, "--model", str(model),
                              "--workloads", "64/8", "--rates", "", "--concurrency", "2",
                              "--num-prompts", "4", "--no-plot", "--out", str(tmp_path)])
        record = json.loads((tmp_path / "serve.json").read_text())
        settings = record["result"]["settings"]
        assert settings["deployment"] and settings["model"] == str(model)
        result = record["result"]["configs"][server.url]
        assert "error" not in result, result["error"]
        [point] = result["points"]
        assert (point["completed"], point["failed"], point["num_short"]) == (4, 0, 0)
        assert code == 0 and result["warmup"]["completed"] == 4
        raw = json.loads(Path(point["result_file"]).read_text())
        assert (raw["num_prompts"], raw["max_concurrency"]) == (4, 2)
        # a deployment's profile: the phases of the servers named by --server-url
        assert point["profile"][server.url]["requests"] == 4
        assert "cpu_percent" not in point["profile"][server.url]
        [row] = [[cell.strip() for cell in line.strip("|").split("|")]
                 for line in bench_tables.serve_profile_table(record["result"]).splitlines()
                 if "c=2" in line]
        assert row[2:5] == [server.url, server.url, "-"]  # its CPU is not known: said so
        # nothing of the deployment was started or stopped by the benchmark
        assert "logs" not in result
        assert httpx.get(f"{server.url}/v1/models", timeout=10.0).status_code == 200
    finally:
        server.stop()
