#!/usr/bin/env bash
# One-host P/D deployment in one script: prefill (TP 2), decode (TP 1), proxy,
# one completion through the proxy, then everything is stopped again.
# The three terminals' worth of commands are explained in README.md.
#
#   examples/single_host/run.sh           # start, ask once, stop
#   KEEP=1 examples/single_host/run.sh    # start, ask once, keep serving until Ctrl-C
#
# Ports (override by environment): P_PORT, D_PORT, PROXY_PORT for HTTP,
# P_TRANSFER_PORT, D_TRANSFER_PORT for the transfer agents (rank r uses base + r).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [ -z "${KVBRIDGE:-}" ]; then
    if [ -x "$ROOT/.venv/bin/kvbridge" ]; then KVBRIDGE="$ROOT/.venv/bin/kvbridge"; else KVBRIDGE=kvbridge; fi
fi
P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
P_TRANSFER_PORT=${P_TRANSFER_PORT:-9100}
D_TRANSFER_PORT=${D_TRANSFER_PORT:-9200}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-20}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # three engines share the cores
# Let the transfer agents listen again on ports whose last connections still
# linger in TIME_WAIT (about a minute after the previous run), as HTTP servers do.
export UCX_TCP_CM_REUSEADDR=${UCX_TCP_CM_REUSEADDR:-y}

LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvbridge-single-host.XXXXXX")
PIDS=()

# Each server runs in its own session (setsid): its TP workers share its
# process group, so the clean-up can reach them even if the server hangs.
start() {  # start NAME ARGS...
    local name=$1
    shift
    setsid "$KVBRIDGE" "$@" >"$LOG_DIR/$name.log" 2>&1 &
    PIDS+=("$!")
    echo "started $name (pid $!): kvbridge $*"
}

stop_all() {
    trap - EXIT INT TERM
    local pid
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    local deadline=$((SECONDS + STOP_TIMEOUT_S))
    for pid in "${PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
        kill -KILL -- "-$pid" 2>/dev/null || true  # the group: anything left of it
    done
    echo "stopped; logs in $LOG_DIR"
}
trap stop_all EXIT
trap 'exit 130' INT TERM

wait_ready() {  # wait_ready NAME PID
    local name=$1 pid=$2 deadline=$((SECONDS + READY_TIMEOUT_S))
    until grep -q "ready on http://" "$LOG_DIR/$name.log"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "$name exited before it was ready; its log:" >&2
            tail -n 30 "$LOG_DIR/$name.log" >&2
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "$name not ready after ${READY_TIMEOUT_S} s; its log:" >&2
            tail -n 30 "$LOG_DIR/$name.log" >&2
            exit 1
        fi
        sleep 0.5
    done
    grep -m1 "ready on http://" "$LOG_DIR/$name.log"
}

# Terminal 1: the prefill instance (P).
start prefill serve --role prefill --tp 2 --block-size 16 --kv-layout HND \
    --host 127.0.0.1 --port "$P_PORT" --transfer-port "$P_TRANSFER_PORT" --engine-id prefill-0
# Terminal 2: the decode instance (D).
start decode serve --role decode --tp 1 --block-size 16 --kv-layout HND \
    --host 127.0.0.1 --port "$D_PORT" --transfer-port "$D_TRANSFER_PORT" --engine-id decode-0
# Terminal 3: the proxy clients talk to.
start proxy proxy --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT" \
    --host 127.0.0.1 --port "$PROXY_PORT"

wait_ready prefill "${PIDS[0]}"
wait_ready decode "${PIDS[1]}"
wait_ready proxy "${PIDS[2]}"

echo
echo "POST http://127.0.0.1:$PROXY_PORT/v1/completions"
ANSWER=$(curl -sS --fail-with-body "http://127.0.0.1:$PROXY_PORT/v1/completions" \
    -H 'Content-Type: application/json' \
    -d '{"prompt": "Disaggregated serving moves the KV cache from prefill to decode.", "max_tokens": 12}')
echo "$ANSWER"
python3 -c '
import json, sys
answer = json.loads(sys.argv[1])
stats, num_prompt = answer["kvbridge"], answer["usage"]["prompt_tokens"]
remote, cached, ttft_ms = stats["num_remote_tokens"], stats["num_cached_tokens"], stats["ttft_s"] * 1e3
print(f"-> D read {remote} of {num_prompt} prompt tokens from P ({cached} were in its own "
      f"prefix cache); D time to first token {ttft_ms:.0f} ms")
' "$ANSWER"
echo
echo "D's transfer counters (GET http://127.0.0.1:$D_PORT/metrics):"
curl -sS "http://127.0.0.1:$D_PORT/metrics" \
    | grep -E '^kvbridge_kv_(transfers_total|transfer_bytes_total|transfer_seconds_(sum|count)) '

if [ "${KEEP:-0}" = 1 ]; then
    echo
    echo "serving on http://127.0.0.1:$PROXY_PORT; Ctrl-C stops everything"
    wait
fi
