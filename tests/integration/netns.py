"""Multi-host test harness: Linux network namespaces joined by one virtual switch.

Called by tests/integration and tests/faults (through the fixtures in conftest.py)
and by examples/multihost, so that prefill, decode and proxy processes run as if on
separate machines: each "host" is a namespace with its own loopback and one NIC
(``eth0``) on a private subnet, and UCX talks over that NIC instead of ``lo``.
Standard library only, so it can be imported by path from anywhere.

One lab (all names carry ``<prefix>-<pid>-<token>-`` so runs never collide)::

    ns ...-prefill              ns ...-switch                       ns ...-decode
    +------------------+        +-------------------------------+    +------------------+
    | lo               |  veth  |                               |veth| lo               |
    | eth0 10.77.0.1/24|--------| p-prefill --- br0 --- p-decode|----| eth0 10.77.0.2/24|
    +------------------+        +-------------------------------+    +------------------+

Every link is created straight inside lab namespaces (nothing appears in the
caller's namespace), the switch has no uplink and no namespace has a default
route, so traffic cannot leave the lab. A caller that must reach the hosts
itself (``kvbridge bench serve --netns``: its front end, load client and
metrics scrapes) plugs its own namespace into the switch (``join_caller``):
one veth whose far end goes with the switch, the subnet's last address, a
route to the subnet and nothing else. IPv6 is off inside the lab to keep the
wire quiet. ``link_down`` cuts a host's cable at the switch end: the host keeps
its address and sockets, packets are silently dropped, as with a pulled cable.

Teardown (``close``, ``__exit__``, atexit, SIGTERM/SIGHUP) kills every process
inside the lab's namespaces and deletes them; ``cleanup_stale`` removes what
runs killed with SIGKILL left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, NamedTuple

import pytest

__all__ = [
    "DEFAULT_PREFIX", "DEFAULT_SUBNET", "HOST_IFNAME", "Host", "LinkStats", "NetemUnavailableError",
    "NetnsCommandError", "NetnsError", "NetnsLab", "check_netns_support", "cleanup_stale",
    "list_namespaces", "ucx_env", "wait_for_line",
]

DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_PREFIX = "kvb"
HOST_IFNAME = "eth0"
_NFQUEUE_SCRIPT = Path(__file__).with_name("nfqueue_link.py")
_NFQUEUE_BASE = 40  # queue number of the lab's first host
_SWITCH = "switch"
_BRIDGE = "br0"
_HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,11}")  # "p-" + name must fit IFNAMSIZ (15)
_PREFIX = re.compile(r"[a-z]{1,8}")


class NetnsError(RuntimeError):
    """The harness cannot build, drive or tear down its namespaces (reason in the message)."""


class NetnsCommandError(NetnsError):
    """A command run by the harness or in a host exited non-zero."""

    def __init__(self, cmd: Sequence[str], returncode: int, stderr: str) -> None:
        super().__init__(f"`{' '.join(cmd)}` exited {returncode}: {stderr.strip()}")
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stderr = stderr


class NetemUnavailableError(NetnsError):
    """``tc`` or the kernel's sch_netem qdisc is missing; the caller decides what that means."""


def netem_or_skip(lab: NetnsLab, host: Host | str, **shape: float) -> str:
    """``lab.netem(host, **shape)``, or skip the calling test where this host can shape
    no link (no sch_netem and no usable iptables NFQUEUE), with the reason."""
    try:
        return lab.netem(host, **shape)
    except NetemUnavailableError as exc:
        pytest.skip(f"this host cannot delay or drop packets: {exc}")


class LinkStats(NamedTuple):
    rx_bytes: int
    tx_bytes: int


def ucx_env() -> dict[str, str]:
    """Environment for UCX processes in a lab.

    UCX sees lab hosts as one machine (same boot id, shared /dev/shm), so without
    this it moves data by shared memory and the lab network (cuts, netem) has no
    effect: kvbridge's UcxWorker sent a 4 MiB message between two lab hosts with
    ~1 KiB crossing eth0. ucxx's asyncio API picks tcp anyway (error handling on).

    Returns:
        A fresh dict to merge into a process environment.
    """
    return {"UCX_TLS": "tcp"}


