#!/usr/bin/env bash
# Create the virtual environment and install kvbridge with its extras.
# torch: when the venv has none, pin the CPU build (torch==2.13.0) so that the
# package requirement `torch>=2.4` does not pull a multi-GB CUDA build.
set -euo pipefail
PY=${PY:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install -q -e ".[serve,test,bench]"
