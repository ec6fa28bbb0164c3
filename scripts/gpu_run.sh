# Sourced by scripts/gpu_check.sh and scripts/gpu_probe.sh: how a GPU script of the
# checkout runs on a GPU machine whose python3 has torch (CUDA) and triton but no
# network. kvbridge's other runtime packages travel as wheels (scripts/gpu_wheels.txt),
# fetched here into .whl/ and installed there into a folder of their own.
#
#   gpu_run MODULE --fetch-wheels        download the wheels into $KVBRIDGE_WHEELS
#   gpu_run MODULE --cpu-dry-run ...     python -m MODULE with this python's own packages
#   gpu_run MODULE [arguments]           install the wheels, then python -m MODULE
#
# Environment: PY (python, default python3), KVBRIDGE_WHEELS (default .whl),
# KVBRIDGE_GPU_SITE (install target, default /tmp/kvbridge-gpu-site). Exit status 2
# when wheels are missing; otherwise the module's own.

gpu_run() {
    local module=$1
    shift
    local script py wheels target
    script=$(basename "$0")
    cd "$(dirname "$0")/.."
    py=${PY:-python3}
    wheels=${KVBRIDGE_WHEELS:-.whl}
    target=${KVBRIDGE_GPU_SITE:-/tmp/kvbridge-gpu-site}
    local reqs
    mapfile -t reqs < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/gpu_wheels.txt \
                        | grep -v '^$')

    if [ "${1:-}" = "--fetch-wheels" ]; then
        local platforms=() p
        for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
                 manylinux_2_17_x86_64 manylinux2014_x86_64; do
            platforms+=(--platform "$p")
        done
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${platforms[@]}" -d "$wheels" "${reqs[@]}"
        exit 0
    fi

    local arg
    for arg in "$@"; do
        if [ "$arg" = "--cpu-dry-run" ]; then  # this python's own packages, nothing installed
            export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
            exec "$py" -m "$module" "$@"
        fi
    done
    local found_wheels=() missing=() req name version found
    for req in "${reqs[@]}"; do
        name=${req%%==*}
        version=${req#*==}
        found=$(ls "$wheels"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -1 || true)
        if [ -n "$found" ]; then found_wheels+=("$found"); else missing+=("$req"); fi
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "$script: missing in $wheels: ${missing[*]} (run: bash scripts/$script" \
             "--fetch-wheels on a machine with PyPI)" >&2
        exit 2
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" "${found_wheels[@]}"
    export PYTHONPATH="$target:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    exec "$py" -m "$module" "$@"
}
