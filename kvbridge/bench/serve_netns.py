"""``kvbridge bench serve --netns``: every configuration's servers on two namespace hosts.

Called by ``kvbridge/bench/serve_bench.py``, which builds the hosts once per run
(``peers/placement.py``'s ``netns_placement(join_caller=True)``: the test suite's
``NetnsLab``) and hands each configuration's servers to :func:`place` before it
starts them. Every configuration runs in the same layout::

    host a  10.77.0.1   P, or colocated replica 0   (core 0 with --cores split)
    host b  10.77.0.2   D, or colocated replica 1   (core 1)
    this namespace      the front end (vllm-router or kvbridge proxy, on its own
      10.77.0.254       127.0.0.1) and the load client (vllm bench serve), as today;
                        it reaches the servers' HTTP ports at the addresses above

    a ── veth ── switch (bridge) ── veth ── b
                   └── veth ── this namespace (NetnsLab.join_caller)

A server listens on its host's address and is started with its host's
``ip netns exec`` prefix (which execs it in place: pid, process group and
core binding stay its own, so ``serve_profile.py`` counts its CPU as
before). Every server gets ``UCX_TLS=tcp``, so KV crosses the veths as TCP:
UCX leaves out shared memory and kvbridge turns its same-host copies off by
itself (``kvbridge/transfer/protocol/host.py``); the kernel would otherwise
let the two "hosts" share pages. Each connector advertises its host's address
to D, as on two machines:

- KVBridgeConnector: ``kv_connector_extra_config.host`` (P's answer carries it
  as ``remote_host``; the agents listen on it), and a cluster secret in
  ``$KVBRIDGE_SECRET``, new per configuration and the same for P and D (a
  non-loopback ``host`` refuses the per-host secret).
- NixlConnector (``kv_buffer_device`` cpu, as ``kvbridge bench vllm``):
  ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (its handshake listener and ``remote_host``),
  and ``UCX_TLS=tcp`` in place of loopback's ``tcp,sm,self``.

The hosts are removed when the run ends, also on an error, Ctrl-C or SIGTERM
(``netns_placement``); the report says ``"network": "netns-tcp"`` and where
each side ran. With ``--url`` nothing is started, so nothing can be placed:
:data:`WITH_URL` says so.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace

from kvbridge.bench.peers.placement import Placement, Side
from kvbridge.bench.vllm_servers import VllmServer

__all__ = ["WITH_URL", "place", "roles"]

WITH_URL = ("--netns places the servers the benchmark starts; --url measures front ends "
            "already running and starts nothing: use one or the other")
_SECRET_ENV = "KVBRIDGE_SECRET"


def place(servers: list[VllmServer], placement: Placement) -> list[VllmServer]:
    """``servers`` (not started: P and D, or two replicas) as ``placement`` puts them.

    Args:
        servers: A configuration's pair, in ``serve_configs.servers``' order: the
            first (P, replica 0) goes to the serving host, the second to the reading one.
        placement: Where; on loopback (``same_host``) the servers are returned as they are.

    Returns:
        New servers (the given ones are not changed): each with its host's address,
        command prefix and environment, and its connector told that address.
    """
    if placement.same_host:
        return servers
    assert len(servers) == 2, [s.name for s in servers]  # serve_configs: always a pair
    secret = secrets.token_hex(32)
    return [_on(server, side, placement, secret)
            for server, side in zip(servers, (placement.serve, placement.read), strict=True)]


def _on(server: VllmServer, side: Side, placement: Placement, secret: str) -> VllmServer:
    env = {**server.env, **placement.env}
    config = None if server.kv_transfer_config is None else json.loads(
        server.kv_transfer_config)
    connector = (config or {}).get("kv_connector")
    if connector == "KVBridgeConnector":
        assert config is not None
        config["kv_connector_extra_config"] = {
            **config.get("kv_connector_extra_config", {}), "host": side.ip}
        env[_SECRET_ENV] = secret
    elif connector == "NixlConnector":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = side.ip
    return replace(server, host=side.ip, prefix=side.prefix, env=env,
                   kv_transfer_config=None if config is None else json.dumps(config))


def roles(placement: Placement) -> dict[str, str]:
    """Who runs at which address, for the report and the table."""
    if placement.same_host:
        return {"servers, front end, client": placement.serve.ip}
    return {"P / replica 0": placement.serve.ip, "D / replica 1": placement.read.ip,
            "front end, client": placement.caller_ip or "?"}
