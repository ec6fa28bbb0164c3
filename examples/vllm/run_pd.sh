#!/usr/bin/env bash
# vLLM prefill/decode disaggregation with KVBridgeConnector, all on this host:
# a prefill server P, a decode server D (both plain vLLM OpenAI servers with the
# zero-config connector), `kvbridge proxy` in front of them. Sends a few
# completions through the proxy, prints the answers and what D loaded from P,
# checks one answer against P answering the same prompt alone (colocated),
# then stops everything it started. The commands are explained in README.md.
#
#   examples/vllm/run_pd.sh                    # tiny random Llama, built on the spot
#   MODEL=/models/Llama-3.2-1B examples/vllm/run_pd.sh
#   KEEP=1 examples/vllm/run_pd.sh             # ... and keep serving until Ctrl-C
#
# Environment (all optional):
#   MODEL          model folder or hub id (default: build kvbridge's tiny Llama)
#   VENV           virtualenv holding vllm and kvbridge (default: <repo>/.venv, else PATH)
#   P_PORT, D_PORT, PROXY_PORT   HTTP ports (8100, 8200, 8000); the transfer
#                  agents pick free ports themselves
#   P_TP, D_TP     tensor-parallel sizes (1, 1); with a TP above 1 and no MODEL
#                  the tiny model is built in float32 (bfloat16 greedy tokens
#                  differ between TP sizes)
#   DTYPE          --dtype (bfloat16; float32 for the TP variant of the tiny model)
#   BLOCK_SIZE     --block-size of both servers (128); P and D must agree on CPU
#   MAX_TOKENS     tokens per answer (16)
#   KV_TRANSFER_CONFIG  --kv-transfer-config JSON (default: the zero config)
#   VLLM_ARGS      extra arguments for both servers (split on spaces)
#   READY_TIMEOUT_S, STOP_TIMEOUT_S   waits for start (300) and stop (30)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${VENV:-$ROOT/.venv}
if [ -x "$VENV/bin/python" ]; then PYTHON="$VENV/bin/python"; else PYTHON=${PYTHON:-python3}; fi
P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
P_TP=${P_TP:-1}
D_TP=${D_TP:-1}
BLOCK_SIZE=${BLOCK_SIZE:-128}
MAX_TOKENS=${MAX_TOKENS:-16}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-30}
KV_TRANSFER_CONFIG=${KV_TRANSFER_CONFIG:-'{"kv_connector":"KVBridgeConnector","kv_connector_module_path":"kvbridge.integrations.vllm","kv_role":"kv_both"}'}
VLLM_ARGS=${VLLM_ARGS:-}
# vLLM's CPU build: a 1 GiB KV cache per server. Harmless on a GPU install.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}  # one host: keep vLLM on loopback
export VLLM_NO_USAGE_STATS=${VLLM_NO_USAGE_STATS:-1}

P_URL="http://127.0.0.1:$P_PORT"
D_URL="http://127.0.0.1:$D_PORT"
PROXY_URL="http://127.0.0.1:$PROXY_PORT"
PIDS=()       # process group leaders (each started with setsid)
TMP_DIRS=()   # each server's private TMPDIR

# vLLM leaves /dev/shm/vllm_dist_<uuid>-* (TP all-reduce buffers) behind; their
# names are in the rendezvous files of the server's private TMPDIR.
# shellcheck disable=SC2317  # remove_shm_of, group_alive, stop_all: run by the EXIT trap
remove_shm_of() {  # remove_shm_of TMPDIR
    local file name
    for file in "$1"/vllm_dist_*; do
        [ -e "$file" ] || continue
        name=$(basename "$file")
        rm -f /dev/shm/"$name"-*
    done
}

# shellcheck disable=SC2317
group_alive() {  # group_alive PGID: a live (non-zombie) process is in the group
    ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}

