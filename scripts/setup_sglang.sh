#!/usr/bin/env bash
# Make a venv of its own for SGLang 0.5.23 on CPU (P/D disaggregation, issue #42), beside
# kvbridge's .venv (never touched). Idempotent: a second run only checks. Prints one line
# per step with its time. Notes, commands and measurements: tests/integrations/sglang/NOTES.md.
#
#   scripts/setup_sglang.sh              # -> .venv-sglang in the repo root
#   KVBRIDGE_SGLANG_VENV=/path scripts/setup_sglang.sh
#
# Steps:
# - venv (Python 3.11: the pinned wheels are cp311), pip pinned.
# - torch==2.13.0, the CPU build, as scripts/setup.sh does for .venv: on these machines pip
#   finds torch-2.13.0+cpu (192 MB) in its configured wheel folder; PyPI's own 2.13.0 is
#   the CUDA build (527 MB plus nvidia-*-cu13 wheels), which the script refuses after a
#   dry run. KVBRIDGE_TORCH_INDEX (e.g. PyTorch's CPU index) is passed as --index-url
#   where that is reachable. Installed --no-deps: its dependencies are pinned in the file.
# - scripts/sglang_requirements.txt with --no-deps: exact pins, nothing resolved, so no
#   CUDA torch and none of SGLang's CUDA-only requirements (sglang-kernel: no CPU wheel).
# - libibverbs.so.1 (mooncake's engine.so links it even for TCP): Debian's libibverbs1,
#   installed with apt-get when missing and we are root.
# - Three patches to installed files, each idempotent and checked:
#   1. torchvision 0.28.0 from PyPI is a CUDA build whose _C.so cannot load against the
#      CPU torch; its _meta_registrations.py then fails at import (register_fake on ops
#      that do not exist). The two unguarded register_fake calls get the _has_ops() guard
#      the rest of the file has. SGLang imports torchvision.transforms at start-up.
#   2. sglang/srt/disaggregation/prefill.py: for a sender with supports_host_tensor_indices
#      (mooncake's) P copies the page indices into pinned memory and records a CUDA event,
#      which crashes the CPU engine on the first P/D request. Guarded by kv_indices.is_cuda.
#   3. sglang/srt/disaggregation/nixl/conn.py names all KV memory "VRAM"; NIXL's UCX
#      refuses host memory as VRAM (NIXL_ERR_BACKEND at start-up). On a CPU device the
#      agent is wrapped so that "VRAM" becomes "DRAM" in the four calls that take a kind.
# - A .pth file putting tests/integrations/sglang/stand_ins on sys.path: the sgl_kernel
#   stand-in (SGLang imports sgl_kernel on its CPU path but never calls it there).
# - kvbridge itself, editable and --no-deps (its dependencies are pinned in the file): SGLang
#   finds its backend by the entry point in pyproject.toml (sglang.srt.plugins).
# - Checks: torch is 2.13.0+cpu; sglang's server, the router, mooncake, nixl and kvbridge's
#   plugin import.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${KVBRIDGE_SGLANG_VENV:-$REPO/.venv-sglang}
PY=${PY:-python3}
TORCH_VERSION=2.13.0
PIP_VERSION=26.3
REQS=$REPO/scripts/sglang_requirements.txt
STAND_INS=$REPO/tests/integrations/sglang/stand_ins

step() {  # step NAME COMMAND...: run, then print "setup_sglang: NAME: N.N s"
    local name=$1 start end
    shift
    start=$(date +%s.%N)
    "$@"
    end=$(date +%s.%N)
    printf 'setup_sglang: %-28s %6.1f s\n' "$name:" "$(echo "$end - $start" | bc)"
}

make_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
            echo "setup_sglang: $PY is not Python 3.11 (the pinned wheels are cp311); set PY" >&2
            exit 1
        }
        "$PY" -m venv "$VENV"
    fi
    # Keep the venv out of git wherever it lies (Python 3.11's venv writes no .gitignore).
    [ -f "$VENV/.gitignore" ] || echo '*' >"$VENV/.gitignore"
    "$VENV/bin/python" -m pip install -q "pip==$PIP_VERSION"
}

install_torch() {
    local have report
    have=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
    [ "$have" = "$TORCH_VERSION+cpu" ] && return
    local args=(-q --no-deps "torch==$TORCH_VERSION")  # its dependencies are in $REQS
    if [ -n "${KVBRIDGE_TORCH_INDEX:-}" ]; then
        args+=(--index-url "$KVBRIDGE_TORCH_INDEX")
    fi
    # What pip would fetch: refuse the CUDA build rather than download it.
    report=$(mktemp)
    "$VENV/bin/python" -m pip install --dry-run --ignore-installed --report "$report" \
        "${args[@]}" >/dev/null
    "$VENV/bin/python" - "$report" <<'PY' || { rm -f "$report"; exit 1; }
import json
import sys

url = json.load(open(sys.argv[1]))["install"][0]["download_info"]["url"]
if "+cpu" not in url and "%2Bcpu" not in url:
    sys.exit(f"setup_sglang: pip would install torch from {url}, not the CPU build; "
             "set KVBRIDGE_TORCH_INDEX to a CPU index")
PY
    rm -f "$report"
    "$VENV/bin/python" -m pip install "${args[@]}"
}

install_requirements() {
    "$VENV/bin/python" -m pip install -q --no-deps -r "$REQS"
}

ensure_libibverbs() {
    if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
        return
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null 2>&1 || {
            echo "setup_sglang: apt-get install libibverbs1 failed" >&2
            exit 1
        }
    else
        echo "setup_sglang: libibverbs.so.1 missing (mooncake needs it); install libibverbs1" >&2
        exit 1
    fi
}

