"""Where GPU-to-GPU KV reads between two agents lose time (issue #41, item 4).

``scripts/gpu_probe.sh`` installs the carried wheels (as ``gpu_check.sh`` does) and
runs this module on a GPU machine, one run under ``--deadline-s`` (a measurement is
not started past it); ``--cpu-dry-run`` runs the same measurements on the CPU
(host caches on the staged path, ``ucx_perftest`` on host memory, 1-2 MiB), which
CI tests. One JSON line per measurement goes to ``<out>/gpu_probe.jsonl`` as it
ends (a run cut off keeps what it measured), every process's output to
``gpu_probe.log``. The lines, in this order::

    environment     versions, the device, what ``import ucxx`` adds to the environment
    ucx_perftest    ucp_get and tag_bw between two processes on device memory at each
                    --perftest-sizes-mib, with kvbridge's environment (ucxx's
                    defaults, kvbridge's UCX_TLS), without and with
                    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y; UCX_PROTO_INFO=used's lines;
                    then ucp_get at the largest size with peer error handling and a
                    responder that does not progress (-e, -o): does UCX serve a
                    one-sided get of GPU memory natively when a dead peer must be an
                    error, not an abort (docs/design.md, "One-sided reads")
    kvbridge-read   two agent processes with device caches, one per variant and size:
                    baseline, loop-launch and thread-launch at --focus-mib first,
                    then every variant at every --sizes-mib; GB/s (median), p50/p99
                    ms, bytes verified, the per-chunk trace summary where the agents
                    wrote one (benchmarks/chunk_traces.py)
    host-staged     the same read through pinned host memory at --focus-mib
                    (benchmarks/gpu_reads.py)

A line has ``error`` where its measurement failed (the run goes on) and ``skipped``
where it did not run (past the deadline, or a variant's knob this kvbridge lacks).
Exit status: 2 for bad arguments; 1 when a line has an error or bytes that did not
verify; 0 otherwise (skipped lines included).
Run: ``python -m benchmarks.gpu_probe --out DIR [--cpu-dry-run] [--variants a,b]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType, MappingProxyType
from typing import Any, TextIO

from benchmarks.chunk_traces import TraceTail
from benchmarks.gpu_check import GpuCheckError, environment, pick, script_parser
from benchmarks.gpu_reads import NUM_LAYERS, HostStagedRead, block_nbytes
from benchmarks.probe_ucx import ZCOPY_ENV, perftest, ucx_environment
from kvbridge.bench.peers.placement import LOOPBACK
from kvbridge.bench.transfer_agents import AgentPair

DEFAULT_DEADLINE_S = 400.0
TRACE_ENV = "KVBRIDGE_TRACE_CHUNKS"  # kvbridge/transfer/chunk_trace.py: where agents trace
PERFTEST_TESTS = ("ucp_get", "tag_bw")
_MIN_START_S = 5.0  # a measurement is not started with less time left
#: each measurement's own deadline (a read's includes starting its agent pair)
_CAP_S = MappingProxyType({"ucx_perftest": 60.0, "kvbridge-read": 120.0,
                           "host-staged": 120.0})
_REPLY_TIMEOUT_S = 60.0  # an agent pair's deadline for each reply
_CLOSE_S = 30.0  # an agent pair that takes longer to close is killed
_MIN_PERFTEST_ITERS = 20


class ProbeTimeoutError(Exception):
    """A measurement's own deadline passed (raised from SIGALRM)."""


