#!/usr/bin/env bash
# Where GPU-to-GPU KV reads between two kvbridge agents lose time (issue #41, item 4):
# benchmarks/gpu_probe.py, one run of at most ~7 minutes (--deadline-s, default 400 s),
# one JSON line per measurement in $OUT/gpu_probe.jsonl (flushed as it goes) and the
# output of every process in $OUT/gpu_probe.log. Wheels as for gpu_check.sh
# (scripts/gpu_run.sh).
#
# A session lent a GPU machine runs, with .whl/ filled here first:
#   bash scripts/gpu_probe.sh --fetch-wheels        # here (PyPI): the wheels into .whl/
#   bash scripts/gpu_probe.sh --out $OUT            # on the device, one command
#     (through the device tool: command "bash scripts/gpu_probe.sh --out $OUT" with
#      timeout_s 480; .whl/ travels with the working tree as untracked files; read
#      $OUT/gpu_probe.jsonl even when the run was cut off)
#   bash scripts/gpu_probe.sh --cpu-dry-run --out DIR   # anywhere: the same steps on the CPU
#
# Environment: PY, KVBRIDGE_WHEELS, KVBRIDGE_GPU_SITE (scripts/gpu_run.sh). Exit status:
# 0 when every measurement ran (skipped ones included), 1 when one failed, 2 for bad
# arguments or missing wheels.
set -euo pipefail
source "$(dirname "$0")/gpu_run.sh"
gpu_run benchmarks.gpu_probe "$@"
