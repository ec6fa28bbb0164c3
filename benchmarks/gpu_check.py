"""The GPU path on a real GPU: compiled kernels exact, CUDA caches moved, GB/s (issue #32).

``scripts/gpu_check.sh`` installs the carried wheels (``scripts/gpu_wheels.txt``)
and runs this module on the GPU machine; ``--cpu-dry-run`` runs the same steps
on the CPU path (Triton under ``TRITON_INTERPRET=1``), which CI tests. Steps, each
in its own process with its own deadline, reported pass/fail with its numbers::

    kernels       the kernel tests (tests/kernels) on CUDA tensors: compiled Triton,
                  every parametrisation of the interpreter runs, exact (torch.equal);
                  and UCX sending GPU tensors (tests/transfer)
    kernel-bench  pack/unpack GB/s beside a device-to-device copy_ of the same bytes
                  and the three-pass torch relayout (kvbridge/bench/kernel_bench.py)
    engine-pd     the reference engine, P and D each with its own worker process and
                  CUDA caches: P/D answers equal P's colocated ones, D with P's block
                  size and layout and with others, staged through pinned host mirrors
                  (``host_buffer``) and through device buffers (the caches themselves:
                  Triton pack, one UCX message per chunk, Triton unpack)
    cuda-read     two agent processes with CUDA caches, no host buffer: the blocks
                  move GPU to GPU (device staging buffers over UCX's cuda_ipc), bytes
                  verified, GB/s beside the host-staged path (device->host copy, host
                  read, host->device)
    ucx-yardstick ucx_perftest between two processes, host and CUDA memory (on demand)
    kernel-tune   kernel-bench with other tile sizes and warps (on demand)

Everything lands in ``--out``: ``gpu_check.json`` (every step's result) and
``gpu_check.log`` (every step's output). Exit status 0 only if every step passed.
Run: ``python -m benchmarks.gpu_check --out DIR [--cpu-dry-run] [--steps a,b]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = ("kernels", "kernel-bench", "engine-pd", "cuda-read", "ucx-yardstick", "kernel-tune")
#: what runs without --steps (the last two are measurements to choose designs by)
DEFAULT_STEPS = STEPS[:4]
#: each step's deadline on the GPU (seconds); the whole run stays under 8 minutes
STEP_TIMEOUT_S = {"kernels": 200, "kernel-bench": 60, "engine-pd": 150, "cuda-read": 80,
                  "ucx-yardstick": 90, "kernel-tune": 160}
TOTAL_BUDGET_S = 450
#: the kernel test modules that run on CUDA tensors (tests/kernels/helpers.DEVICE)
KERNEL_TESTS = ("test_pack_unpack.py", "test_copy_blocks.py", "test_roundtrip.py",
                "test_src_offset.py", "test_fused_kv.py", "test_properties.py")
#: UCX sends and receives tensors, a GPU's too (device staging buffers)
TENSOR_TRANSPORT_TEST = "tests/transfer/test_transport_inproc.py::test_data_in_tensors"
#: on a GPU the torch-path parametrisations are the CPU's; only Triton's run
GPU_KERNEL_SELECTION = "not torch"


#: Python distributions the GPU machine's image has (the device tool's KINDS.md
#: list): whatever else the checks import travels as wheels (scripts/gpu_wheels.txt)
DEVICE_IMAGE = frozenset({
    "torch", "triton", "numpy", "prometheus-client", "nvidia-ml-py", "cuda-bindings",
    "cuda-core", "cuda-pathfinder", "pytest", "pytest-timeout", "hypothesis", "setuptools",
    "tqdm", "typing-extensions", "safetensors",
})
#: imported where installed, not needed (torch looks for dill)
OPTIONAL_IMPORTS = frozenset({"dill"})
WHEEL_LIST = REPO_ROOT / "scripts" / "gpu_wheels.txt"


def wheel_list(path: Path = WHEEL_LIST) -> dict[str, str]:
    """``{distribution: version}`` of the wheels the GPU machine gets (names normalised)."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise GpuCheckError(f"{path}: {line!r} pins no version")
            pins[normalize(name)] = version
    return pins


