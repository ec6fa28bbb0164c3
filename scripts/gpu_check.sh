#!/usr/bin/env bash
# The GPU checks of issue #32 (benchmarks/gpu_check.py), on a GPU machine whose python3
# has torch (CUDA) and triton but no network: kvbridge's other runtime packages travel
# as wheels (scripts/gpu_wheels.txt) and are installed into a folder of their own
# (scripts/gpu_run.sh, shared with scripts/gpu_probe.sh).
#
#   bash scripts/gpu_check.sh --fetch-wheels          # here: download them into .whl/
#   bash scripts/gpu_check.sh [gpu_check arguments]   # there: install, then run the checks
#   bash scripts/gpu_check.sh --cpu-dry-run ...       # anywhere: the same steps on the CPU
# A session lent a GPU machine fills .whl/ here first, then gives the device tool the one
# command `bash scripts/gpu_check.sh --out $OUT` (.whl/ travels with the working tree as
# untracked files); the issue #41 probe runs the same way (scripts/gpu_probe.sh).
#
# Environment: PY (python, default python3), KVBRIDGE_WHEELS (default .whl),
# KVBRIDGE_GPU_SITE (install target, default /tmp/kvbridge-gpu-site). Results go to
# --out (default $OUT): gpu_check.json and gpu_check.log. Exit status: 0 when every
# step passed, 1 when one failed, 2 for bad arguments or missing wheels.
set -euo pipefail
source "$(dirname "$0")/gpu_run.sh"
gpu_run benchmarks.gpu_check "$@"
