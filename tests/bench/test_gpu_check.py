"""``scripts/gpu_check.sh`` / ``benchmarks.gpu_check`` without a GPU: arguments, wheels, dry run.

The checks themselves need a GPU (the device run's numbers are in
docs/benchmarks.md, "GPU"); here: the script refuses bad arguments and missing
wheels with exit 2, the wheel list pins what CI's venv runs and covers every
distribution the checks import beyond the GPU machine's image, and the dry run
goes through the kernel, kernel-bench and engine P/D steps on the CPU path
(Triton interpreted), reporting a failed or skipped step as a failure.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def script(*args: str, wheels: Path | None = None, timeout_s: float = 600
           ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PY": sys.executable, "PYTHONUNBUFFERED": "1"}
    if wheels is not None:
        env["KVBRIDGE_WHEELS"] = str(wheels)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


def test_unknown_steps_and_a_bad_budget_are_refused(tmp_path: Path) -> None:
    with pytest.raises(gpu_check.GpuCheckError, match="unknown steps"):
        gpu_check.parse_args(["--steps", "kernels,gpu-magic"])
    with pytest.raises(gpu_check.GpuCheckError, match="budget"):
        gpu_check.parse_args(["--budget-s", "0"])
    result = script("--cpu-dry-run", "--steps", "nope", "--out", str(tmp_path))
    assert result.returncode == 2 and "unknown steps ['nope']" in result.stderr


def test_missing_wheels_are_named_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "msgspec-0.22.0-cp312-cp312-manylinux_2_28_x86_64.whl").touch()
    result = script("--steps", "kernels", "--out", str(tmp_path / "out"), wheels=tmp_path)
    assert result.returncode == 2
    assert "libucx-cu12==" in result.stderr and "msgspec" not in result.stderr.split(":")[-2]
    assert "--fetch-wheels" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_wheel_list_pins_what_ci_runs() -> None:
    pins = gpu_check.wheel_list()
    assert pins, "empty wheel list"
    for name, version in pins.items():
        assert importlib.metadata.version(name) == version, name


def test_the_wheel_list_covers_what_the_checks_import() -> None:
    """Every distribution the checks load, less the GPU image's, is a carried wheel."""
    probe = (
        "import sys, json, importlib.metadata as md\n"
        "import kvbridge.transfer.agent, kvbridge.reference.engine.engine\n"
        "import kvbridge.reference.engine.rank_worker\n"
        "import kvbridge.connector.worker, benchmarks.gpu_check, kvbridge.bench.e2e_bench\n"
        "import kvbridge.bench.transfer_agents, kvbridge.bench.kernel_bench\n"
        "import kvbridge.bench.peers.ucx_perftest\n"
        "import tests.kernels.checks\n"
        "found = md.packages_distributions()\n"
        "tops = {m.split('.')[0] for m in sys.modules}\n"
        "print(json.dumps(sorted({d for t in tops for d in found.get(t, [])})))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=300).stdout
    imported = {gpu_check.normalize(d) for d in json.loads(out.splitlines()[-1])}
    needed = imported - gpu_check.DEVICE_IMAGE - gpu_check.OPTIONAL_IMPORTS - {"kvbridge"}
    assert "ucxx-cu12" in needed  # the probe saw the transfer stack at all
    assert needed <= set(gpu_check.wheel_list()), needed - set(gpu_check.wheel_list())


def test_dry_run_goes_through_the_steps_on_the_cpu(tmp_path: Path) -> None:
    result = script("--cpu-dry-run", "--steps", "kernels,kernel-bench,engine-pd",
                    "--kernel-tests", "triton and test_mla", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {r["step"]: r for r in report["results"]}
    assert [r["ok"] for r in steps.values()] == [True, True, True]
    assert steps["kernels"]["numbers"]["passed"] == 3
    bench = steps["kernel-bench"]["numbers"]
    assert bench["config"]["device"] == "cpu" and bench["results"]
    engines = steps["engine-pd"]["numbers"]
    assert set(engines) == {"d-mirror-same", "d-mirror-relayout", "d-device-same",
                            "d-device-relayout"}
    for numbers in engines.values():
        assert numbers["nbytes"] > 0 and all(row["equal"] for row in numbers["rows"])
    assert "3 passed" in (tmp_path / "gpu_check.log").read_text()  # pytest's own output


def test_a_failing_or_unrun_step_fails_the_run(tmp_path: Path) -> None:
    result = script("--cpu-dry-run", "--steps", "kernels", "--kernel-tests",
                    "no_such_kernel_test", "--out", str(tmp_path / "a"))
    assert result.returncode == 1 and "FAIL" in result.stdout
    result = script("--cpu-dry-run", "--steps", "kernels", "--budget-s", "2",
                    "--out", str(tmp_path / "b"))
    assert result.returncode == 1 and "SKIP" in result.stdout
    report = json.loads((tmp_path / "b" / "gpu_check.json").read_text())
    assert report["results"][0]["ok"] is None