def check_netns_support() -> None:
    """Raise unless this process can create network namespaces.

    Raises:
        NetnsError: not root, or ``ip`` (iproute2) is not on PATH; the message says which.
    """
    if os.geteuid() != 0:
        raise NetnsError(
            f"network namespaces need root (euid={os.geteuid()}); run the multi-host tests as "
            "root, as CI does"
        )
    if shutil.which("ip") is None:
        raise NetnsError("`ip` not found on PATH: install iproute2 (apt-get install -y iproute2)")


def _run(cmd: Sequence[str], *, timeout_s: float = 15.0, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and proc.returncode != 0:
        raise NetnsCommandError(cmd, proc.returncode, proc.stderr)
    return proc.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _namespace_pids(netns: str) -> list[int]:
    return [int(tok) for tok in _run(["ip", "netns", "pids", netns], check=False).split()]


def _destroy_namespace(netns: str, *, timeout_s: float = 5.0) -> None:
    """SIGKILL everything inside ``netns`` (waiting until gone), then delete it."""
    if netns not in list_namespaces():
        return
    deadline = time.monotonic() + timeout_s
    while pids := _namespace_pids(netns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in {netns} survived SIGKILL for {timeout_s}s")
        time.sleep(0.02)
    _run(["ip", "netns", "del", netns])  # its veth ends (and their peers) go with it


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete lab namespaces whose creating process no longer exists.

    Labs of live processes (this one, parallel runs) are left alone.

    Args:
        prefix: the ``prefix`` the labs were created with.

    Returns:
        The names of the namespaces removed.

    Raises:
        NetnsError: as :func:`check_netns_support`, or a namespace could not be removed.
    """
    check_netns_support()
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]+-[a-z0-9]+")
    removed = []
    for netns in list_namespaces():
        match = pattern.fullmatch(netns)
        if match and not _pid_alive(int(match.group(1))):
            _destroy_namespace(netns)
            removed.append(netns)
    return removed


def wait_for_line(proc: subprocess.Popen[str], marker: str, *, timeout_s: float) -> list[str]:
    """Read ``proc``'s stdout (text, piped) until a line contains ``marker``.

    Returns:
        The lines read, the marker line last.

    Raises:
        TimeoutError: no such line within ``timeout_s``, or the process ended first;
            the message holds the output so far.
        ValueError: ``proc`` has no stdout pipe.
    """
    if proc.stdout is None:
        raise ValueError(f"wait_for_line needs pid {proc.pid} started with stdout=PIPE")
    stream, lines = proc.stdout, list[str]()
    found = threading.Event()

    def pump() -> None:  # a thread, because a pipe read cannot time out portably
        for line in stream:
            lines.append(line.rstrip("\n"))
            if marker in line:
                found.set()
                return

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found.is_set():
        state = f"not within {timeout_s}s" if reader.is_alive() else "output ended"
        raise TimeoutError(f"no line with {marker!r} from pid {proc.pid} ({state}): {lines}")
    return lines


class Host:
    """One emulated machine: a namespace with ``lo`` and ``eth0`` at ``ip``. Made by NetnsLab."""

    def __init__(self, name: str, netns: str, ip: str, procs: list[subprocess.Popen[str]]):
        self.name = name
        self.netns = netns
        self.ip = ip
        self.ifname = HOST_IFNAME
        self._procs = procs  # owned by the lab, which kills them at teardown

    def __repr__(self) -> str:
        return f"Host({self.name!r}, netns={self.netns!r}, ip={self.ip!r})"

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` wrapped to run inside this host (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def run(
        self, cmd: Sequence[str], *, check: bool = True, timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in this host and wait; output is captured as text.

        Args:
            env: variables added to (not replacing) this process's environment.

        Raises:
            NetnsCommandError: ``check`` and a non-zero exit.
            subprocess.TimeoutExpired: not done within ``timeout_s`` (the child is killed).
        """
        full = self.command(cmd)
        proc = subprocess.run(
            full, capture_output=True, text=True, timeout=timeout_s, check=False,
            env={**os.environ, **(env or {})},
        )
        if check and proc.returncode != 0:
            raise NetnsCommandError(full, proc.returncode, proc.stderr + proc.stdout)
        return proc

    def popen(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
        stdout: int | IO[Any] | None = subprocess.PIPE,
        stderr: int | IO[Any] | None = subprocess.STDOUT,
    ) -> subprocess.Popen[str]:
        """Start ``cmd`` in this host, in its own session; the lab kills it at teardown.

        Args:
            env: variables added to (not replacing) this process's environment.
            stdout, stderr: as for ``subprocess.Popen``; text mode. Drain pipes you ask for.
        """
        proc = subprocess.Popen(
            self.command(cmd), env={**os.environ, **(env or {})}, stdout=stdout, stderr=stderr,
            text=True, start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def link_stats(self) -> LinkStats:
        """Byte counters of this host's ``eth0`` (what crossed the lab network)."""
        info = json.loads(_run(["ip", "-n", self.netns, "-j", "-s", "link", "show", self.ifname]))
        stats = info[0]["stats64"]
        return LinkStats(int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))

    def wait_for_port(self, port: int, *, timeout_s: float) -> None:
        """Block until a TCP connect to ``ip:port`` succeeds from inside this host.

        Raises:
            TimeoutError: nothing accepted within ``timeout_s``.
        """
        probe = (
            "import socket,sys,time\n"
            "end = time.monotonic() + float(sys.argv[3])\n"
            "while True:\n"
            "    try: socket.create_connection((sys.argv[1], int(sys.argv[2])), 0.5).close()\n"
            "    except OSError:\n"
            "        if time.monotonic() > end: sys.exit(1)\n"
            "        time.sleep(0.05)\n"
            "    else: break\n"
        )
        args = [sys.executable, "-c", probe, self.ip, str(port), str(timeout_s)]
        if self.run(args, check=False, timeout_s=timeout_s + 10).returncode != 0:
            raise TimeoutError(f"nothing accepts on {self.ip}:{port} in {self.netns} "
                               f"after {timeout_s}s")


class NetnsLab:
    """Hosts on one L2 segment, built on ``__enter__`` and torn down on ``close``/``__exit__``.

    Args:
        host_names: distinct names, ``[a-z][a-z0-9]{0,11}``, not ``"switch"``; host i
            (0-based) gets address i+1 of ``subnet``.
        subnet: private IPv4 network for the hosts.
        prefix: namespace name prefix, ``[a-z]{1,8}`` (see :func:`cleanup_stale`).

    Raises:
        ValueError: bad names, a non-private subnet or one too small (numbers in message).
    """

    def __init__(
        self, host_names: Sequence[str], *, subnet: str = DEFAULT_SUBNET,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        network = ipaddress.IPv4Network(subnet)
        bad = [n for n in host_names if not _HOST_NAME.fullmatch(n) or n == _SWITCH]
        if not host_names or bad or len(set(host_names)) != len(host_names):
            raise ValueError(f"host names must be distinct, non-empty, [a-z][a-z0-9]{{0,11}}, "
                             f"not {_SWITCH!r}; got {list(host_names)} (bad: {bad})")
        if not network.is_private or network.num_addresses - 2 < len(host_names):
            raise ValueError(f"subnet {network} must be private with >= {len(host_names)} "
                             f"host addresses (has {max(network.num_addresses - 2, 0)})")
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"prefix must match [a-z]{{1,8}}, got {prefix!r}")
        self.base = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self._network = network
        self._names = list(host_names)
        self._hosts: dict[str, Host] = {}
        self._delay_lines: dict[str, tuple[subprocess.Popen[str], list[str]]] = {}
        self._procs: list[subprocess.Popen[str]] = []
        self._created: list[str] = []  # namespaces, in creation order
        self._caller_link: str | None = None  # join_caller's end in the caller's namespace
        self._old_handlers: dict[int, Any] = {}
        self._closing = self._closed = False
        self._pending_signal: int | None = None

    @property
    def switch_netns(self) -> str:
        return f"{self.base}-{_SWITCH}"

    @property
    def hosts(self) -> Mapping[str, Host]:
        return dict(self._hosts)

    def __getitem__(self, name: str) -> Host:
        if name not in self._hosts:
            raise KeyError(f"no host {name!r} in this lab; hosts: {list(self._hosts)}")
        return self._hosts[name]

    def namespaces(self) -> list[str]:
        """All namespaces this lab created and has not deleted yet."""
        return list(self._created)

    # ------------------------------------------------------------------ build
    def __enter__(self) -> NetnsLab:
        if self._closed or self._created:
            raise NetnsError(f"lab {self.base} cannot be entered twice")
        check_netns_support()
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException as exc:
            self.close()
            raise NetnsError(f"building lab {self.base} failed: {exc}") from exc
        return self

    def _add_namespace(self, netns: str) -> None:
        _run(["ip", "netns", "add", netns])
        self._created.append(netns)
        _run(["ip", "-n", netns, "link", "set", "lo", "up"])
        if os.path.isdir("/proc/sys/net/ipv6") and shutil.which("sysctl"):
            _run(["ip", "netns", "exec", netns, "sysctl", "-q", "-w",
                  "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])

    def _build(self) -> None:
        switch = self.switch_netns
        self._add_namespace(switch)
        _run(["ip", "-n", switch, "link", "add", _BRIDGE, "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", _BRIDGE, "up"])
        for index, name in enumerate(self._names):
            netns, port = f"{self.base}-{name}", f"p-{name}"
            self._add_namespace(netns)
            _run(["ip", "link", "add", HOST_IFNAME, "netns", netns, "type", "veth",
                  "peer", "name", port, "netns", switch])
            _run(["ip", "-n", switch, "link", "set", port, "master", _BRIDGE, "up"])
            ip = str(self._network.network_address + index + 1)
            _run(["ip", "-n", netns, "addr", "add", f"{ip}/{self._network.prefixlen}",
                  "dev", HOST_IFNAME])
            _run(["ip", "-n", netns, "link", "set", HOST_IFNAME, "up"])
            self._hosts[name] = Host(name, netns, ip, self._procs)

    def join_caller(self) -> str:
        """Plug the caller's own network namespace into the switch; its address there.

        The caller gets ``<prefix>-<token>`` (its peer ``u-caller`` sits on the switch)
        with the subnet's last host address, and so a route to the hosts. The link goes
        when the switch namespace is deleted (``close``; ``cleanup_stale`` after a
        SIGKILL), as a veth pair goes with either end. The hosts still have no default
        route: they reach the caller's address, nothing beyond it.

        Raises:
            NetnsError: the lab is not built, was joined already, has no address left,
                or the caller already routes part of the subnet (another joined lab, or
                a real network): its traffic would go one way or the other.
        """
        if not self._hosts or self._caller_link is not None:
            raise NetnsError(f"lab {self.base}: join_caller needs a built lab, once")
        if self._network.num_addresses - 2 <= len(self._hosts):
            raise NetnsError(f"subnet {self._network} has no address left for the caller")
        for route in json.loads(_run(["ip", "-4", "-j", "route", "show"]) or "[]"):
            dst = route.get("dst", "default")
            if dst != "default" and ipaddress.ip_network(dst, strict=False).overlaps(
                    self._network):
                raise NetnsError(f"this namespace already routes {dst} (dev "
                                 f"{route.get('dev')}), which overlaps the lab's "
                                 f"{self._network}: another joined lab still running?")
        link = f"{self.base.split('-')[0]}-{self.base.rsplit('-', 1)[1]}"
        ip = str(self._network.broadcast_address - 1)
        _run(["ip", "link", "add", link, "type", "veth", "peer", "name", "u-caller",
              "netns", self.switch_netns])
        self._caller_link = link
        try:
            if os.path.isdir("/proc/sys/net/ipv6") and shutil.which("sysctl"):  # quiet wire
                _run(["sysctl", "-q", "-w", f"net.ipv6.conf.{link}.disable_ipv6=1"])
            _run(["ip", "-n", self.switch_netns, "link", "set", "u-caller", "master", _BRIDGE,
                  "up"])
            _run(["ip", "addr", "add", f"{ip}/{self._network.prefixlen}", "dev", link])
            _run(["ip", "link", "set", link, "up"])
        except BaseException:
            _run(["ip", "link", "del", link], check=False)
            self._caller_link = None
            raise
        return ip

    # ------------------------------------------------------------------ faults
    def _host(self, host: Host | str) -> Host:
        return self[host if isinstance(host, str) else host.name]

    def link_down(self, host: Host | str) -> None:
        """Cut ``host``'s cable at the switch: its packets are dropped, its sockets stay open."""
        _run(["ip", "-n", self.switch_netns, "link", "set", f"p-{self._host(host).name}", "down"])

    def link_up(self, host: Host | str) -> None:
        """Reconnect a cable cut by :meth:`link_down`."""
        _run(["ip", "-n", self.switch_netns, "link", "set", f"p-{self._host(host).name}", "up"])

    def netem(
        self, host: Host | str, *, delay_ms: float = 0.0, jitter_ms: float = 0.0,
        loss_pct: float = 0.0,
    ) -> str:
        """Delay and/or drop packets leaving ``host``'s eth0 (replaces any earlier setting).

        ``tc netem`` where the kernel has ``sch_netem``; otherwise the same in user
        space (``nfqueue_link.py``: an iptables NFQUEUE rule and a delay line
        running in the host). One way only: a round trip with ``host`` gains
        ``delay_ms`` once; shape both ends for a symmetric link.

        Returns:
            ``"tc"`` or ``"nfqueue"``: which one shapes the link.

        Raises:
            ValueError: negative delay/jitter, loss outside [0, 100], or jitter without delay.
            NetemUnavailableError: neither sch_netem nor iptables with NFQUEUE is usable.
        """
        target = self._host(host)
        bad_jitter = jitter_ms < 0 or (jitter_ms > 0 and delay_ms == 0)
        if delay_ms < 0 or bad_jitter or not 0 <= loss_pct <= 100:
            raise ValueError(f"netem needs delay_ms >= 0, jitter_ms >= 0 (only with a delay), "
                             f"0 <= loss_pct <= 100; got delay_ms={delay_ms}, "
                             f"jitter_ms={jitter_ms}, loss_pct={loss_pct}")
        if shutil.which("tc") is None:
            raise NetemUnavailableError("`tc` not found on PATH: install iproute2")
        self.clear_netem(target)
        cmd = ["tc", "-n", target.netns, "qdisc", "replace", "dev", HOST_IFNAME, "root", "netem",
               "delay", f"{delay_ms}ms", *([f"{jitter_ms}ms"] if jitter_ms else []),
               "loss", f"{loss_pct}%"]
        try:
            _run(cmd)
            return "tc"
        except NetnsCommandError as exc:
            if "unknown" not in exc.stderr.lower():
                raise
            no_qdisc = (f"kernel {platform.release()} has no sch_netem qdisc (CONFIG_NET_SCH_NETEM "
                        f"off or module not loadable); tc said: {exc.stderr.strip()}")
        self._nfqueue_netem(target, delay_ms, jitter_ms, loss_pct, no_qdisc)
        return "nfqueue"

    def _nfqueue_netem(
        self, target: Host, delay_ms: float, jitter_ms: float, loss_pct: float, why: str
    ) -> None:
        iptables = shutil.which("iptables-legacy") or shutil.which("iptables")
        if iptables is None:
            raise NetemUnavailableError(f"{why}; and no iptables for the NFQUEUE fallback "
                                        f"(apt-get install iptables)")
        queue = _NFQUEUE_BASE + list(self._hosts).index(target.name)
        line = target.popen([sys.executable, str(_NFQUEUE_SCRIPT), "--queue", str(queue),
                             "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms),
                             "--loss-pct", str(loss_pct), "--seed", str(queue)])
        try:
            wait_for_line(line, "READY", timeout_s=15)
        except (TimeoutError, RuntimeError) as exc:
            line.kill()
            raise NetemUnavailableError(f"{why}; and the NFQUEUE delay line did not start: "
                                        f"{exc}") from exc
        rule = ["-o", HOST_IFNAME, "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]
        try:
            _run(target.command([iptables, "-A", "OUTPUT", *rule]))
        except NetnsCommandError as exc:
            line.kill()
            raise NetemUnavailableError(f"{why}; and iptables refused the NFQUEUE rule: "
                                        f"{exc.stderr.strip()}") from exc
        self._delay_lines[target.name] = (line, [iptables, "-D", "OUTPUT", *rule])

    def clear_netem(self, host: Host | str) -> None:
        """Remove what :meth:`netem` set on ``host`` (no-op if nothing)."""
        target = self._host(host)
        _run(["tc", "-n", target.netns, "qdisc", "del", "dev", HOST_IFNAME, "root"], check=False)
        held = self._delay_lines.pop(target.name, None)
        if held is not None:
            line, delete_rule = held
            _run(target.command(delete_rule), check=False)
            line.terminate()  # lets the packets it holds go
            with contextlib.suppress(subprocess.TimeoutExpired):
                line.wait(timeout=5)

    # --------------------------------------------------------------- teardown
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; atexit still covers us
        for signum in (signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(signum)
            if old is signal.SIG_DFL or isinstance(getattr(old, "__self__", None), NetnsLab):
                self._old_handlers[signum] = old
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Unwind (through __exit__ / finally) to tear down, then close() re-raises the
        # signal under the previous handler, so the process still dies of it.
        self._pending_signal = signum
        if self._closing and not self._closed:
            return  # cleanup is under way in this very thread: let it finish
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """Kill every process in the lab and delete its namespaces. Idempotent.

        Raises:
            NetnsError: something could not be removed (the rest was still attempted).
        """
        if self._closing or self._closed:
            return
        self._closing = True
        errors: list[str] = []
        try:
            for proc in self._procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # its session: children too
            if self._caller_link is not None:  # would go with the switch; sooner is tidier
                _run(["ip", "link", "del", self._caller_link], check=False)
                self._caller_link = None
            for netns in reversed(self._created):
                try:
                    _destroy_namespace(netns)
                    self._created.remove(netns)
                except (NetnsError, subprocess.SubprocessError) as exc:
                    errors.append(f"{netns}: {exc}")
            for proc in self._procs:
                proc.wait(timeout=10)
                for stream in (proc.stdout, proc.stderr, proc.stdin):
                    if stream is not None:
                        stream.close()
        finally:
            self._closed = True
            atexit.unregister(self.close)
            for signum, old in self._old_handlers.items():
                if signal.getsignal(signum) == self._on_signal:
                    signal.signal(signum, old)
            if self._pending_signal is not None:
                os.kill(os.getpid(), self._pending_signal)
        if errors:
            raise NetnsError(f"lab {self.base} teardown left: {'; '.join(errors)}")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``up NAME...``: build a lab, print its hosts, hold it until Ctrl-C; ``cleanup``."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="build a lab and hold it until Ctrl-C / SIGTERM")
    up.add_argument("names", nargs="+")
    up.add_argument("--subnet", default=DEFAULT_SUBNET)
    sub.add_parser("cleanup", help="delete namespaces left by dead runs")
    args = parser.parse_args(argv)
    if args.action == "cleanup":
        print("\n".join(cleanup_stale()) or "nothing stale")
        return 0
    with NetnsLab(args.names, subnet=args.subnet) as lab:
        for host in lab.hosts.values():
            print(f"{host.name:12} {host.ip:15} ip netns exec {host.netns} ...", flush=True)
        print("lab up; Ctrl-C tears it down", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