# shellcheck disable=SC2317
stop_all() {
    trap - EXIT INT TERM
    local pid dir
    # SIGTERM to the servers: each stops its engine core and workers itself.
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    local deadline=$((SECONDS + STOP_TIMEOUT_S))
    for pid in "${PIDS[@]}"; do
        while group_alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
        kill -KILL -- "-$pid" 2>/dev/null || true  # whatever is left of the group
    done
    for dir in "${TMP_DIRS[@]}"; do
        remove_shm_of "$dir"
        rm -rf "$dir"
    done
    [ "${#PIDS[@]}" -gt 0 ] && echo "stopped P, D and the proxy; logs in $WORK_DIR"
    return 0
}
trap stop_all EXIT
trap 'exit 130' INT TERM

fail() {  # fail MESSAGE [LOG]: print, show the log's tail, exit 1 (the trap cleans up)
    echo "run_pd.sh: $1" >&2
    if [ -n "${2:-}" ]; then tail -n 40 "$2" >&2; fi
    exit 1
}

# ---------------------------------------------------------------- checks
"$PYTHON" -c 'import importlib.util as u, sys
missing = [m for m in ("vllm", "kvbridge") if u.find_spec(m) is None]
sys.exit(f"{sys.executable} lacks {missing}: run make setup-vllm (CPU) or see examples/vllm/README.md" if missing else 0)'
# A server already on one of our ports would answer our readiness checks.
# (SO_REUSEADDR as the servers set it: connections of an earlier run lingering
# in TIME_WAIT do not count, a listener does.)
"$PYTHON" - "$P_PORT" "$D_PORT" "$PROXY_PORT" <<'PY'
import socket, sys
for port in map(int, sys.argv[1:]):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            sys.exit(f"port {port} is taken ({exc.strerror}): set P_PORT, D_PORT or PROXY_PORT")
PY

# ---------------------------------------------------------------- model
WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvbridge-vllm-pd.XXXXXX")  # logs, the tiny model
if [ -z "${MODEL:-}" ]; then
    MODEL="$WORK_DIR/tiny-llama"
    if [ "$P_TP" -gt 1 ] || [ "$D_TP" -gt 1 ]; then
        # float32 with wide logits: greedy picks survive TP's other reduction order
        DTYPE=${DTYPE:-float32}
        tiny_args=(--dtype float32 --initializer-range 0.2)
    else
        DTYPE=${DTYPE:-bfloat16}
        tiny_args=(--dtype bfloat16)
    fi
    echo "building a tiny random Llama in $MODEL"
    "$PYTHON" -m kvbridge.integrations.vllm.tiny_model "$MODEL" "${tiny_args[@]}" \
        >"$WORK_DIR/tiny_model.log" 2>&1 || fail "building the tiny model failed:" "$WORK_DIR/tiny_model.log"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing to fetch
fi
DTYPE=${DTYPE:-bfloat16}

# ---------------------------------------------------------------- servers
start_vllm() {  # start_vllm NAME PORT TP
    local name=$1 port=$2 tp=$3
    local args=(--model "$MODEL" --host 127.0.0.1 --port "$port" --dtype "$DTYPE"
                --enforce-eager --block-size "$BLOCK_SIZE"
                --kv-transfer-config "$KV_TRANSFER_CONFIG")
    local bind=nobind  # CPU build: one rank floats; TP ranks get a core each (0|1|...)
    if [ "$tp" -gt 1 ]; then
        args+=(--tensor-parallel-size "$tp" --distributed-executor-backend mp)
        bind=$(seq -s '|' 0 $((tp - 1)))
    fi
    # shellcheck disable=SC2206  # VLLM_ARGS: one argument a word
    args+=($VLLM_ARGS)
    # A short private TMPDIR: vLLM's unix sockets must fit 107 bytes, and its
    # rendezvous files there name the shared memory the clean-up removes.
    local tmp
    tmp=$(mktemp -d /tmp/kvb-pd-XXXXXX)
    TMP_DIRS+=("$tmp")
    TMPDIR=$tmp VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-$bind} \
        setsid "$PYTHON" -m vllm.entrypoints.openai.api_server "${args[@]}" \
        </dev/null >"$WORK_DIR/$name.log" 2>&1 &
    PIDS+=("$!")
    echo "started $name (pid $!, TP $tp): python -m vllm.entrypoints.openai.api_server" \
         "--model $MODEL --port $port ... --kv-transfer-config '$KV_TRANSFER_CONFIG'"
}

