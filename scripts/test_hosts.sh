#!/usr/bin/env bash
# System tools the multi-host tests use besides iproute2: iptables, for the
# NFQUEUE delay line that stands in for `tc netem` where the kernel has no
# sch_netem (tests/integration/nfqueue_link.py). Root only; without root the
# namespace tests cannot run at all and say so themselves.
set -uo pipefail
if [ "$(id -u)" != 0 ] || command -v iptables-legacy >/dev/null || ! command -v apt-get >/dev/null; then
    exit 0
fi
apt-get install -y -q iptables >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iptables >/dev/null 2>&1; } \
    || echo "scripts/test_hosts.sh: could not install iptables; netem tests will say why" >&2
exit 0
