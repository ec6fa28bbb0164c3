"""Fixtures for tests against real vLLM servers (the CPU build) on a tiny random Llama.

- ``tiny_llama`` / ``tiny_llama_fp32``: model folders built once per session
  (``kvbridge/integrations/vllm/tiny_model.py``); ``tiny_model_factory`` builds other variants.
- ``vllm_servers``: ``.shared(spec)`` for a server kept for later tests (of this
  package) with the same ``ServerSpec``, ``.private(spec)`` for one stopped at
  the end of this test.
  At most three run at once (``ServerPool``): each takes ~25 s to start and ~3 GB.
  A failed test's report ends with its servers' warnings and errors (CI keeps
  no log files).

CI time (the whole `make test` must stay within 30 min on 2 cores, on any CPU of the
kind): server starts are most of this package's time. ``make test`` runs this package
in a pytest process of its own beside the rest of the suite (``scripts/pytest_pair.sh``).
Modules run in ``MODULE_ORDER`` so that servers are reused, servers a module needs
start together (``shared_all``: two or three starts at once on two cores take little
more than one), TP 1 servers run their worker in the engine process
(``ServerSpec.worker_process``: a start ~30% shorter), and the run ends with a line on
how many servers started and how long the tests waited for them. The models
(``PREBUILT``) build and the ``import vllm`` probe runs while the first tests run.

What vLLM decides from the CPU (an fp8 KV cache needs AVX-512 or AMX, a hybrid model's
block size, TP's shared-memory files) is read from vLLM at run time (``vllm_probe``,
``vllm_cpu``, ``client.cache_config``), never written into a test.

Every test here needs ``import vllm`` to work (checked once, in a child
process, so vLLM never loads into the pytest process). If it does not, the
tests are skipped with the import error, unless ``KVBRIDGE_REQUIRE_VLLM=1``
(set by ``make pytest``), where they fail with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.servers import ServerPool, ServersForTest

REPO_ROOT = Path(__file__).resolve().parents[3]
REQUIRE_VLLM_ENV = "KVBRIDGE_REQUIRE_VLLM"
MAX_SERVERS = 3  # ~3 GB resident each on a 24 GiB machine, with room for the rest

TinyModelFactory = Callable[..., Path]


#: The order this package's modules run in (the rest after them, by name). Each server
#: start costs ~30 s of CI's 2 cores; the pool keeps three running, so a module placed
#: right after the one that started its servers starts none (see each module's
#: docstring for the servers it shares):
#: colocated starts the bf16 reference and test_pd.py's P and D together; test_pd,
#: test_pd_api, test_pd_faults, test_pd_dp and test_pd_kv_dtype share that P (the
#: last uses it as the D of another cache dtype), test_pd_faults the mixed server and
#: the small P test_pd.py leaves (``pd.small_p_spec``); the hybrid families and the MoE pair
#: are their own; test_pd_mla's dense-D test starts test_pd_tp.py's TP 1 and TP 2
#: servers together; test_proxy_xpyd, test_router and test_router_faults share
#: ``pd.router_specs``.
MODULE_ORDER = (
    "test_facts", "test_groups", "test_settings", "test_stats",  # no server
    "test_colocated", "test_pd", "test_pd_api", "test_pd_faults", "test_pd_dp",
    "test_pd_kv_dtype", "test_pd_hybrid", "test_pd_moe", "test_pd_mla", "test_pd_tp",
    "test_proxy_xpyd", "test_router", "test_router_faults",
)


#: ``import vllm`` and what vLLM can run on this CPU (``vllm_probe``), in a child
#: (``vllm_importable``), started once this package's tests are collected: it then runs
#: beside the tests before them (~10 s of CI's wall time).
_probe: subprocess.Popen[str] | None = None
_cpu_facts: dict[str, Any] = {}


def _start_probe() -> subprocess.Popen[str]:
    global _probe
    if _probe is None:
        _probe = subprocess.Popen([sys.executable, "-m", "tests.integrations.vllm.vllm_probe"],
                                  cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _probe


#: A model build: (folder name, module of kvbridge.integrations.vllm, its arguments with
#: ``OUT`` for the folder).
ModelBuild = tuple[str, str, tuple[str, ...]]
OUT = "{out}"


def llama_build(dtype: str = "bfloat16", initializer_range: float = 0.02, seed: int = 0,
                kind: str = "llama") -> ModelBuild:
    """``tiny_model_factory``'s build of a tiny Llama (``tiny_model``) or of another
    family (``tiny_families --kind KIND``, e.g. "mla": DeepSeek-V2)."""
    module, kind_args = ("tiny_model", ()) if kind == "llama" else ("tiny_families",
                                                                     ("--kind", kind))
    name = "llama" if kind == "llama" else kind
    return (f"tiny-{name}-{dtype}-{initializer_range}-{seed}", module,
            (OUT, *kind_args, "--dtype", dtype, "--initializer-range", str(initializer_range),
             "--seed", str(seed)))


def hybrid_build(kind: str) -> ModelBuild:
    """test_pd_hybrid.py's build of a hybrid model (``tiny_hybrid KIND``)."""
    return f"tiny-{kind}", "tiny_hybrid", (kind, OUT)