wait_ready() {  # wait_ready NAME PID URL: until URL answers 200, READY_TIMEOUT_S after the start
    local name=$1 pid=$2 url=$3
    until curl -sf -o /dev/null --max-time 2 "$url"; do
        kill -0 "$pid" 2>/dev/null || fail "$name exited while starting; $WORK_DIR/$name.log ends:" \
            "$WORK_DIR/$name.log"
        [ $((SECONDS - STARTED_AT)) -lt "$READY_TIMEOUT_S" ] || \
            fail "$name not ready after $READY_TIMEOUT_S s; its log ends:" "$WORK_DIR/$name.log"
        sleep 1
    done
    echo "$name ready $((SECONDS - STARTED_AT)) s after the start: $url"
}

STARTED_AT=$SECONDS
start_vllm prefill "$P_PORT" "$P_TP"
start_vllm decode "$D_PORT" "$D_TP"
setsid "$PYTHON" -m kvbridge.cli proxy --prefill "$P_URL" --decode "$D_URL" \
    --host 127.0.0.1 --port "$PROXY_PORT" </dev/null >"$WORK_DIR/proxy.log" 2>&1 &
PIDS+=("$!")
echo "started proxy (pid $!): kvbridge proxy --prefill $P_URL --decode $D_URL --port $PROXY_PORT"
wait_ready prefill "${PIDS[0]}" "$P_URL/v1/models"
wait_ready decode "${PIDS[1]}" "$D_URL/v1/models"
wait_ready proxy "${PIDS[2]}" "$PROXY_URL/health"  # 200 once P and D answer /health

