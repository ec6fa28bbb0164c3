#!/usr/bin/env bash
# The test suite as two pytest processes side by side (`make pytest`, `make pytest-full`):
#   - the tests that start engine servers: tests/integrations/vllm and .../sglang, then
#     the benchmarks' vLLM runs (kvbridge bench serve, kvbridge bench vllm); server
#     starts keep both cores busy,
#     and, to keep the halves even, gpu_check's CPU dry run (~35 s; gpu_probe's, ~35 s
#     too, went back to the other half when the SGLang servers joined this one),
#   - everything else: many of its tests wait on child processes, sockets and deadlines,
#     and leave a core idle while they do.
# Side by side they take far less wall time than one after the other on two cores (the
# split keeps the two halves about as long: ~24 min each on a 2-core AMD EPYC, AVX2).
# Each takes its ports from a span of its own (KVBRIDGE_PORT_SPAN: below the kernel's
# ephemeral range, halves of what kvbridge.cli.demo.procs.reserve_ports would use), so
# the two never hand out the same port. Each one's output is printed whole once it ends
# (the vLLM half first), each ending with pytest's summary, its time by package and its
# slowest tests; the script fails if either fails.
#
# Usage: scripts/pytest_pair.sh PYTHON [PYTEST ARGS...]   (args go to both halves)
set -uo pipefail
PYTHON=$1
shift
VLLM_TESTS=(tests/integrations/vllm tests/integrations/sglang tests/bench/test_bench_serve.py tests/bench/test_bench_vllm.py
            tests/bench/test_serve_netns.py tests/bench/test_gpu_check.py)

low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
if [ "$low" -ge 24000 ]; then
    mid=$(( (20000 + low) / 2 ))
    span_vllm="20000-$mid"
    span_rest="$mid-$low"
else  # a host whose ephemeral range starts low: reserve_ports' own fallback span, split
    span_vllm="20000-25000"
    span_rest="25000-30000"
fi

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
ignored=()
for path in "${VLLM_TESTS[@]}"; do
    ignored+=("--ignore=$path")
done
KVBRIDGE_PORT_SPAN=$span_vllm "$PYTHON" -m pytest "$@" "${VLLM_TESTS[@]}" >"$logs/vllm.log" 2>&1 &
vllm_pid=$!
KVBRIDGE_PORT_SPAN=$span_rest "$PYTHON" -m pytest "$@" tests "${ignored[@]}" \
    >"$logs/rest.log" 2>&1 &
rest_pid=$!
echo "pytest_pair.sh: ${VLLM_TESTS[*]} (ports $span_vllm) beside the rest of tests/" \
    "(ports $span_rest)"

wait "$vllm_pid"
vllm_rc=$?
echo "===== pytest ${VLLM_TESTS[*]}: exit $vllm_rc ====="
cat "$logs/vllm.log"
wait "$rest_pid"
rest_rc=$?
echo "===== pytest tests/ but those: exit $rest_rc ====="
cat "$logs/rest.log"
# pytest's 5 (no tests collected) is a failure here too: each half has tests
[ "$vllm_rc" = 0 ] && [ "$rest_rc" = 0 ]