#: Built one after another on a thread once this package's server tests are collected
#: (each takes a few seconds of one core, then spent beside the tests before them):
#: every model a module of the package serves, in the order the modules need them.
PREBUILT: tuple[ModelBuild, ...] = (
    llama_build("bfloat16"), hybrid_build("gemma3"), hybrid_build("qwen3_next"),
    llama_build("float32", 0.2, kind="moe"), llama_build("float32", 0.02, kind="mla"),
    llama_build("float32", 0.2),
)


class ModelBuilds:
    """Tiny models, each built once by ``python -m kvbridge.integrations.vllm.MODULE`` in a
    child (transformers stays out of this process) into a folder of its own.

    ``prebuild`` queues builds on one thread; ``get`` returns a build's folder, waiting
    for it if it runs, running it here if it has not started (never behind others).
    """

    def __init__(self) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="kvb-tiny-models-"))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-build")
        self._builds: dict[ModelBuild, Future[Path]] = {}
        self._lock = threading.Lock()

    def _run(self, build: ModelBuild) -> Path:
        name, module, args = build
        out = self._root / name
        shutil.rmtree(out, ignore_errors=True)  # what a cancelled or failed try left
        out.mkdir()
        argv = [sys.executable, "-m", f"kvbridge.integrations.vllm.{module}",
                *(str(out) if arg == OUT else arg for arg in args)]
        subprocess.run(argv, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
        return out

    def prebuild(self, builds: Iterable[ModelBuild]) -> None:
        with self._lock:
            for build in builds:
                if build not in self._builds:
                    self._builds[build] = self._thread.submit(self._run, build)

    def get(self, build: ModelBuild) -> Path:
        with self._lock:
            queued = self._builds.get(build)
            if queued is None or queued.cancel():  # not started: build it here, now
                here: Future[Path] = Future()
                self._builds[build] = here
            else:
                here = queued
        if here is not queued:
            try:
                here.set_result(self._run(build))
            except BaseException as exc:
                here.set_exception(exc)
        return here.result()

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self._root, ignore_errors=True)


_builds: ModelBuilds | None = None


def model_builds() -> ModelBuilds:
    global _builds
    if _builds is None:
        _builds = ModelBuilds()
    return _builds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run this package's tests in ``MODULE_ORDER`` (a stable sort of its own items, in
    the place they hold among the session's; other packages' items keep theirs); if any
    of them will run, start the ``import vllm`` probe, and if any starts servers, the
    model builds (``PREBUILT``)."""
    here = Path(__file__).parent
    ours = [i for i, item in enumerate(items) if item.path.parent == here]
    if ours and not config.option.collectonly:
        _start_probe()
        if any("vllm_servers" in getattr(items[i], "fixturenames", ()) for i in ours):
            model_builds().prebuild(PREBUILT)
    rank = {name: index for index, name in enumerate(MODULE_ORDER)}

    def key(index: int) -> tuple[int, str]:
        stem = items[index].path.stem
        return rank.get(stem, len(rank)), stem

    reordered = [items[i] for i in sorted(ours, key=key)]
    for slot, item in zip(ours, reordered, strict=True):
        items[slot] = item


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Add the servers' notable log lines to the report of a test that failed."""
    outcome = yield
    report = outcome.get_result()
    servers = getattr(item, "funcargs", {}).get("vllm_servers")
    if report.failed and report.when == "call" and isinstance(servers, ServersForTest):
        report.sections.append(("vLLM server logs", servers.failure_report()))


