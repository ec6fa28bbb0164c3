"""Processes of ``kvbridge demo``: free ports, starting children, their ready lines, stopping.

``run.py`` starts ``kvbridge serve`` (P, D) and ``kvbridge proxy`` as
:class:`ChildProcess` es, each the leader of its own process group (its TP
workers and their helpers join that group), waits with :func:`wait_ready` and
always ends with :func:`stop_children`. Children run in their own sessions, so
a Ctrl-C in the terminal reaches only the demo, which then stops them in order.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence

from kvbridge.errors import KVBridgeError

__all__ = ["PORT_SPAN_ENV", "READY_TIMEOUT_S", "STOP_TIMEOUT_S", "ChildProcess", "DemoError",
           "port_span", "reserve_ports", "stop_children", "wait_ready"]

#: Longest wait for a child's ready line (three engines starting on two cores).
READY_TIMEOUT_S = 180.0
#: Grace period between SIGTERM and SIGKILL.
STOP_TIMEOUT_S = 20.0
_NUM_TAIL_LINES = 40
_READY = re.compile(r"kvbridge (?:serve|proxy) ready on (http://\S+)$")


class DemoError(KVBridgeError):
    """The deployment could not be started or driven (the message says why)."""


def reserve_ports(run_lengths: Sequence[int], seed: int | None = None) -> list[int]:
    """Base ports of disjoint runs of consecutive free TCP ports, one run per length.

    The ports lie below the kernel's ephemeral range, where binds to port 0 (the
    TP rendezvous, UCX, other programs) never land: a port found free here
    stays free until the child that was given it binds it.

    Raises:
        DemoError: no free runs found after many tries.
    """
    first, last = port_span()
    rng = random.Random(seed)
    taken: set[int] = set()
    bases: list[int] = []
    for length in run_lengths:
        for _ in range(200):
            base = rng.randrange(first, last - length)
            run = range(base, base + length)
            if not taken.intersection(run) and all(map(_port_free, run)):
                taken.update(run)
                bases.append(base)
                break
        else:
            raise DemoError(f"no run of {length} free ports found in [{first}, {last})")
    return bases


#: "FIRST-LAST": where ``reserve_ports`` looks (e.g. two test runs side by side, each in
#: its own span, or a span no other service of the host uses).
PORT_SPAN_ENV = "KVBRIDGE_PORT_SPAN"


def port_span() -> tuple[int, int]:
    """``[first, last)`` of the ports ``reserve_ports`` hands out: ``$KVBRIDGE_PORT_SPAN``
    if set, else from 20000 to the kernel's ephemeral range (20000-30000 if that
    starts too low).

    Raises:
        DemoError: ``$KVBRIDGE_PORT_SPAN`` is not "FIRST-LAST" with
            1024 <= FIRST < LAST - 100 <= 65435.
    """
    text = os.environ.get(PORT_SPAN_ENV)
    if not text:
        low = _ephemeral_low()
        return (20000, low) if low - 20000 >= 2000 else (20000, 30000)
    first_text, _, last_text = text.partition("-")
    try:
        first, last = int(first_text), int(last_text)
    except ValueError:
        first, last = 0, 0
    if not 1024 <= first < last - 100 <= 65535 - 100:
        raise DemoError(f"{PORT_SPAN_ENV}={text!r}: want FIRST-LAST, two ports with "
                        f"1024 <= FIRST and at least 100 ports between them")
    return first, last


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))  # stricter than loopback: any address in use fails
        except OSError:
            return False
    return True


class ChildProcess:
    """A started ``kvbridge serve`` or ``proxy``, leader of its own process group.

    Its output (stdout and stderr) is read by a thread; the last lines are kept
    for error messages.

    Args:
        name: Short name for messages (``P``, ``D``, ``proxy``).
        argv: ``kvbridge`` arguments (``serve ...`` or ``proxy ...``).
    """

    def __init__(self, name: str, argv: Sequence[str]) -> None:
        self.name = name
        self.argv = list(argv)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")  # several engines share few cores
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.cli", *argv], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=env, start_new_session=True)
        self.started_at = time.monotonic()
        #: Base URL from the ready line, and seconds from start to it (set by the reader).
        self.url: str | None = None
        self.ready_after_s: float | None = None
        self._tail: deque[str] = deque(maxlen=_NUM_TAIL_LINES)
        self._reader = threading.Thread(target=self._read, name=f"demo-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Keep the last lines and catch the ready line, until the pipe closes (the
        group's last member exits: TP workers inherit it)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._tail.append(line.rstrip("\n"))
            match = _READY.match(line.strip()) if self.url is None else None
            if match:
                self.ready_after_s = time.monotonic() - self.started_at
                self.url = match.group(1)  # last: a reader seeing the URL sees the time too

    @property
    def command(self) -> str:
        """The command as a user would type it."""
        return " ".join(["kvbridge", *self.argv])

    def tail(self) -> str:
        """The last output lines, indented."""
        return "\n".join(f"    {line}" for line in self._tail) or "    (no output)"

    def poll_ready(self) -> bool:
        """Whether the ready line has arrived.

        Raises:
            DemoError: the process exited before printing it.
        """
        if self.url is None and self.proc.poll() is not None:
            self._reader.join(timeout=2.0)  # the last words, once the pipe closes
            if self.url is None:
                raise DemoError(f"{self.name} exited with code {self.proc.returncode} before "
                                f"it was ready; its last output:\n{self.tail()}")
        return self.url is not None

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to every process of the group (none left: no-op).

        The group id is the leader's pid; the kernel does not hand that pid to
        a new process while any member of the group lives, even after the
        leader was reaped, so this never hits a stranger.
        """
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)


def wait_ready(children: Sequence[ChildProcess], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait for every child's ready line, printing each as it comes.

    Raises:
        DemoError: a child died first, or was not ready ``timeout_s`` after it
            started (its last output included).
    """
    pending = list(children)
    while pending:
        for child in [c for c in pending if c.poll_ready()]:
            print(f"{child.name} ready on {child.url}, {child.ready_after_s:.1f} s after its "
                  f"start", flush=True)
            pending.remove(child)
        late = [c for c in pending if time.monotonic() - c.started_at > timeout_s]
        if late:
            raise DemoError(f"{late[0].name} not ready after {timeout_s:.0f} s; its last "
                            f"output:\n{late[0].tail()}")
        time.sleep(0.05)


def stop_children(children: Sequence[ChildProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop every child's process group: SIGTERM, then SIGKILL after ``timeout_s``.

    Returns once every leader is reaped and every group is empty (or after a
    further few seconds, with a warning). Safe to call twice.
    """
    for child in children:
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{child.name} did not stop within {timeout_s:.0f} s: killing it; its last "
                  f"output:\n{child.tail()}", file=sys.stderr, flush=True)
        child.signal_group(signal.SIGKILL)  # also any worker outliving its server
        child.proc.wait()
    for child in children:
        if not _group_gone(child.proc.pid, timeout_s=5.0):
            print(f"warning: processes of {child.name}'s group {child.proc.pid} survive",
                  file=sys.stderr, flush=True)


def _group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.05)
    return False