def normalize(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


class GpuCheckError(RuntimeError):
    """A step could not run as asked (bad arguments, no CUDA where it is needed); also
    the GPU probe's (``gpu_probe.py``) bad arguments."""


def pick(text: str, known: Sequence[str], what: str) -> list[str]:
    """The comma-separated names in ``text``, in its order.

    Raises:
        GpuCheckError: none, or one that is not in ``known`` (the message names them).
    """
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise GpuCheckError(f"unknown {what} {unknown or text!r}; choose from "
                            f"{', '.join(known)}")
    return names


@dataclass
class StepResult:
    """One step's outcome: ``ok`` None when it did not run (out of time, unavailable)."""

    step: str
    ok: bool | None
    seconds: float = 0.0
    numbers: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


@dataclass(frozen=True)
class Options:
    """What the parent passes to every step."""

    device: str  # "cuda", or "cpu" for the dry run
    kernel_selection: str  # pytest -k expression for the kernel tests
    bench_blocks: tuple[int, ...]
    bench_quick: bool
    read_blocks: tuple[int, ...]
    read_iters: int


def script_parser(module: str, doc: str, outputs: str, dry_run: str
                  ) -> argparse.ArgumentParser:
    """A GPU script's parser with the arguments they all take: ``--out`` (default
    ``$OUT``, else ``gpu-check-out`` for ``gpu_check``) for ``outputs``, and
    ``--cpu-dry-run``."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}",
                                     description=doc.splitlines()[0])
    default_out = os.environ.get("OUT", module.replace("_", "-") + "-out")
    parser.add_argument("--out", default=default_out, help=f"folder for {outputs} (default $OUT)")
    parser.add_argument("--cpu-dry-run", action="store_true", help=dry_run)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``GpuCheckError`` for an unknown step or a bad number."""
    parser = script_parser("gpu_check", __doc__, "gpu_check.json and gpu_check.log",
                           "run the steps on the CPU path (Triton interpreted)")
    parser.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                        help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--kernel-tests", default=None,
                        help="pytest -k expression for the kernel tests (default: all "
                             "Triton ones on a GPU, one small set in the dry run)")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                        help="deadline of the whole run; steps past it are not started")
    parser.add_argument("--run-step", help=argparse.SUPPRESS)  # child: one step
    parser.add_argument("--options", help=argparse.SUPPRESS)  # child: Options as JSON
    parser.add_argument("--result", help=argparse.SUPPRESS)  # child: where its JSON goes
    args = parser.parse_args(argv)
    args.steps = pick(args.steps, STEPS, "steps")
    if not args.budget_s > 0:
        raise GpuCheckError(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def options_for(args: argparse.Namespace) -> Options:
    """Sizes and selections of a GPU run, or of the (much smaller) CPU dry run."""
    if args.cpu_dry_run:
        return Options(device="cpu",
                       kernel_selection=args.kernel_tests or "triton and test_mla",
                       bench_blocks=(8,), bench_quick=True, read_blocks=(4,), read_iters=2)
    return Options(device="cuda", kernel_selection=args.kernel_tests or GPU_KERNEL_SELECTION,
                   bench_blocks=(256, 1024), bench_quick=False, read_blocks=(16, 64, 256),
                   read_iters=20)


# --------------------------------------------------------------------------- parent


def run_all(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[StepResult]:
    """Run the chosen steps one by one, each in its own process; write the results."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = options_for(args)
    deadline = time.monotonic() + args.budget_s
    results: list[StepResult] = []
    with open(out / "gpu_check.log", "w") as log_file:
        for step in args.steps:
            left = deadline - time.monotonic()
            timeout = min(STEP_TIMEOUT_S[step] * (3 if args.cpu_dry_run else 1), left)
            if timeout < 5:
                results.append(StepResult(step, None, detail="not run: the run's budget is spent"))
                continue
            log(f"== {step} ({opts.device}, deadline {timeout:.0f} s)")
            result = _run_child(step, opts, timeout, log_file)
            results.append(result)
            log(f"   {_verdict(result)} in {result.seconds:.1f} s: {result.detail}")
    report = {"environment": environment(), "options": asdict(opts),
              "results": [asdict(r) for r in results]}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    log(summary(results))
    return results


def _run_child(step: str, opts: Options, timeout_s: float, log_file: Any) -> StepResult:
    """``step`` in a child process; its result, or a failure saying why there is none."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--run-step", step,
               "--options", json.dumps(asdict(opts)), "--result", str(result_path)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
        if opts.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        log_file.write(f"\n===== {step}: {' '.join(cmd[:5])}\n")
        log_file.flush()
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return StepResult(step, False, time.monotonic() - started,
                              detail=f"timed out after {timeout_s:.0f} s (see gpu_check.log)")
        finally:
            _kill_group(proc)  # whatever the step left behind (engine workers, agents)
        seconds = time.monotonic() - started
        if not result_path.exists():
            return StepResult(step, False, seconds,
                              detail=f"exited {rc} without a result (see gpu_check.log)")
        result = StepResult(**json.loads(result_path.read_text()))
        result.seconds = seconds
        if rc != 0 and result.ok:
            result.ok, result.detail = False, f"exited {rc} after passing: {result.detail}"
        return result


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _verdict(result: StepResult) -> str:
    return {True: "PASS", False: "FAIL", None: "SKIP"}[result.ok]


def summary(results: Sequence[StepResult]) -> str:
    """One line per step: verdict, seconds and what it measured."""
    lines = ["", f"{'step':14} {'result':6} {'s':>6}  detail"]
    for r in results:
        lines.append(f"{r.step:14} {_verdict(r):6} {r.seconds:6.1f}  {r.detail}")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Versions and the device, for the report (no step depends on it)."""
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
    except ImportError as exc:
        info["torch"] = f"missing: {exc}"
    for name in ("triton", "ucxx", "msgspec"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not needed
            info[name] = f"not importable: {exc}"
    return info


# --------------------------------------------------------------------------- steps


def step_kernels(opts: Options) -> StepResult:
    """The kernel tests on ``opts.device`` tensors, in a pytest child process."""
    env = {**os.environ, "KVBRIDGE_TEST_DEVICE": opts.device}
    files = [str(Path("tests/kernels") / name) for name in KERNEL_TESTS]
    files.append(TENSOR_TRANSPORT_TEST)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
           opts.kernel_selection, *files]
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # as it comes: a step killed at its deadline keeps its log
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
    output = "".join(lines)
    counts = pytest_counts(output)
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    tail = output.strip().splitlines()[-1:] or ["(no output)"]
    return StepResult("kernels", ok, numbers=counts, detail=tail[0])


def pytest_counts(output: str) -> dict[str, int]:
    """``{"passed": n, "failed": m, ...}`` from pytest's closing line."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    return {word: int(n) for n, word in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", lines[-1])}


def step_kernel_bench(opts: Options) -> StepResult:
    """pack/unpack GB/s beside copy_ and the three-pass relayout, on ``opts.device``."""
    import torch

    from kvbridge.bench import kernel_bench

    _require_device(opts)
    report = kernel_bench.run(opts.bench_quick, list(opts.bench_blocks), reps=5)
    config = report["config"]
    assert isinstance(config, dict)
    if str(config["device"]) != opts.device:
        return StepResult("kernel-bench", False, detail=f"ran on {config['device']}")
    rows = report["results"]
    assert isinstance(rows, list)
    worst = min(r["vs_memcpy"] for r in rows)
    print(json.dumps(report, indent=1))
    return StepResult("kernel-bench", True, numbers={"config": config, "results": rows},
                      detail=f"{len(rows)} cases on {config['device']} ({config['impl']}), "
                             f"x copy_ {worst:.2f}..{max(r['vs_memcpy'] for r in rows):.2f}, "
                             f"torch {torch.__version__}")


def step_engine_pd(opts: Options) -> StepResult:
    """The reference engine P/D with host-buffer staging; answers equal colocated."""
    from kvbridge.bench.e2e_bench import run_colocated, run_pd
    from kvbridge.cli.demo.procs import reserve_ports
    from kvbridge.reference.engine.engine import LLMEngine
    from kvbridge.reference.engine.engine_config import ConnectorSettings, EngineConfig
    from kvbridge.reference.engine.request import SamplingParams
    from kvbridge.topology import KVLayout

    _require_device(opts)

    def engine(name: str, block_size: int, layout: KVLayout, host_buffer: bool) -> LLMEngine:
        [port] = reserve_ports([1])
        connector = ConnectorSettings(engine_id=f"gpu-{name}", transfer_base_port=port,
                                      host_buffer=host_buffer)
        return LLMEngine(EngineConfig(model="tiny", device=opts.device, block_size=block_size,
                                      kv_layout=layout, num_blocks=256, connector=connector))

    prompts = [[256, *b"tiny"], [256, *b"one block of prompt, more or less"],
               [256, *(b"Disaggregated serving moves the KV cache from P to D. " * 3)]]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    numbers: dict[str, Any] = {}
    problems: list[str] = []
    for staging in ("mirror", "device"):  # host-buffer staging, or the caches themselves
        host_buffer = staging == "mirror"
        p_name = f"p-{staging}"
        engines = {p_name: engine(p_name, 16, KVLayout.HND, host_buffer)}
        try:
            for name, block_size, layout in ((f"d-{staging}-same", 16, KVLayout.HND),
                                             (f"d-{staging}-relayout", 32, KVLayout.NHD)):
                engines[name] = engine(name, block_size, layout, host_buffer)
            expected = [run_colocated(engines[p_name], f"colo-{i}", prompt, greedy)[0]
                        for i, prompt in enumerate(prompts)]
            for name in list(engines)[1:]:
                rows = []
                for i, prompt in enumerate(prompts):
                    tokens, row = run_pd(engines[p_name], engines[name], f"{name}-{i}", prompt,
                                         greedy)
                    row["equal"] = tokens == expected[i]
                    rows.append(row)
                    if tokens != expected[i]:
                        problems.append(f"{name} prompt {i}: {tokens} != colocated "
                                        f"{expected[i]}")
                stats = engines[name].get_stats().connector
                moved = 0 if stats is None else stats.nbytes
                numbers[name] = {"rows": rows, "nbytes": moved,
                                 "num_transfers": 0 if stats is None else stats.num_transfers}
                if not moved:
                    problems.append(f"{name}: no bytes came through the connector")
        finally:
            for e in engines.values():
                e.shutdown()
    moved = ", ".join(f"{name} {n['nbytes']} B" for name, n in numbers.items())
    detail = "; ".join(problems) or (
        f"{len(numbers) * len(prompts)} P/D answers equal colocated on {opts.device} ({moved})")
    return StepResult("engine-pd", not problems, numbers=numbers, detail=detail)


def step_cuda_read(opts: Options) -> StepResult:
    """CUDA blocks between two agent processes over UCX, beside the host-staged path."""
    from benchmarks.gpu_reads import NUM_LAYERS, HostStagedRead, block_nbytes, p50_s
    from kvbridge.bench.transfer_agents import AgentPair

    _require_device(opts)
    pool = max(opts.read_blocks) * 2
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        with contextlib.ExitStack() as stack:
            device_pair = stack.enter_context(AgentPair(
                NUM_LAYERS, pool, 60.0, local_copy=False, name="kvbridge-cuda",
                device=opts.device))
            staged = stack.enter_context(HostStagedRead(pool, opts.device, 60.0))
            for num_blocks in opts.read_blocks:
                nbytes = num_blocks * block_nbytes()
                device = device_pair.measure(num_blocks, opts.read_iters, nbytes)
                host = staged.measure(num_blocks, opts.read_iters)
                row = {"num_blocks": num_blocks, "nbytes": nbytes,
                       "device_p50_ms": p50_s(device) * 1e3,
                       "device_gbps": nbytes / p50_s(device) / 1e9,
                       "device_verified": device.verified, **host, "device_note": device.note,
                       "rndv_scheme": os.environ.get("UCX_RNDV_SCHEME", "kvbridge's default")}
                rows.append(row)
                print(json.dumps(row))
                if not (device.verified and host["host_verified"]):
                    problems.append(f"{num_blocks} blocks: bytes wrong (device {device.note}; "
                                    f"host verified {host['host_verified']})")
    except Exception as exc:  # noqa: BLE001 - the step's outcome, reported whole
        problems.append(f"{type(exc).__name__}: {exc}")
    detail = "; ".join(problems) or ", ".join(
        f"{r['num_blocks']} blocks GPU to GPU {r['device_gbps']:.2f} GB/s vs through the host "
        f"{r['staged_gbps']:.2f}" for r in rows)
    return StepResult("cuda-read", not problems and bool(rows),
                      numbers={"num_layers": NUM_LAYERS, "rows": rows}, detail=detail)


def step_ucx_yardstick(opts: Options) -> StepResult:
    """``ucx_perftest`` between two processes: what UCX itself moves, host and device.

    Contiguous messages and scatter-gather lists of 32 KiB pieces (one block of one
    layer's K or V, as kvbridge's direct reads send them), two-sided and one-sided.
    """
    from kvbridge.bench.peers.ucx_perftest import PerftestError, run_perftest

    memories = ["host", opts.device] if opts.device != "cpu" else ["host"]
    cases = [("tag_bw", 1 << 22, 1), ("tag_bw", 1 << 26, 1), ("tag_bw", 1 << 22, 128),
             ("ucp_get", 1 << 22, 1), ("ucp_get", 1 << 26, 1)]
    rows: list[dict[str, Any]] = []
    for memory in memories:
        for test, nbytes, pieces in cases:
            row: dict[str, Any] = {"memory": memory, "test": test, "nbytes": nbytes,
                                   "pieces": pieces}
            try:
                run = run_perftest(nbytes, max(20, (1 << 28) // nbytes), 5, 60.0, test,
                                   memory=memory, num_pieces=pieces)
                row["gbps"] = run.gbps_overall
            except PerftestError as exc:
                row["error"] = str(exc)[-300:]
            rows.append(row)
            print(json.dumps(row))
    ok = any("gbps" in r for r in rows)
    return StepResult("ucx-yardstick", ok, numbers={"rows": rows}, detail=", ".join(
        f"{r['memory']} {r['test']} {r['nbytes'] >> 20} MiB/{r['pieces']}: "
        + (f"{r['gbps']:.1f} GB/s" if "gbps" in r else "failed") for r in rows))


def step_kernel_tune(opts: Options) -> StepResult:
    """kernel-bench's cases with other tile sizes and warps per program."""
    from kvbridge.bench import kernel_bench
    from kvbridge.kernels import triton_kernels

    _require_device(opts)
    blocks = list(opts.bench_blocks)
    rows: list[dict[str, Any]] = []
    for tile_words in (4096, 8192, 16384):
        for warps in (4, 8, 16):
            triton_kernels._TILE_WORDS, triton_kernels._NUM_WARPS = tile_words, warps
            report = kernel_bench.run(opts.bench_quick, blocks, reps=3)
            results = report["results"]
            assert isinstance(results, list)
            for r in results:
                rows.append({"tile_words": tile_words, "num_warps": warps, "case": r["case"],
                             "num_blocks": r["num_blocks"],
                             "ours_gbps": r["ours_gbps"], "vs_memcpy": r["vs_memcpy"]})
            print(json.dumps(rows[-len(results):]))
    best = max(rows, key=lambda r: sum(x["vs_memcpy"] for x in rows
                                       if (x["tile_words"], x["num_warps"])
                                       == (r["tile_words"], r["num_warps"])))
    return StepResult("kernel-tune", True, numbers={"rows": rows},
                      detail=f"best on average: tile {best['tile_words']} words, "
                             f"{best['num_warps']} warps")


def _require_device(opts: Options) -> None:
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise GpuCheckError("no CUDA device here: run with --cpu-dry-run")


STEP_FUNCTIONS: dict[str, Callable[[Options], StepResult]] = {
    "kernels": step_kernels, "kernel-bench": step_kernel_bench,
    "engine-pd": step_engine_pd, "cuda-read": step_cuda_read,
    "ucx-yardstick": step_ucx_yardstick, "kernel-tune": step_kernel_tune,
}


def _child(args: argparse.Namespace) -> int:
    opts = Options(**{k: tuple(v) if isinstance(v, list) else v
                      for k, v in json.loads(args.options).items()})
    try:
        result = STEP_FUNCTIONS[args.run_step](opts)
    except Exception as exc:  # noqa: BLE001 - the step's outcome, reported whole
        import traceback

        traceback.print_exc()
        result = StepResult(args.run_step, False, detail=f"{type(exc).__name__}: {exc}")
    Path(args.result).write_text(json.dumps(asdict(result), default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except GpuCheckError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    if args.run_step:
        return _child(args)
    results = run_all(args)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