@pytest.fixture(scope="session", autouse=True)
def vllm_importable() -> None:
    """Skip (or, with KVBRIDGE_REQUIRE_VLLM=1, fail) every test here if vllm does not import;
    keep what the probe found out about this CPU (``vllm_cpu``)."""
    probe = _start_probe()
    try:
        stdout, stderr = probe.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        probe.kill()
        stdout, stderr = probe.communicate()
    if probe.returncode == 0:
        # vLLM logs to stdout too: the probe's JSON is its last line that is one
        found = [line for line in stdout.splitlines() if line.startswith("{")]
        if not found:
            pytest.fail(f"vllm_probe printed no facts; its output ends:\n{stdout[-2000:]}",
                        pytrace=False)
        _cpu_facts.update(json.loads(found[-1]))
        return
    error = stderr.strip().splitlines()[-1:] or [f"exit status {probe.returncode}"]
    reason = f"`import vllm` fails in {sys.executable}: {error[0]}"
    if os.environ.get(REQUIRE_VLLM_ENV) == "1":
        pytest.fail(f"{reason}\n{stderr[-4000:]}", pytrace=False)
    pytest.skip(f"{reason} (set {REQUIRE_VLLM_ENV}=1 to fail instead)")


@pytest.fixture(scope="session")
def vllm_cpu(vllm_importable: None) -> dict[str, Any]:
    """What vLLM's CPU build runs on this host, from vLLM's own checks (``vllm_probe``):
    e.g. ``["fp8_kv_refusal"]``, vLLM's reason for refusing an fp8 KV cache here, or None."""
    return dict(_cpu_facts)


@pytest.fixture(scope="session")
def tiny_model_factory() -> TinyModelFactory:
    """``factory(dtype="bfloat16", initializer_range=0.02, seed=0, kind="llama") -> model dir``.

    Each built once (``llama_build``: ``python -m kvbridge.integrations.vllm.tiny_model``
    or ``tiny_families --kind KIND``) in a few seconds, so that transformers stays out of
    this process; those in ``PREBUILT`` are usually built before the first test here.
    """

    def factory(dtype: str = "bfloat16", initializer_range: float = 0.02, seed: int = 0,
                kind: str = "llama") -> Path:
        return model_builds().get(llama_build(dtype, initializer_range, seed, kind))

    return factory


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the built models (after every server that read them stopped)."""
    if _builds is not None:
        _builds.close()


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: TinyModelFactory) -> Path:
    """The bfloat16 tiny Llama (seed 0): greedy output is stable run to run at TP 1."""
    return tiny_model_factory("bfloat16")


@pytest.fixture(scope="session")
def tiny_llama_fp32(tiny_model_factory: TinyModelFactory) -> Path:
    """A float32 tiny Llama with wide logits: greedy tokens agree between TP 1 and TP 2."""
    return tiny_model_factory("float32", initializer_range=0.2)


@pytest.fixture(scope="package")
def vllm_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    """Every vLLM server; all stopped after the last test of this package.

    Package, not session, scope: `make test` runs the rest of the suite after
    these, and idle servers would hold their ~3 GB each through it. At the end, one
    line in the terminal says how many servers started and how long tests waited for
    them (the package's share of CI's time: keep it small).
    """
    pool = ServerPool(tmp_path_factory.mktemp("vllm-logs"), max_servers=MAX_SERVERS)
    try:
        yield pool
    finally:
        pool.close()
        _summaries.append(pool.summary())


_summaries: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The pool's line on its starts (``ServerPool.summary``), at the end of the run."""
    for line in _summaries:
        terminalreporter.write_line(line)


@pytest.fixture
def vllm_servers(vllm_pool: ServerPool, tmp_path: Path) -> Iterator[ServersForTest]:
    """Servers for this test: ``.shared(spec)`` kept for later tests, ``.private(spec)`` not."""
    vllm_pool.begin_test()
    try:
        yield ServersForTest(vllm_pool, tmp_path)
    finally:
        vllm_pool.end_test()
