"""The environment benchmark child processes start from: this one's, minus ucxx's.

``import ucxx`` (kvbridge's transfer layer) writes UCX_* defaults meant for its
own GPU use into ``os.environ`` (``UCX_RNDV_FRAG_MEM_TYPE=cuda``,
``UCX_RNDV_THRESH=8192``, ...). A peer process started afterwards (NIXL's or
Mooncake's children, ``ucx_perftest``) would inherit them and be measured with
ucxx's tuning instead of its own. ``kvbridge/bench/peers/harness.py`` and
``ucx_perftest.py`` build every child's environment with :func:`child_env`.

The snapshot of what those variables were before ucxx is taken when this
module is first imported (the harness imports it at its own import).

Children run ``python -m kvbridge.bench...`` and must import the kvbridge this
process runs, wherever it lies (a source checkout, site-packages, a ``pip
install --target`` folder): :func:`package_path` puts its folder first on a
child's ``PYTHONPATH`` where the interpreter would not find it by itself.
"""

from __future__ import annotations

import os
import site
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

__all__ = ["UCXX_ENV_DEFAULTS", "child_env", "package_path"]

#: What ``import ucxx`` puts in ``os.environ`` when the name is unset (ucxx 0.52).
UCXX_ENV_DEFAULTS: Mapping[str, str] = MappingProxyType({
    "UCX_MEMTYPE_CACHE": "n",
    "UCX_RNDV_THRESH": "8192",
    "UCX_RNDV_FRAG_MEM_TYPE": "cuda",
    "UCX_CUDA_COPY_MAX_REG_RATIO": "1.0",
    "UCX_MAX_RNDV_RAILS": "1",
    "UCX_PROTO_ENABLE": "n",
})


def _env_before_ucxx() -> Mapping[str, str] | None:
    """Those variables as this process had them before ucxx; ``None``: ucxx came first."""
    if "ucxx" in sys.modules:
        return None
    return MappingProxyType({k: os.environ[k] for k in UCXX_ENV_DEFAULTS if k in os.environ})


#: Taken once, when this module is first imported (an immutable snapshot).
_ENV_BEFORE_UCXX = _env_before_ucxx()


def child_env(prepend_paths: Mapping[str, str] = MappingProxyType({}),
              before_ucxx: Mapping[str, str] | None = _ENV_BEFORE_UCXX) -> dict[str, str]:
    """The environment for a child process: this one's, without what ucxx added.

    Only the variables of :data:`UCXX_ENV_DEFAULTS` are touched, and only once
    ucxx is imported: they get back the values they had before (``before_ucxx``,
    the snapshot taken at harness import), or, when ucxx was imported before the
    harness, are dropped where they hold ucxx's own default (then a user's own
    setting of that very value cannot be told apart and is dropped too).

    Args:
        prepend_paths: ``{name: directory}`` to put first in path-list variables
            (``PYTHONPATH``, ``LD_LIBRARY_PATH``).
        before_ucxx: Override of the snapshot (tests).

    Returns:
        A new dict; ``os.environ`` is not changed.
    """
    env = dict(os.environ)
    if "ucxx" in sys.modules:
        for name, ucxx_value in UCXX_ENV_DEFAULTS.items():
            if before_ucxx is not None and name in before_ucxx:
                env[name] = before_ucxx[name]
            elif before_ucxx is not None or env.get(name) == ucxx_value:
                env.pop(name, None)
    for name, directory in prepend_paths.items():
        env[name] = os.pathsep.join(p for p in (directory, env.get(name, "")) if p)
    return env


def package_path() -> dict[str, str]:
    """``{"PYTHONPATH": folder}`` for :func:`child_env`'s ``prepend_paths``: the folder
    holding the ``kvbridge`` package of this process, unless it is a site folder
    (on ``PYTHONPATH`` a site folder would come before the standard library).

    Returns:
        A new dict, empty where a child finds this kvbridge by itself.
    """
    folder = os.path.realpath(Path(__file__).parents[3])
    site_dirs = [*site.getsitepackages(), site.getusersitepackages()]
    if folder in {os.path.realpath(d) for d in site_dirs}:
        return {}
    return {"PYTHONPATH": folder}
