#!/usr/bin/env bash
# The GPU checks of issue #32 (benchmarks/gpu_check.py), on a GPU machine whose python3
# has torch (CUDA) and triton but no network: kvbridge's other runtime packages travel
# as wheels (scripts/gpu_wheels.txt) and are installed into a folder of their own.
#
#   bash scripts/gpu_check.sh --fetch-wheels          # here: download them into .whl/
#   bash scripts/gpu_check.sh [gpu_check arguments]   # there: install, then run the checks
#   bash scripts/gpu_check.sh --cpu-dry-run ...       # anywhere: the same steps on the CPU
#
# Environment: PY (python, default python3), KVBRIDGE_WHEELS (default .whl),
# KVBRIDGE_GPU_SITE (install target, default /tmp/kvbridge-gpu-site). Results go to
# --out (default $OUT): gpu_check.json and gpu_check.log. Exit status: 0 when every
# step passed, 1 when one failed, 2 for bad arguments or missing wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${KVBRIDGE_WHEELS:-.whl}
TARGET=${KVBRIDGE_GPU_SITE:-/tmp/kvbridge-gpu-site}
LIST=scripts/gpu_wheels.txt
mapfile -t REQS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$')

if [ "${1:-}" = "--fetch-wheels" ]; then
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
             manylinux_2_17_x86_64 manylinux2014_x86_64; do
        platforms+=(--platform "$p")
    done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$WHEELS" "${REQS[@]}"
    exit 0
fi

dry_run=0
for arg in "$@"; do [ "$arg" = "--cpu-dry-run" ] && dry_run=1; done

if [ $dry_run = 1 ]; then  # the CPU path: this python's own packages, nothing installed
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    exec "$PY" -m benchmarks.gpu_check "$@"
fi
wheels=()
missing=()
for req in "${REQS[@]}"; do
    name=${req%%==*}
    version=${req#*==}
    found=$(ls "$WHEELS"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -1 || true)
    if [ -n "$found" ]; then wheels+=("$found"); else missing+=("$req"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_check.sh: missing in $WHEELS: ${missing[*]} (run: bash scripts/gpu_check.sh" \
         "--fetch-wheels on a machine with PyPI)" >&2
    exit 2
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$TARGET" "${wheels[@]}"
export PYTHONPATH="$TARGET:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m benchmarks.gpu_check "$@"
