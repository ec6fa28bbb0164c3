"""``ucx_perftest`` with kvbridge's UCX environment, for ``benchmarks/gpu_probe.py``.

What UCX itself moves between two processes when it runs as kvbridge's agents do:
the variables ``import ucxx`` sets (``UCX_RNDV_FRAG_MEM_TYPE=cuda``,
``UCX_RNDV_THRESH=8192``, ...: :func:`ucx_environment` finds them, it does not
list them) and kvbridge's transports (``SAFE_TLS``). ``ucx_perftest`` runs through
``kvbridge/bench/peers/ucx_perftest.py`` with ``UCX_PROTO_INFO=used``; the
protocol table rows UCX prints and its warnings (an unused variable says this UCX
lacks the knob) come back with the number (:func:`perftest`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvbridge.bench.peers.placement import LOOPBACK
from kvbridge.bench.peers.ucx_perftest import run_perftest

ZCOPY_ENV = MappingProxyType({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"})
PROTO_ENV = MappingProxyType({"UCX_PROTO_INFO": "used"})
_UCX_LOG = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")  # "[stamp] [host:pid:thread] "


def ucx_environment() -> dict[str, Any]:
    """What importing kvbridge's UCX worker (and so ``ucxx``) adds to ``os.environ``
    (``ucxx_env``), the transports kvbridge allows (``kvbridge_tls``), the ``UCX_``
    variables there were before and UCX's version.

    ``os.environ`` is put back as it was: the children this process starts (agents,
    ``ucx_perftest``) get what their lines name, and agents import ucxx themselves.
    Call it before anything else imports ucxx, or ``ucxx_env`` comes back empty.
    """
    before = dict(os.environ)
    import ucxx

    from kvbridge.transfer.ucx.worker import SAFE_TLS

    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    os.environ.clear()
    os.environ.update(before)
    return {"ucxx_env": added, "kvbridge_tls": SAFE_TLS,
            "ucx_env_before": {k: v for k, v in before.items() if k.startswith("UCX_")},
            "ucx": ".".join(str(n) for n in ucxx.get_ucx_version())}


def perftest(test: str, nbytes: int, num_iters: int, memory: str, env: Mapping[str, str],
             timeout_s: float, *, error_handling: bool = False) -> dict[str, Any]:
    """One ``ucx_perftest`` run of ``num_iters`` messages with ``env`` on top of this
    process's environment, and ``UCX_PROTO_INFO=used`` (``error_handling``: as
    ``run_perftest``'s).

    Returns:
        ``gbps`` (overall), ``iters``, ``env`` (all that was added), ``proto`` (UCX's
        protocol table rows, client's then server's) and ``ucx_warnings``.

    Raises:
        PerftestError: the tool is missing, failed or timed out.
    """
    env = {**env, **PROTO_ENV}
    run = run_perftest(nbytes, num_iters, max(2, num_iters // 10), timeout_s, test,
                       dataclasses.replace(LOOPBACK, env=MappingProxyType(env)),
                       memory=memory, error_handling=error_handling)
    proto, warnings = ucx_lines(run.output)
    return {"gbps": run.gbps_overall, "iters": run.num_iters, "env": env, "proto": proto,
            "ucx_warnings": warnings}


def ucx_lines(output: str) -> tuple[list[str], list[str]]:
    """UCX's protocol table rows (``UCX_PROTO_INFO``) and its warnings in ``output``, in
    order, each once, without their stamp and process prefix."""
    proto: list[str] = []
    warnings: list[str] = []
    for raw in output.splitlines():
        prefix = _UCX_LOG.match(raw)
        if prefix is None:  # the tool's own lines
            continue
        text = raw[prefix.end():].strip()
        kept = proto if text.startswith("|") else warnings if " WARN " in text else None
        if kept is not None and text not in kept:
            kept.append(text)
    return proto, warnings