# ---------------------------------------------------------------- requests
# Greedy, fixed length: answers can be compared token for token.
body() {  # body PROMPT [EXTRA_JSON_FIELDS]
    "$PYTHON" -c 'import json, sys
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
print(json.dumps({"prompt": sys.argv[1], "max_tokens": int(sys.argv[2]), "temperature": 0,
                  "ignore_eos": True, "return_token_ids": True, **extra}))' "$@"
}
complete() {  # complete URL BODY: the answer JSON (exit 1 with the server's message on an error)
    local out
    out=$(curl -sS --fail-with-body --max-time 300 "$1/v1/completions" \
          -H 'Content-Type: application/json' -d "$2" 2>&1) || fail "POST $1/v1/completions: $out"
    printf '%s\n' "$out"
}
token_ids() {  # token_ids ANSWER_JSON: the generated token ids, as a Python list
    "$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["choices"][0]["token_ids"])' "$1"
}
counters() {  # counters URL: "transfers failures bytes external_hits local_hits", all label sets
    curl -sS --max-time 10 "$1/metrics" | awk '
        /^vllm:kvbridge_transfers_total[{ ]/ { t += $NF }
        /^vllm:kvbridge_transfer_failures_total[{ ]/ { f += $NF }
        /^vllm:kvbridge_transfer_bytes_total[{ ]/ { b += $NF }
        /^vllm:external_prefix_cache_hits_total[{ ]/ { h += $NF }
        /^vllm:prefix_cache_hits_total[{ ]/ { l += $NF }
        END { printf "%d %d %d %d %d\n", t, f, b, h, l }'
}

# A few hundred tokens each: more than one KV block (128 tokens here), so that
# asking [1] again shows D reading only what its own prefix cache lacks.
PROMPTS=(
    "Disaggregated serving splits the work of a language model server in two. A prefill server reads the whole prompt at once, which is compute bound, and writes the attention keys and values of every prompt token into its KV cache. A decode server then produces the answer one token at a time, which is bound by memory bandwidth. Between the two, the KV cache of the prompt has to move: the decode server reads the blocks it needs from the prefill server, and the prefill server frees them once they have been read. Done well, the decode server starts the answer as if it had read the prompt itself."
    "The decode server in this example reads each block of the prompt from the prefill server over UCX, then writes the answer one token at a time. The connector hands vLLM the blocks it loaded, and vLLM counts them as external prefix cache hits. A prompt the decode server has seen before is partly in its own prefix cache already: only the blocks it lacks cross the link. When a load fails, the failure policy decides: the decode server either computes the prompt itself or fails the request."
)
ANSWERS=()
ask_through_proxy() {  # ask_through_proxy LABEL PROMPT
    local label=$1 prompt=$2 before after answer
    before=$(counters "$D_URL")
    answer=$(complete "$PROXY_URL" "$(body "$prompt" "$MAX_TOKENS")")
    ANSWERS+=("$answer")
    # vLLM updates /metrics just after answering: wait until D's counters have
    # moved and then held still for a moment (at most 5 s).
    local deadline=$((SECONDS + 5)) now
    after=$(counters "$D_URL")
    while [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.3
        now=$(counters "$D_URL")
        [ "$now" = "$after" ] && [ "$after" != "$before" ] && break
        after=$now
    done
    # shellcheck disable=SC2086  # ten numbers
    "$PYTHON" -c 'import json, sys
label, prompt, answer = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
before, after = map(int, sys.argv[4:9]), map(int, sys.argv[9:14])
transfers, failures, nbytes, hits, local_hits = (y - x for x, y in zip(before, after))
text, token_ids = answer["choices"][0]["text"], answer["choices"][0]["token_ids"]
num_prompt = answer["usage"]["prompt_tokens"]
print(f"{label} {prompt[:60]!r}... ({num_prompt} prompt tokens)")
shown = repr(text) if len(text) <= 60 else repr(text[:60]) + "..."
print(f"    answer: {shown} ({len(token_ids)} tokens)")
print(f"    D: {hits} prompt tokens loaded from P in {transfers} transfer(s) of {nbytes} bytes "
      f"({failures} failed), {local_hits} found in its own prefix cache")' "$label" "$prompt" "$answer" $before $after
}

echo
echo "== through the proxy: POST $PROXY_URL/v1/completions (max_tokens $MAX_TOKENS, greedy)"
ask_through_proxy "[1]" "${PROMPTS[0]}"
ask_through_proxy "[2]" "${PROMPTS[1]}"
ask_through_proxy "[3] = [1] again:" "${PROMPTS[0]}"  # D's prefix cache holds its full blocks

echo
echo "== P alone (colocated, no kv_transfer_params) on prompt [1]: POST $P_URL/v1/completions"
# cache_salt: P computes the prompt afresh instead of reusing its prefill of [1].
ALONE=$(complete "$P_URL" "$(body "${PROMPTS[0]}" "$MAX_TOKENS" '{"cache_salt": "colocated"}')")
PD_TOKENS=$(token_ids "${ANSWERS[0]}")
ALONE_TOKENS=$(token_ids "$ALONE")
echo "    P/D:       $PD_TOKENS"
echo "    colocated: $ALONE_TOKENS"
if [ "$PD_TOKENS" = "$ALONE_TOKENS" ]; then
    echo "    -> equal: D continued from P's KV exactly as P would have"
    STATUS=0
else
    echo "    -> DIFFERENT: see $WORK_DIR/decode.log"
    STATUS=1
fi

echo
echo "== D's transfer metrics (GET $D_URL/metrics, summed over label sets)"
curl -sS --max-time 10 "$D_URL/metrics" | awk '
    match($0, /^vllm:(kvbridge_(transfers_total|transfer_failures_total|transfer_bytes_total|local_copies_total|transfer_seconds_sum|transfer_seconds_count)|external_prefix_cache_hits_total|prefix_cache_hits_total|prompt_tokens_total)[{ ]/) {
        name = substr($0, 1, RLENGTH - 1); sum[name] += $NF; if (!(name in seen)) { seen[name] = 1; order[n++] = name }
    }
    END {
        for (i = 0; i < n; i++) {
            v = sum[order[i]]
            fmt = v == int(v) ? "    %-42s %d\n" : "    %-42s %.4f\n"
            printf fmt, order[i], v
        }
    }'

if [ "${KEEP:-0}" = 1 ]; then
    echo
    echo "serving on $PROXY_URL (P $P_URL, D $D_URL); Ctrl-C stops everything"
    wait -n || true  # until one of them exits (or Ctrl-C)
    fail "a server exited; logs in $WORK_DIR"
fi
exit "$STATUS"