@dataclass(frozen=True)
class Variant:
    """One way of running the agent pair: ``AgentConfig`` fields and environment."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


VARIANTS = (
    Variant("baseline"),
    Variant("chunk8m", {"chunk_nbytes": 8 << 20}),  # under UCX's 15.8 MB pipeline switch
    Variant("window8", {"window_chunks": 8}),
    Variant("frag-host", env={"UCX_RNDV_FRAG_MEM_TYPE": "host"}),
    Variant("loop-launch", {"staged_launch": "loop"}),
    Variant("thread-launch", {"staged_launch": "thread"}),
    Variant("get-zcopy-ipc", env=dict(ZCOPY_ENV)),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
#: measured at --focus-mib before anything else of the reads
FIRST_VARIANTS = ("baseline", "loop-launch", "thread-launch")


@dataclass(frozen=True)
class Options:
    """What one run measures, and how."""

    device: str  # "cuda", or "cpu" in the dry run
    memory: str  # ucx_perftest's: "cuda" or "host"
    sizes_mib: tuple[int, ...]
    perftest_sizes_mib: tuple[int, ...]
    focus_mib: int
    variants: tuple[str, ...]
    read_iters: int
    perftest_nbytes: int  # what one ucx_perftest run moves, about
    agent_options: Mapping[str, Any]  # every variant's AgentConfig fields
    deadline_s: float
    out: str


@dataclass(frozen=True)
class Item:
    """One measurement of the plan; :meth:`key` opens its line."""

    measure: str
    mib: int
    variant: str = ""
    test: str = ""
    get_zcopy: bool = False
    error_handling: bool = False  # ucx_perftest's -e (and -o for ucp_get)

    def key(self, opts: Options) -> dict[str, Any]:
        """The fields that name the measurement, first in its line."""
        if self.measure == "ucx_perftest":
            return {"measure": self.measure, "test": self.test, "memory": opts.memory,
                    "mib": self.mib, "get_zcopy_ipc": self.get_zcopy,
                    "error_handling": self.error_handling}
        if self.measure == "kvbridge-read":
            return {"measure": self.measure, "variant": self.variant, "mib": self.mib}
        return {"measure": self.measure, "mib": self.mib}


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """The command line as :class:`Options`.

    Raises:
        GpuCheckError: an unknown variant, a bad size or deadline.
    """
    parser = script_parser("gpu_probe", __doc__, "gpu_probe.jsonl and gpu_probe.log",
                           "the same measurements on the CPU, at 1-2 MiB")
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                        help="the run's deadline; measurements past it are not started")
    parser.add_argument("--variants", default=",".join(VARIANT_NAMES),
                        help=f"comma-separated subset of {','.join(VARIANT_NAMES)}")
    parser.add_argument("--sizes-mib", help="read sizes (default 8,32,128,256; dry run 1,2)")
    parser.add_argument("--perftest-sizes-mib",
                        help="ucx_perftest sizes (default 8,32,128; dry run 2)")
    parser.add_argument("--focus-mib", type=int,
                        help="the read size measured first, and through the host (default "
                             "128; dry run 2)")
    args = parser.parse_args(argv)
    dry = args.cpu_dry_run
    sizes = _mib_list("--sizes-mib", args.sizes_mib or ("1,2" if dry else "8,32,128,256"))
    perftest_sizes = _mib_list("--perftest-sizes-mib",
                               args.perftest_sizes_mib or ("2" if dry else "8,32,128"))
    focus = args.focus_mib if args.focus_mib is not None else 2 if dry else 128
    if focus not in sizes:
        raise GpuCheckError(f"--focus-mib {focus} is not one of --sizes-mib {list(sizes)}")
    variants = pick(args.variants, VARIANT_NAMES, "variants")
    if not args.deadline_s > 0:
        raise GpuCheckError(f"--deadline-s must be > 0, got {args.deadline_s}")
    # CPU caches would take the direct path; GPU ones always stage: so stage here too
    return Options(device="cpu" if dry else "cuda", memory="host" if dry else "cuda",
                   sizes_mib=sizes, perftest_sizes_mib=perftest_sizes, focus_mib=focus,
                   variants=tuple(v for v in VARIANT_NAMES if v in variants),
                   read_iters=3 if dry else 10, perftest_nbytes=(64 if dry else 2048) << 20,
                   agent_options={"direct_reads": False} if dry else {},
                   deadline_s=args.deadline_s, out=args.out)


def _mib_list(flag: str, text: str) -> tuple[int, ...]:
    words = [w for w in text.split(",") if w.strip()]
    if not words or not all(w.strip().isdigit() and 0 < int(w) <= 4096 for w in words):
        raise GpuCheckError(f"{flag}: {text!r} is not a comma-separated list of whole MiB "
                             f"(1..4096)")
    return tuple(sorted({int(w) for w in words}))


def plan(opts: Options) -> list[Item]:
    """Every measurement, most important first (see the module's docstring)."""
    items = [Item("ucx_perftest", mib, test=test, get_zcopy=zcopy)
             for mib in opts.perftest_sizes_mib for test in PERFTEST_TESTS
             for zcopy in (False, True)]
    items += [Item("ucx_perftest", max(opts.perftest_sizes_mib), test="ucp_get",
                   get_zcopy=zcopy, error_handling=True) for zcopy in (False, True)]
    first = [Item("kvbridge-read", opts.focus_mib, v) for v in FIRST_VARIANTS
             if v in opts.variants]
    items += first
    items += [Item("kvbridge-read", mib, v) for v in opts.variants for mib in opts.sizes_mib
              if Item("kvbridge-read", mib, v) not in first]
    items.append(Item("host-staged", opts.focus_mib))
    return items


# --------------------------------------------------------------------------- running


class Probe:
    """Runs a plan's items one by one, each under its own deadline, and writes the lines.

    Owns the agent pair of the reads: started at the first, given new agents (same
    processes and caches) when the variant changes (``AgentPair.restart``: its
    options, its environment over the processes' own), stopped after the last read,
    and killed when a measurement failed on it (the next read starts another).
    """

    def __init__(self, opts: Options, say: Callable[[str], None]) -> None:
        self.opts = opts
        self._say = say
        self._deadline = time.monotonic() + opts.deadline_s
        self._pair: AgentPair | None = None  # while the reads go on
        self._variant = ""  # the one the pair's agents run now
        self._traces = TraceTail(Path(opts.out) / "traces")
        self._traces.folder.mkdir(parents=True, exist_ok=True)
        self._ucx_env: dict[str, str] = {}
        self._pool_blocks = 2 * max(opts.sizes_mib) * (1 << 20) // block_nbytes()

    def run(self, items: Sequence[Item], lines: TextIO) -> list[dict[str, Any]]:
        """Measure ``items`` in order; every line written (and flushed) as it ends."""
        written = [self._environment()]
        lines.write(json.dumps(written[0], default=str) + "\n")
        lines.flush()
        self._say(_brief(written[0]))
        for index, item in enumerate(items):
            line = self._one(item)
            if all(later.measure != "kvbridge-read" for later in items[index + 1:]):
                self._drop_pair(kill=False)
            lines.write(json.dumps(line, default=str) + "\n")
            lines.flush()
            written.append(line)
            self._say(_brief(line))
        return written

    def _one(self, item: Item) -> dict[str, Any]:
        line = item.key(self.opts)
        left = self._deadline - time.monotonic()
        if left < _MIN_START_S:
            return {**line, "skipped": f"past the deadline ({self.opts.deadline_s:.0f} s)"}
        started = time.monotonic()
        try:
            with _deadline(min(_CAP_S[item.measure], left)):
                line.update(self._measure(item))
        except Exception as exc:  # noqa: BLE001 - written in the line; the run goes on
            line["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            if item.measure == "kvbridge-read":
                self._drop_pair(kill=True)
        line["seconds"] = round(time.monotonic() - started, 3)
        return line

    def _measure(self, item: Item) -> dict[str, Any]:
        match item.measure:
            case "ucx_perftest":
                return self._perftest(item)
            case "kvbridge-read":
                return self._read(item)
            case _:
                return self._host_staged(item)

    def _environment(self) -> dict[str, Any]:
        """The environment line; sets what ``ucx_perftest`` runs with (kvbridge's)."""
        line: dict[str, Any] = {"measure": "environment", "options": asdict(self.opts)}
        try:
            found = ucx_environment()
            self._ucx_env = {**found["ucxx_env"], "UCX_TLS": found["kvbridge_tls"]}
            line.update(found)
            line.update(environment())
        except Exception as exc:  # noqa: BLE001 - written in the line; the run goes on
            line["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return line

    def _perftest(self, item: Item) -> dict[str, Any]:
        nbytes = item.mib << 20
        return perftest(item.test, nbytes,
                        max(_MIN_PERFTEST_ITERS, self.opts.perftest_nbytes // nbytes),
                        self.opts.memory,
                        {**self._ucx_env, **(ZCOPY_ENV if item.get_zcopy else {})},
                        _CAP_S[item.measure] / (3 if item.error_handling else 1),
                        error_handling=item.error_handling)

    def _read(self, item: Item) -> dict[str, Any]:
        from kvbridge.transfer.agent_config import AgentConfig

        variant = VARIANTS[VARIANT_NAMES.index(item.variant)]
        lacking = [name for name in variant.options if name not in AgentConfig.__struct_fields__]
        if lacking:
            return {"skipped": f"no {lacking[0]} knob"}
        pair = self._pair_for(variant)
        nbytes = item.mib << 20
        result = pair.measure(nbytes // block_nbytes(), self.opts.read_iters, nbytes,
                              before_timed=self._traces.mark)
        p50_us, p99_us = result.latency_p50_us, result.latency_p99_us
        assert p50_us is not None and p99_us is not None  # kvbridge's reads are timed singly
        line: dict[str, Any] = {
            "gbps": result.gbps_median, "p50_ms": p50_us / 1e3, "p99_ms": p99_us / 1e3,
            "verified": result.verified,
            "iters": result.num_iters, "note": result.note,
            "config": {**self.opts.agent_options, **variant.options}, "env": dict(variant.env)}
        trace = self._traces.summary()
        if trace:
            line["trace"] = trace
        return line

    def _pair_for(self, variant: Variant) -> AgentPair:
        options = {**self.opts.agent_options, **variant.options}
        if self._pair is None:
            # the traces' folder for the processes' life: a restart may not reread it
            env = MappingProxyType({TRACE_ENV: str(self._traces.folder)})
            self._pair = AgentPair(NUM_LAYERS, self._pool_blocks, _REPLY_TIMEOUT_S,
                                   local_copy=False, placement=dataclasses.replace(
                                       LOOPBACK, env=env),
                                   device=self.opts.device, agent_options=options)
            self._variant = "" if variant.env else variant.name
        if self._variant != variant.name:
            self._pair.restart(options, variant.env)
            self._variant = variant.name
        return self._pair

    def _drop_pair(self, kill: bool) -> None:
        """Stop the pair: ask its agents to close, or (``kill``, or no answer in time)
        kill them."""
        if self._pair is not None and not kill:
            try:
                with _deadline(_CLOSE_S):
                    self._pair.close()
            except ProbeTimeoutError:
                kill = True
        if self._pair is not None and kill:
            self._pair.kill()
        self._pair, self._variant = None, ""

    def _host_staged(self, item: Item) -> dict[str, Any]:
        num_blocks = (item.mib << 20) // block_nbytes()
        staged = HostStagedRead(2 * num_blocks, self.opts.device, _REPLY_TIMEOUT_S)
        try:
            numbers = staged.measure(num_blocks, self.opts.read_iters)
        except BaseException:
            staged.kill()
            raise
        staged.close()
        return {"gbps": numbers["staged_gbps"], "verified": numbers["host_verified"],
                **numbers}

    def close(self) -> None:
        """Stop the agent pair if it still runs."""
        self._drop_pair(kill=False)


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`ProbeTimeoutError` in this (the main) thread after ``seconds``."""
    def expire(signum: int, frame: FrameType | None) -> None:
        raise ProbeTimeoutError(f"no result within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _brief(line: dict[str, Any]) -> str:
    """One line of the console's progress."""
    if line["measure"] == "environment" and "error" not in line:
        return (f"environment: {line.get('device', 'no GPU')}, torch {line.get('torch')}, "
                f"ucx {line.get('ucx')}, ucxx sets {line.get('ucxx_env')}")
    what = " ".join(str(line[k]) for k in ("measure", "test", "variant") if line.get(k))
    if line.get("get_zcopy_ipc"):
        what += " +get_zcopy"
    if "mib" in line:
        what += f" {line['mib']} MiB"
    if "error" in line:
        return f"{what}: ERROR {line['error'][:200]}"
    if "skipped" in line:
        return f"{what}: skipped ({line['skipped']})"
    if "gbps" in line:
        checked = "" if line.get("verified", True) else " BYTES WRONG"
        return f"{what}: {line['gbps']:.2f} GB/s{checked} ({line['seconds']:.1f} s)"
    return what


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_args(argv)
    except GpuCheckError as exc:
        print(f"gpu_probe: {exc}", file=sys.stderr)
        return 2
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    items = plan(opts)
    with _output_to(out / "gpu_probe.log") as say:
        say(f"gpu_probe: {len(items)} measurements on {opts.device}, deadline "
            f"{opts.deadline_s:.0f} s, lines in {out / 'gpu_probe.jsonl'}")
        probe = Probe(opts, say)
        try:
            with open(out / "gpu_probe.jsonl", "w") as lines:
                written = probe.run(items, lines)
        finally:
            probe.close()
    failed = [line for line in written
              if "error" in line or line.get("verified") is False]
    return 1 if failed else 0


@contextlib.contextmanager
def _output_to(log_path: Path) -> Iterator[Callable[[str], None]]:
    """Point this process's stdout and stderr, and so its children's, at ``log_path``;
    yield ``say``, which writes a line to the log and to the console."""
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log_path, "w", buffering=1) as log:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)

        def say(text: str) -> None:
            print(text, flush=True)
            console.write(text + "\n")

        try:
            yield say
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            console.close()


if __name__ == "__main__":
    sys.exit(main())
