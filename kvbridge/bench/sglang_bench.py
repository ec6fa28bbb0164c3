"""``kvbridge bench sglang``: TTFT of SGLang P/D per transfer backend, beside one server.

For each backend (kvbridge, mooncake over TCP, nixl) it starts a P and a D (TP 1 each,
P pinned to core 0 and D to core 1 by ``SGLANG_CPU_OMP_THREADS_BIND``), and a single
server (no disaggregation, the reference) on its own, all in SGLang's venv
(``scripts/setup_sglang.sh``). At concurrency 1 it sends requests of one new token
(TTFT: the answer comes once D holds P's KV and P's first token) and of 32 tokens,
per prompt length, and checks that every P/D answer equals the single server's.
One configuration runs at a time; nothing else should run beside it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbridge.bench.sglang_servers import (
    PdClient,
    Server,
    base_env,
    default_python,
    post_json,
    sglang_server,
)
from kvbridge.cli.demo.procs import reserve_ports

__all__ = ["BACKENDS", "run"]

Progress = Callable[[str, int, int], None]

#: backend -> (the flag's value, extra environment)
BACKENDS: dict[str, tuple[str, dict[str, str]]] = {
    "kvbridge": ("kvbridge", {}),
    "mooncake": ("mooncake", {"MOONCAKE_PROTOCOL": "tcp"}),
    "nixl": ("nixl", {}),
}
_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
          "seven", "tiny", "models", "wait"]


def _prompt(num_words: int, seed: int) -> str:
    return " ".join(_WORDS[(seed * 7 + i * 3) % len(_WORDS)] for i in range(num_words))


def _body(prompt: str, num_tokens: int) -> dict[str, Any]:
    return {"text": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": num_tokens, "temperature": 0,
                                "ignore_eos": True}}


def _ids(status: int, answer: Any) -> list[int]:
    if status != 200:
        raise RuntimeError(f"status {status}: {str(answer)[:300]}")
    return [int(entry[1]) for entry in answer["meta_info"]["output_token_logprobs"]]


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": round(1000 * statistics.median(ordered), 1),
            "p90_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1),
            "num": len(ordered)}


def _measure(send: Callable[[dict[str, Any]], tuple[int, Any]], lengths: list[int],
             requests: int, reference: dict[tuple[int, int], list[int]] | None
             ) -> dict[str, Any]:
    rows = []
    mismatches = 0
    for length in lengths:
        for num_tokens in (1, 32):
            _ids(*send(_body(_prompt(length, 999), num_tokens)))  # warm-up
            times = []
            for i in range(requests):
                started = time.perf_counter()
                ids = _ids(*send(_body(_prompt(length, i), num_tokens)))
                times.append(time.perf_counter() - started)
                key = (length * 1000 + i, num_tokens)
                if reference is not None and reference.get(key) != ids:
                    mismatches += 1
            rows.append({"prompt_words": length, "new_tokens": num_tokens, **_stats(times)})
    return {"rows": rows, "mismatches": mismatches}


def _reference_ids(server: Server, lengths: list[int], requests: int
                   ) -> dict[tuple[int, int], list[int]]:
    return {(length * 1000 + i, n): _ids(*post_json(server.url + "/generate",
                                                   _body(_prompt(length, i), n)))
            for length in lengths for i in range(requests) for n in (1, 32)}


def run(quick: bool, lengths: list[int] | None = None, requests: int | None = None,
        backends: list[str] | None = None, python: str | None = None,
        progress: Progress | None = None) -> dict[str, Any]:
    """Every backend in turn, then the single server; the report.

    Raises:
        RuntimeError: no SGLang venv, or a server that did not start (with its log).
    """
    sglang_python = Path(python) if python else default_python()
    if not sglang_python.exists():
        raise RuntimeError(f"no SGLang venv python at {sglang_python}: run "
                           f"scripts/setup_sglang.sh (or set KVBRIDGE_SGLANG_VENV)")
    lengths = lengths or ([64, 512] if quick else [64, 512, 1500])
    requests = requests or (3 if quick else 10)
    names = backends or list(BACKENDS)
    work = Path(tempfile.mkdtemp(prefix="kvbridge-bench-sglang-"))
    model = work / "llama"
    subprocess.run([sys.executable, "-m", "kvbridge.integrations.vllm.tiny_model", str(model),
                    "--dtype", "float32", "--hidden", "512", "--layers", "8"],
                   check=True, capture_output=True, timeout=600)
    report: dict[str, Any] = {"lengths": lengths, "requests": requests, "model": "tiny Llama "
                              "hidden 512, 8 layers, float32", "configs": {}}
    steps = len(names) + 1
    single_port, = reserve_ports([1])
    single = sglang_server(sglang_python, "single", model, work, single_port,
                           env=base_env(SGLANG_CPU_OMP_THREADS_BIND="0"))
    single.start()
    try:
        single.wait_ready()
        reference = _reference_ids(single, lengths, requests)
        report["configs"]["single"] = _measure(
            lambda body: post_json(single.url + "/generate", body), lengths, requests,
            reference)
    finally:
        single.stop()
    if progress is not None:
        progress("single", 1, steps)
    for index, name in enumerate(names):
        flag, extra = BACKENDS[name]
        p_port, d_port, boot = reserve_ports([1, 1, 1])
        pd = ["--disaggregation-transfer-backend", flag]
        prefill = sglang_server(sglang_python, f"{name}-p", model, work, p_port,
                                "--disaggregation-mode", "prefill", *pd, bootstrap_port=boot,
                                env=base_env(SGLANG_CPU_OMP_THREADS_BIND="0", **extra))
        decode = sglang_server(sglang_python, f"{name}-d", model, work, d_port,
                               "--disaggregation-mode", "decode", *pd,
                               "--disaggregation-decode-retraction-backup", "cpu_tensor",
                               env=base_env(SGLANG_CPU_OMP_THREADS_BIND="1", **extra))
        for server in (prefill, decode):
            server.start()
        try:
            prefill.wait_ready()
            decode.wait_ready()
            client = PdClient(prefill, decode)
            report["configs"][name] = _measure(client.generate, lengths, requests, reference)
        except RuntimeError as exc:
            report["configs"][name] = {"error": str(exc)[-2000:]}
        finally:
            decode.stop()
            prefill.stop()
        if progress is not None:
            progress(name, index + 2, steps)
    return report


def table(report: dict[str, Any]) -> str:
    """Median (p90) ms per configuration, prompt length and new tokens."""
    configs = report["configs"]
    head = f"{'config':<10} {'words':>6} {'new':>4} {'median ms':>10} {'p90 ms':>8}  same as single"
    lines = [head, "-" * len(head)]
    for name, result in configs.items():
        if "error" in result:
            lines.append(f"{name:<10} error: {result['error'].splitlines()[0][:80]}")
            continue
        for row in result["rows"]:
            lines.append(f"{name:<10} {row['prompt_words']:>6} {row['new_tokens']:>4} "
                         f"{row['median_ms']:>10.1f} {row['p90_ms']:>8.1f}  "
                         f"{'yes' if not result['mismatches'] else result['mismatches']}")
    return "\n".join(lines)


def passed(report: dict[str, Any]) -> bool:
    """kvbridge ran and every answer equalled the single server's."""
    ours = report["configs"].get("kvbridge", {})
    return "error" not in ours and ours.get("mismatches", 1) == 0
