"""Where the two sides of a benchmark pair run: both on loopback, or on two netns hosts.

Used by ``kvbridge/bench/transfer_bench.py`` (``kvbridge bench transfer [--netns]``)
and by everything it starts: kvbridge's pair (``transfer_agents.py``), the
NIXL and Mooncake children (``harness.py``) and ``ucx_perftest``. Every pair
has a *serving* side (kvbridge's server, a peer's target, the perftest server)
and a *reading* side (reader, initiator, client). A :class:`Placement` says how
each side's command starts and which address it has::

    LOOPBACK                          netns_placement()
    serve  <cmd>       127.0.0.1      ip netns exec kvbb-<pid>-<tok>-a <cmd>   10.77.0.1
    read   <cmd>       127.0.0.1      ip netns exec kvbb-<pid>-<tok>-b <cmd>   10.77.0.2
    env    as it is                   UCX_TLS=tcp for every child

In the namespaces the bytes cross a veth pair and a bridge, as between two
hosts; same-host copies cannot apply (``UCX_TLS=tcp`` turns off UCX's shared
memory and kvbridge's own copies, ``kvbridge/transfer/protocol/host.py``).
``kvbridge bench serve --netns`` (``kvbridge/bench/serve_netns.py``) places P
and D the same way and joins this process's own namespace to the hosts' switch
(``join_caller``, ``Placement.caller_ip``: the subnet's last address), so that
the front end and the load client it starts reach both servers over the veths.

The namespaces come from ``tests/integration/netns.py`` (``NetnsLab``; standard
library only, loaded by path) under the prefix ``kvbb``: the test suite's
``cleanup_stale`` (prefix ``kvb``) never matches them, nor they a test's lab.
That lab is the test suite's, so ``--netns`` runs from a source checkout only
(an installed kvbridge says so and runs nothing); it stands two hosts up on one
machine, where a deployment has real ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

__all__ = ["LOOPBACK", "NETNS_PREFIX", "NetnsUnavailableError", "Placement", "Side",
           "check_netns", "netns_placement"]

NETNS_PREFIX = "kvbb"
_NETNS_PY = Path(__file__).resolve().parents[3] / "tests" / "integration" / "netns.py"
_NETNS_MODULE = "kvbridge_bench_netns"  # its name in sys.modules (loaded by path)


class NetnsUnavailableError(RuntimeError):
    """This process cannot build the namespace hosts (not root, no ``ip``, or refused)."""


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a pair: the words its command starts with, and its address.

    Attributes:
        prefix: Prepended to the side's command (``ip netns exec <ns>``, or none).
        ip: The address the other side reaches this one at.
    """

    prefix: tuple[str, ...]
    ip: str

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as started on this side."""
        return [*self.prefix, *cmd]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a pair's serving and reading sides run.

    Attributes:
        network: ``"loopback"`` or ``"netns-tcp"``; written into the report.
        serve: The serving side (server, target).
        read: The reading side (reader, initiator, client).
        env: Added to every child's environment.
        sent_nbytes: Bytes the serving side has sent on its link so far, where
            it has a link of its own to count on (the namespace hosts' eth0).
        caller_ip: This process's address on the sides' network, where it joined
            it (``netns_placement(join_caller=True)``); None: it has none there.
    """

    network: str
    serve: Side
    read: Side
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    sent_nbytes: Callable[[], int] | None = None
    caller_ip: str | None = None

    @property
    def same_host(self) -> bool:
        """Both sides are processes of this host's network: same-host copies may apply."""
        return not self.serve.prefix and not self.read.prefix

    def describe(self) -> dict[str, Any]:
        """For the report: the mode, each side's address, the children's extra environment
        and, on namespace hosts, the bytes the serving host has sent so far."""
        described: dict[str, Any] = {"network": self.network, "serve_ip": self.serve.ip,
                                     "read_ip": self.read.ip, "child_env": dict(self.env)}
        if self.sent_nbytes is not None:
            described["serve_sent_nbytes"] = self.sent_nbytes()
        if self.caller_ip is not None:
            described["caller_ip"] = self.caller_ip
        return described


LOOPBACK = Placement("loopback", Side((), "127.0.0.1"), Side((), "127.0.0.1"))


def _netns() -> ModuleType:
    """``tests/integration/netns.py``, imported by path once."""
    module = sys.modules.get(_NETNS_MODULE)
    if module is None:
        if not _NETNS_PY.is_file():
            installed = _NETNS_PY.parents[2] / "kvbridge"
            raise NetnsUnavailableError(
                f"the namespace hosts come from a kvbridge source checkout's "
                f"tests/integration/netns.py; this kvbridge ({installed}) is not in one: run "
                f"it from a checkout (PYTHONPATH=<checkout>)")
        spec = importlib.util.spec_from_file_location(_NETNS_MODULE, _NETNS_PY)
        if spec is None or spec.loader is None:
            raise NetnsUnavailableError(f"cannot load the namespace harness {_NETNS_PY}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NETNS_MODULE] = module
        spec.loader.exec_module(module)
    return module


def check_netns() -> None:
    """Raise unless this process may build network namespaces (nothing is changed).

    Raises:
        NetnsUnavailableError: not root, or ``ip`` (iproute2) is not on PATH.
    """
    netns = _netns()
    try:
        netns.check_netns_support()
    except netns.NetnsError as exc:
        raise NetnsUnavailableError(f"two namespace hosts need root and `ip`: {exc}") from None


@contextlib.contextmanager
def netns_placement(prefix: str = NETNS_PREFIX, *,
                    join_caller: bool = False) -> Iterator[Placement]:
    """Build hosts ``a`` (serving) and ``b`` (reading) on one virtual switch; remove them after.

    With ``join_caller`` this process's namespace is plugged into the switch too
    (``NetnsLab.join_caller``): what it starts outside the hosts reaches them at
    their addresses, from ``Placement.caller_ip``.

    On leaving, by return, exception, Ctrl-C or SIGTERM (the lab's handler turns
    it into ``SystemExit``), every process still inside the namespaces is killed
    and the namespaces are deleted.

    Raises:
        NetnsUnavailableError: as :func:`check_netns`, or the lab could not be built
            (nothing is left behind then).
    """
    check_netns()
    netns = _netns()
    lab = netns.NetnsLab(["a", "b"], prefix=prefix)
    try:
        lab.__enter__()  # on failure it has torn down what it built
    except netns.NetnsError as exc:
        raise NetnsUnavailableError(str(exc)) from None
    try:
        try:
            caller_ip = lab.join_caller() if join_caller else None
        except netns.NetnsError as exc:
            raise NetnsUnavailableError(str(exc)) from None
        serve, read = lab["a"], lab["b"]
        yield Placement("netns-tcp", Side(tuple(serve.command(())), serve.ip),
                        Side(tuple(read.command(())), read.ip),
                        MappingProxyType(netns.ucx_env()),
                        lambda: int(serve.link_stats().tx_bytes), caller_ip)
    finally:
        lab.close()