apply_patches() {
    "$VENV/bin/python" - <<'PY'
import importlib.util
import pathlib
import sys

MARK = "kvbridge setup_sglang.sh"


def site(pkg):
    return pathlib.Path(importlib.util.find_spec(pkg).submodule_search_locations[0])


def patch(path, old, new, count):
    text = path.read_text()
    if MARK in text:
        return
    if text.count(old) != count:
        sys.exit(f"setup_sglang: {path}: expected {count} x {old!r}; not the pinned version?")
    path.write_text(text.replace(old, new))


# 1. torchvision (CUDA build, _C.so not loadable): guard the two unguarded register_fake.
patch(
    site("torchvision") / "_meta_registrations.py",
    '@torch.library.register_fake("torchvision::',
    f"# {MARK}: no register_fake without the C ops (CUDA build on the CPU torch)\n"
    "@(torch.library.register_fake if torchvision.extension._has_ops() else "
    '(lambda *a, **k: (lambda f: f)))("torchvision::',
    2,
)

sgl = site("sglang") / "srt" / "disaggregation"
# 2. prefill.py: the pinned-memory + CUDA-event index copy only for CUDA indices.
patch(
    sgl / "prefill.py",
    '            if getattr(sender, "supports_host_tensor_indices", False) and not (\n',
    f"            # {MARK}: pinned copy + CUDA event only for CUDA indices\n"
    '            if getattr(sender, "supports_host_tensor_indices", False) and '
    "kv_indices.is_cuda and not (\n",
    1,
)

# 3. nixl/conn.py: the CPU engine's KV is host memory: register and describe it as DRAM.
agent_line = "        self.agent = nixl_agent(str(uuid.uuid4()), agent_config)\n"
wrapper = f'''

# {MARK}: the KV cache of SGLang's CPU engine is host memory, which NIXL's UCX backend
# refuses to register as "VRAM" (the kind this module names everywhere).
class _KvbridgeDramAgent:
    _MEM_TYPE_ARG = {{"register_memory": 1, "get_xfer_descs": 1, "get_reg_descs": 1,
                     "prep_xfer_dlist": 2}}

    def __init__(self, agent):
        self._agent = agent

    def __getattr__(self, name):
        attr = getattr(self._agent, name)
        pos = self._MEM_TYPE_ARG.get(name)
        if pos is None:
            return attr

        def call(*args, **kwargs):
            args = list(args)
            if len(args) > pos and args[pos] == "VRAM":
                args[pos] = "DRAM"
            if kwargs.get("mem_type") == "VRAM":
                kwargs["mem_type"] = "DRAM"
            return attr(*args, **kwargs)

        return call
'''
conn = sgl / "nixl" / "conn.py"
text = conn.read_text()
if MARK not in text:
    if text.count(agent_line) != 1:
        sys.exit(f"setup_sglang: {conn}: nixl_agent creation not found; not 0.5.23?")
    text = text.replace(
        agent_line,
        agent_line
        + f"        # {MARK}: host-memory KV on a CPU device\n"
        + '        if get_device().device == "cpu":\n'
        + "            self.agent = _KvbridgeDramAgent(self.agent)\n",
    )
    conn.write_text(text + wrapper)
PY
}

install_kvbridge() {
    local log
    log=$(mktemp)  # setuptools' editable-install warnings, shown only if it fails
    "$VENV/bin/python" -m pip install -q --no-deps -e "$REPO" >"$log" 2>&1 || {
        cat "$log" >&2
        exit 1
    }
    rm -f "$log"
}

write_pth() {
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$STAND_INS" >"$site/kvbridge_sglang_stand_ins.pth"
}

check() {
    SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - "$TORCH_VERSION" "$STAND_INS" <<'PY'
import sys
import warnings

warnings.simplefilter("ignore")
import torch

want, stand_ins = sys.argv[1:]
if torch.__version__ != f"{want}+cpu":
    sys.exit(f"setup_sglang: torch is {torch.__version__}, wanted {want}+cpu")
import sgl_kernel

if not sgl_kernel.__file__.startswith(stand_ins):
    sys.exit(f"setup_sglang: sgl_kernel is {sgl_kernel.__file__}, not the stand-in")
import sglang
import sglang.srt.entrypoints.http_server  # noqa: F401  (the server's whole import chain)
import sglang_router  # noqa: F401
from mooncake.engine import TransferEngine  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
from importlib.metadata import entry_points

import kvbridge.integrations.sglang.plugin  # noqa: F401
import kvbridge.transfer.agent  # noqa: F401  (ucxx and libucx)

if not [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvbridge"]:
    sys.exit("setup_sglang: kvbridge's sglang.srt.plugins entry point is not installed")

print(f"setup_sglang: sglang {sglang.__version__} on torch {torch.__version__}: "
      "server, router, mooncake, nixl and kvbridge's plugin import")
PY
}

total_start=$(date +%s.%N)
echo "setup_sglang: venv $VENV"
step "venv + pip $PIP_VERSION" make_venv
step "torch $TORCH_VERSION (cpu)" install_torch
step "pinned requirements" install_requirements
step "libibverbs1" ensure_libibverbs
step "patches" apply_patches
step "kvbridge (editable)" install_kvbridge
step "sgl_kernel stand-in .pth" write_pth
step "import check" check
printf 'setup_sglang: %-28s %6.1f s\n' "total:" "$(echo "$(date +%s.%N) - $total_start" | bc)"
