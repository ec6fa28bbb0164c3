"""A stand-in for SGLang's ``sgl_kernel`` (PyPI: ``sglang-kernel``), for SGLang's CPU engine.

Why it exists: SGLang 0.5.23 imports ``sgl_kernel`` at module level in a few places
even on its CPU path (``SGLANG_USE_CPU_ENGINE=1``), e.g. ``sglang/kernels/ops/kvcache/
cache_move.py`` does ``from sgl_kernel import copy_all_layer_kv_cache_cpu`` when
``is_cpu()``. The ``sglang-kernel`` wheels on PyPI are CUDA builds (they do not load
against the CPU torch), and SGLang's own CPU kernels (``sgl-kernel/csrc/cpu``, built from
source) need AVX-512/AMX, which the machines this project runs on (AVX2 only) lack.

The CPU engine with ``--attention-backend torch_native`` never *calls* anything from
``sgl_kernel``: its native kernels are used only when ``cpu_has_amx_support()`` is true,
which needs ``torch.ops.sgl_kernel.convert_weight_packed`` (never registered here) and an
AMX CPU. So this package provides only the names SGLang imports, each a callable that
raises ``SglKernelStandInError`` saying which kernel was called. A P/D request that
succeeds with this stand-in installed is the proof that none is called on that path.

It is a test fixture (``tests/integrations/sglang``), not part of kvbridge;
``scripts/setup_sglang.sh`` makes it importable in the SGLang venv with a ``.pth`` file.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

__version__ = "0.0.0+kvbridge.stand.in"

#: Names imported from ``sgl_kernel`` itself on the CPU engine's path (module level).
_NAMES = (
    "assign_req_to_token_pool_cpu",  # sglang/srt/mem_cache/allocation.py
    "copy_all_layer_kv_cache_cpu",  # sglang/kernels/ops/kvcache/cache_move.py
    # speculative decoding, imported at module level (sglang/kernels/ops/speculative/):
    "build_tree_kernel_efficient_cpu",  # spec_tree.py
    "verify_tree_greedy_cpu",  # spec_tree.py
    "assign_draft_cache_locs_contiguous_cpu",  # cache_locs.py
    "assign_extend_cache_locs_cpu",  # cache_locs.py
    "fill_accept_out_cache_loc_cpu",  # eagle.py
    "fill_bonus_tokens_cpu",  # eagle.py
    "rotate_input_ids_cpu",  # multi_layer_eagle.py
)


class SglKernelStandInError(RuntimeError):
    """An ``sgl_kernel`` function was called; the stand-in has no kernels."""


class _Unavailable:
    """A callable placeholder for one ``sgl_kernel`` function that raises when called."""

    def __init__(self, qualname: str) -> None:
        self.__qualname__ = self.__name__ = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        message = (
            f"sgl_kernel stand-in: {self.__name__}() was called. This package "
            "(tests/integrations/sglang/stand_ins/sgl_kernel) only lets SGLang's CPU engine "
            "import; it has no kernels. Serve with --attention-backend torch_native on a "
            "CPU without AMX, or install a real sgl_kernel build."
        )
        # Also on stderr (the server's log), in case a caller catches the error and falls back.
        print(message, file=sys.stderr, flush=True)
        raise SglKernelStandInError(message)

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self.__name__}>"


def _stubs(module: str, names: tuple[str, ...]) -> dict[str, _Unavailable]:
    return {name: _Unavailable(f"{module}.{name}") for name in names}


globals().update(_stubs("sgl_kernel", _NAMES))
__all__ = list(_NAMES)
