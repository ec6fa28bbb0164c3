"""Ports for the servers tests start: below the ephemeral range, never handed out twice.

A port found free by binding port 0 lies in the kernel's ephemeral range, where
any outgoing connection (UCX's, an HTTP client's) may take it before the child
that was given it binds it ("cannot listen on port ...: Device is busy").
``kvbridge.cli.demo.procs.reserve_ports`` looks below that range instead; this
module also remembers what it handed out in this test process, so two servers
of one test never get the same port.
"""

from __future__ import annotations

from kvbridge.cli.demo.procs import reserve_ports

_handed_out: set[int] = set()  # this pytest process's ports, for its whole run


def free_port_base(num_ports: int = 1) -> int:
    """A base port of ``num_ports`` consecutive ports, free now and not handed out before."""
    for _ in range(100):
        [base] = reserve_ports([num_ports])
        run = set(range(base, base + num_ports))
        if not run & _handed_out:
            _handed_out.update(run)
            return base
    raise RuntimeError(f"no run of {num_ports} free ports left below the ephemeral range")


def free_port() -> int:
    """One free port (see ``free_port_base``)."""
    return free_port_base(1)
