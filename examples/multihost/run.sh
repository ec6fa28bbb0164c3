#!/usr/bin/env bash
# 1P1D across emulated hosts: prefill, decode and proxy each in their own network
# namespace (tests/integration/netns.py), UCX over TCP on the hosts' veth links.
# Builds the lab, starts P (TP 2), D (TP 1) and the proxy, asks once, shows how
# many KV bytes crossed D's NIC, then tears everything down. Needs root.
#
#   sudo examples/multihost/run.sh           # start, ask once, stop
#   sudo KEEP=1 examples/multihost/run.sh    # ... and keep serving until Ctrl-C
#
# Inside the lab every host has its own port space, so P and D both use port 8100
# (HTTP) and 5600 (transfer agents; TP rank r listens on 5600 + r).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}
HTTP_PORT=8100
TRANSFER_PORT=5600
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # three engines share the cores
# The lab's hosts share one kernel: without this UCX would move the KV through
# shared memory and the lab network would carry nothing.
export UCX_TLS=tcp

if [ "$(id -u)" != 0 ]; then
    echo "network namespaces need root: sudo $0" >&2
    exit 1
fi

LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvbridge-multihost.XXXXXX")
LAB_PID=""

# The lab process owns the namespaces: on SIGTERM it kills every process inside
# them (our servers and their TP workers) and deletes them.
teardown() {
    trap - EXIT INT TERM
    if [ -n "$LAB_PID" ] && kill -0 "$LAB_PID" 2>/dev/null; then
        kill -TERM "$LAB_PID"
        wait "$LAB_PID" 2>/dev/null || true
    fi
    echo "lab torn down; logs in $LOG_DIR"
}
trap teardown EXIT
trap 'exit 130' INT TERM

wait_for() {  # wait_for FILE PATTERN WHAT PID
    local deadline=$((SECONDS + READY_TIMEOUT_S))
    until grep -q "$2" "$1" 2>/dev/null; do
        if ! kill -0 "$4" 2>/dev/null; then
            echo "$3 exited before it was ready; its log:" >&2
            tail -n 30 "$1" >&2
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "$3 not ready after ${READY_TIMEOUT_S} s; its log:" >&2
            tail -n 30 "$1" >&2
            exit 1
        fi
        sleep 0.5
    done
}

# 1. The lab: hosts prefill 10.77.0.1, decode 10.77.0.2, proxy 10.77.0.3.
"$PYTHON" "$ROOT/tests/integration/netns.py" up prefill decode proxy >"$LOG_DIR/lab.log" 2>&1 &
LAB_PID=$!
wait_for "$LOG_DIR/lab.log" "lab up" "the lab" "$LAB_PID"
cat "$LOG_DIR/lab.log"
# lines look like: "prefill      10.77.0.1       ip netns exec kvb-4242-1a2b3c-prefill ..."
ns_of() { awk -v h="$1" '$1 == h { print $6 }' "$LOG_DIR/lab.log"; }
ip_of() { awk -v h="$1" '$1 == h { print $2 }' "$LOG_DIR/lab.log"; }
P_NS=$(ns_of prefill) D_NS=$(ns_of decode) X_NS=$(ns_of proxy)
P_IP=$(ip_of prefill) D_IP=$(ip_of decode) X_IP=$(ip_of proxy)

declare -A PIDS
in_host() {  # in_host NAMESPACE LOGNAME ARGS... : kvbridge in that host, in the background
    local ns=$1 name=$2
    shift 2
    ip netns exec "$ns" "$PYTHON" -m kvbridge.cli "$@" >"$LOG_DIR/$name.log" 2>&1 &
    PIDS[$name]=$!
    echo "started $name in $ns: kvbridge $*"
}

# 2. P (TP 2) and D (TP 1), each listening on its own host's address, sharing one
# cluster secret (servers on addresses other hosts reach refuse to start without one).
SECRET_FILE="$LOG_DIR/secret"
(umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' >"$SECRET_FILE")
in_host "$P_NS" prefill serve --role prefill --tp 2 --block-size 16 --kv-layout HND \
    --host "$P_IP" --port "$HTTP_PORT" --transfer-port "$TRANSFER_PORT" --engine-id prefill-0 \
    --secret-file "$SECRET_FILE"
in_host "$D_NS" decode serve --role decode --tp 1 --block-size 32 --kv-layout HND \
    --host "$D_IP" --port "$HTTP_PORT" --transfer-port "$TRANSFER_PORT" --engine-id decode-0 \
    --secret-file "$SECRET_FILE"
# 3. The proxy on a third host.
in_host "$X_NS" proxy proxy --prefill "http://$P_IP:$HTTP_PORT" --decode "http://$D_IP:$HTTP_PORT" \
    --host "$X_IP" --port "$HTTP_PORT"
for name in prefill decode proxy; do
    wait_for "$LOG_DIR/$name.log" "ready on http://" "$name" "${PIDS[$name]}"
    grep -m1 "ready on http://" "$LOG_DIR/$name.log"
done

# 4. One completion, asked from the proxy's host (the lab has no route to ours).
rx_bytes() { ip -n "$D_NS" -j -s link show eth0 | "$PYTHON" -c \
    'import json, sys; print(json.load(sys.stdin)[0]["stats64"]["rx"]["bytes"])'; }
RX_BEFORE=$(rx_bytes)
echo
echo "POST http://$X_IP:$HTTP_PORT/v1/completions (from the proxy host)"
ANSWER=$(ip netns exec "$X_NS" curl -sS --fail-with-body "http://$X_IP:$HTTP_PORT/v1/completions" \
    -H 'Content-Type: application/json' \
    -d '{"prompt": "Disaggregated serving moves the KV cache from prefill to decode, host to host.", "max_tokens": 12}')
echo "$ANSWER"
RX_AFTER=$(rx_bytes)
"$PYTHON" -c '
import json, sys
answer = json.loads(sys.argv[1])
remote, num_prompt = answer["kvbridge"]["num_remote_tokens"], answer["usage"]["prompt_tokens"]
nic_bytes = int(sys.argv[3]) - int(sys.argv[2])
print(f"-> D read {remote} of {num_prompt} prompt tokens from P; its NIC received "
      f"{nic_bytes} bytes meanwhile")
' "$ANSWER" "$RX_BEFORE" "$RX_AFTER"
echo
echo "D's transfer counters (GET http://$D_IP:$HTTP_PORT/metrics):"
ip netns exec "$X_NS" curl -sS "http://$D_IP:$HTTP_PORT/metrics" \
    | grep -E '^kvbridge_kv_(transfers_total|transfer_bytes_total|transfer_failures_total) '

if [ "${KEEP:-0}" = 1 ]; then
    echo
    echo "serving on http://$X_IP:$HTTP_PORT inside $X_NS; try:"
    echo "  sudo ip netns exec $X_NS curl http://$X_IP:$HTTP_PORT/v1/completions \\"
    echo "       -H 'Content-Type: application/json' -d '{\"prompt\": \"Hello\", \"max_tokens\": 8}'"
    echo "Ctrl-C tears the lab down"
    wait "$LAB_PID"
fi
