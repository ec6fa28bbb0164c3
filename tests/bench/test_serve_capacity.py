"""``kvbridge bench serve``'s rate points as fractions of capacity (``serve_capacity.py``):
the capacity a saved ``vllm bench serve`` result shows, points placed from it, the
options, and the table. No server is started: the measurement's result is the saved
one of ``fixtures/vllm_bench_serve.json`` (test_bench_serve.py says where it is from).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbridge.bench import serve_bench
from kvbridge.bench import tables as bench_tables
from kvbridge.bench.cli import build_parser
from kvbridge.bench.cli import main as bench_main
from kvbridge.bench.plots import save_plot
from kvbridge.bench.serve_capacity import (
    CAPACITY_SEED,
    CapacityError,
    CapacityProbe,
    LoadFractionError,
    capacity_from_result,
    parse_capacity,
    parse_load_fractions,
    place_rates,
    rate_at,
)
from kvbridge.bench.serve_client import ClientError, Point, client_argv, parse_result

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_bench_serve.json"
SHORT, LONG = serve_bench.WORKLOADS["short"], serve_bench.WORKLOADS["long"]


def _raw(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {**json.loads(FIXTURE.read_text()), **changes}
    return raw


def _capacity_point() -> Point:
    return Point(256, 64, 8, None, 4, 1000.0, 100.0, CAPACITY_SEED)


def test_capacity_is_the_request_throughput_the_measurement_saw() -> None:
    raw = _raw()
    capacity = capacity_from_result("short", raw, "colocated", _capacity_point(),
                                    Path("r.json"))
    assert capacity.req_per_s == raw["request_throughput"]
    assert capacity.req_per_s == pytest.approx(raw["completed"] / raw["duration"])
    assert (capacity.how, capacity.config, capacity.concurrency, capacity.completed) == (
        "measured", "colocated", 4, 8)
    assert capacity.mean_e2el_ms == raw["mean_e2el_ms"] and capacity.result_file == "r.json"


@pytest.mark.parametrize("changes", [{"failed": 1, "completed": 7},
                                     {"completed": 0, "request_throughput": 0.0}])
def test_a_measurement_that_did_not_serve_every_request_gives_no_capacity(
        changes: dict[str, Any]) -> None:
    with pytest.raises(CapacityError, match=f"{changes['completed']} completed"):
        capacity_from_result("short", _raw(**changes), "colocated", _capacity_point(),
                             Path("r.json"))


def test_defaults_judge_at_70_percent_and_above() -> None:
    for workload in (SHORT, LONG):
        assert workload.rates == () and 0.7 in workload.load_fractions
        assert max(workload.load_fractions) > 0.7
        assert max(workload.concurrency) == workload.capacity_concurrency
    assert serve_bench.QUICK["rates"] == (2.0,) and serve_bench.QUICK["load_fractions"] == ()


def test_load_fractions_become_the_same_rates_in_every_repeat() -> None:
    planned = serve_bench.plan_points({"short": SHORT}, repeats=2)
    unplaced = [p for _, _, p in planned if p.load_fraction is not None]
    assert len(unplaced) == 8 and all(p.rate is None for p in unplaced)
    with pytest.raises(ValueError, match="0.3x capacity has no rate"):  # never sent at once
        client_argv(unplaced[0], "http://127.0.0.1:1", Path("/m"), Path("/r.json"))
    placed = place_rates(planned, {"short": 4.0})
    rates = [(p.load_fraction, p.rate) for _, kind, p in placed if kind == "rate"]
    assert rates == 2 * [(0.3, 1.2), (0.5, 2.0), (0.7, 2.8), (0.9, 3.6)]
    assert [p.seed for _, _, p in placed] == [p.seed for _, _, p in planned]
    assert [p for _, kind, p in placed if kind == "concurrency"] == [
        p for _, kind, p in planned if kind == "concurrency"]
    argv = client_argv(placed[2][2], "http://127.0.0.1:1", Path("/m"), Path("/r.json"))
    assert argv[argv.index("--request-rate") + 1] == "2.8"
    assert rate_at(0.3, 0.0871) == 0.0261  # 3 significant digits, never 0 on a slow host
    with pytest.raises(CapacityError, match="no capacity measured or given for short"):
        place_rates(planned, {"long": 1.0})


def test_the_probe_measures_once_for_every_configuration_and_repeat() -> None:
    calls: list[tuple[str, Point]] = []
    lines: list[str] = []

    def measure(workload: str, point: Point) -> tuple[dict[str, Any], Path]:
        calls.append((workload, point))
        return _raw(), Path(f"{workload}.json")

    def fails(workload: str, point: Point) -> tuple[dict[str, Any], Path]:
        raise ClientError("vllm bench serve exited with 1")

    probe = CapacityProbe({"short": SHORT, "long": LONG}, {"long": 0.9}, lines.append)
    planned = serve_bench.plan_points({"short": SHORT, "long": LONG}, repeats=2)
    assert probe.needs_measurement
    with pytest.raises(ClientError):  # colocated failed: the next configuration measures
        probe.place(planned, "colocated", fails)
    per_config = [probe.place(planned, name, measure)
                  for name in ("kvbridge-proxy", "nixl-router")]
    assert not probe.needs_measurement
    [(workload, point)] = calls  # short only: long's capacity was given
    assert (workload, point.concurrency, point.num_prompts, point.rate) == ("short", 16, 32,
                                                                            None)
    assert point.seed not in {p.seed for _, _, p in planned} | {1}  # not a sweep's, not warm-up's
    assert per_config[0] == per_config[1]
    record = probe.record()
    capacity = _raw()["request_throughput"]
    assert record["short"]["config"] == "kvbridge-proxy"
    assert record["short"]["rates"] == [rate_at(f, capacity) for f in SHORT.load_fractions]
    assert record["long"] == {**record["long"], "how": "given", "req_per_s": 0.9,
                              "rates": [0.27, 0.45, 0.63, 0.81]}
    long_rates = sorted({p.rate for w, kind, p in per_config[0] if w == "long" and
                         kind == "rate"})
    assert long_rates == [0.27, 0.45, 0.63, 0.81]
    assert lines == [f"capacity of short: {capacity:.3g} req/s, kvbridge-proxy's throughput "
                     f"at concurrency 16 (8 requests in 6.0 s, mean e2e latency 2,158 ms)"]


def test_a_given_capacity_names_a_workload_with_load_fractions() -> None:
    with pytest.raises(CapacityError, match=r"--capacity huge: not among .*\['short'\]"):
        CapacityProbe({"short": SHORT}, {"huge": 1.0})
    fixed = serve_bench.Workload(256, 64, (2.0,), (4,), 8, 1000.0, 100.0)
    with pytest.raises(CapacityError, match="--capacity short: its rate points are fixed"):
        CapacityProbe({"short": fixed}, {"short": 1.0})
    assert not CapacityProbe({"short": fixed}, {}).needs_measurement


def test_load_fractions_and_capacities_are_parsed_or_refused_by_value() -> None:
    assert parse_load_fractions("0.3,0.5,0.7,0.9") == (0.3, 0.5, 0.7, 0.9)
    assert parse_load_fractions("") == ()
    for text, match in (("0,0.5", r"\[0.0\]: expected shares of capacity in \(0, 2\]"),
                        ("70", r"\[70.0\]"), ("-0.5", r"\[-0.5\]"), ("nan", "nan"),
                        ("0.5,x", "expected comma-separated numbers"),
                        ("0.5,0.5", r"\[0.5\] given more than once")):
        with pytest.raises(LoadFractionError, match=match):
            parse_load_fractions(text)
    assert issubclass(LoadFractionError, ValueError) and issubclass(CapacityError, ValueError)
    assert parse_capacity("short=6.5") == ("short", 6.5)
    assert parse_capacity("512/32=3") == ("512/32", 3.0)
    for text in ("short", "short=0", "=3", "short=inf", "short=x"):
        with pytest.raises(CapacityError, match="expected WORKLOAD=REQ_PER_S"):
            parse_capacity(text)


def test_the_command_line_takes_fractions_and_capacities_and_refuses_bad_ones(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--load-fractions", "0.5,0.9", "--capacity",
                                      "short=6.5", "--capacity", "long=0.9"])
    assert (args.load_fractions, args.rates) == ([0.5, 0.9], None)
    assert dict(args.capacity) == {"short": 6.5, "long": 0.9}
    for argv, says in ((["--load-fractions", "0,1"], "(0, 2]"),
                       (["--load-fractions", "0.5", "--rates", "1"], "not allowed with"),
                       (["--capacity", "short"], "WORKLOAD=REQ_PER_S")):
        with pytest.raises(SystemExit) as exit_info:
            bench_main(["serve", *argv])
        assert exit_info.value.code == 2 and says in capsys.readouterr().err

    def started(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the run started although its options were refused")

    monkeypatch.setattr(serve_bench, "build_model", started)
    monkeypatch.setattr(serve_bench, "run_config", started)
    code = bench_main(["serve", "--workloads", "short", "--capacity", "long=1",
                       "--cores", "shared", "--no-plot", "--out", str(tmp_path)])
    assert code == 2 and "--capacity long: not among the run's workloads" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="--rates and --load-fractions"):
        serve_bench.run(quick=True, rates=[1.0], load_fractions=[0.5])
    with pytest.raises(LoadFractionError):
        serve_bench.run(quick=True, load_fractions=[0.0])


def test_colocated_runs_first_when_it_is_measured(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    runs: list[tuple[str, Any]] = []

    def run_config(name: str, *args: Any) -> dict[str, Any]:
        runs.append((name, args[-1]))  # the capacity probe
        return {"skipped": "not started by this test"}

    monkeypatch.setattr(serve_bench, "build_model", lambda *_args: tmp_path)
    monkeypatch.setattr(serve_bench, "run_config", run_config)
    common: dict[str, Any] = {"configs": ["kvbridge-proxy", "colocated"],
                              "workloads": ["64/8"], "concurrency": [], "cores": "shared",
                              "out": str(tmp_path)}
    report = serve_bench.run(quick=False, **common)
    assert [name for name, _ in runs] == ["colocated", "kvbridge-proxy"]
    assert runs[0][1] is runs[1][1]  # one probe: one capacity for both
    assert report["settings"]["capacity"] == {}  # neither reached its sweep
    assert "capacity: not measured" in bench_tables.serve_table(report)
    runs.clear()
    report = serve_bench.run(quick=False, rates=[1.0], **common)
    assert [name for name, _ in runs] == ["kvbridge-proxy", "colocated"]  # nothing measured
    report = serve_bench.run(quick=False, capacities={"64/8": 2.0}, **common)
    assert report["settings"]["capacity"]["64/8"]["rates"] == [0.6, 1.0, 1.4, 1.8]


def _row(fraction: float | None, rate: float, attainment: float = 1.0,
         **changes: Any) -> dict[str, Any]:
    return {"workload": "short", "sweep": "rate", "rate": rate, "load_fraction": fraction,
            "concurrency": None, "seed": 1000, "input_len": 256, "output_len": 64,
            "loadavg": 1.0, **parse_result(_raw(), 64), "slo_attainment": attainment,
            **changes}


def test_the_table_says_each_load_as_a_share_of_capacity_and_in_req_per_s(
        tmp_path: Path) -> None:
    capacity = capacity_from_result("short", _raw(), "colocated", _capacity_point(),
                                    Path("r.json"))
    probe = CapacityProbe({"short": SHORT}, {}, lambda _line: None)
    probe.place([], "colocated", lambda _w, _p: (_raw(), Path("r.json")))
    rates = [rate_at(f, capacity.req_per_s) for f in SHORT.load_fractions]
    points = [_row(f, r, attainment=0.5 if f == 0.7 else 1.0)
              for f, r in zip(SHORT.load_fractions, rates, strict=True)][::-1]
    points.append(_row(None, 4.0, sweep="concurrency", concurrency=4))
    report = {"settings": {"model": "m", "cores": "split", "repeats": 1,
                           "workloads": {"short": vars(SHORT)}, "capacity": probe.record()},
              "configs": {"colocated": {"points": points}}}
    table = bench_tables.serve_table(report)
    loads = [line.split("|")[2].strip() for line in table.splitlines()
             if line.startswith("|")][2:]
    assert loads == [f"{f:g}x ({r:g}/s)" for f, r in zip(SHORT.load_fractions, rates,
                                                          strict=True)] + ["c=4"]
    assert loads[2] == "0.7x (0.929/s)"
    # 0.9x met the SLO but 0.7x did not: DistServe's highest rate is still 0.9x's
    assert f"colocated: highest rate with >= 90% within SLO: 0.9x capacity ({rates[3]:g} " \
           f"req/s)" in table
    assert f"capacity: {capacity.req_per_s:.3g} req/s, colocated's throughput at " \
           f"concurrency 16" in table
    assert f"rate points 0.3x = {rates[0]:g}/s" in table
    save_plot("serve", report, tmp_path / "serve.png")


def test_fixed_rates_keep_their_label_and_sort_by_value() -> None:
    points = [_row(None, 10.0), _row(None, 2.0)]
    report = {"settings": {"model": "m", "cores": "split", "repeats": 1,
                           "workloads": {"short": {**vars(SHORT), "load_fractions": ()}}},
              "configs": {"colocated": {"points": points}}}
    table = bench_tables.serve_table(report)
    loads = [line.split("|")[2].strip() for line in table.splitlines()
             if line.startswith("|")][2:]
    assert loads == ["2/s", "10/s"]
    assert "highest rate with >= 90% within SLO: 10 req/s" in table
    assert "capacity" not in table.split("- workload")[1]
