"""Same-host copies: whether this process may make them, and who a server is on its host.

A reader on the server's host may copy the server's blocks itself
(``reading/same_host.py``). Who may copy from whom is settled on top of the
handshake: the server offers a ``wire.HostInfo`` (boot id, pid namespace, pid,
the address and value of a random probe, ``ProbeCell``); the reader compares
boot id and pid namespace with its own (``host_identity``), copies the probe
and compares before it trusts the pid, and again after every copy (the pid
could name another process by then; ``reading/copy_source.py``).

Off (reads go through UCX) when ``AgentConfig.local_copy`` is False, when
``KVBRIDGE_LOCAL_COPY=0``, when ``UCX_TLS`` leaves out UCX's shared-memory
transports (an operator who asked for TCP asked for the network: the netns
"hosts" of the tests are one host to the kernel), off Linux (``allowed``), and
for caches not in host memory (``host_memory``). The agent checks both before
it offers or makes a copy.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import sys
from pathlib import Path

import numpy as np
import torch

from kvbridge.transfer.protocol import wire
from kvbridge.transfer.protocol.grant_board import GrantBoard

__all__ = ["ENV_SWITCH", "ProbeCell", "allowed", "host_identity", "host_memory"]

logger = logging.getLogger(__name__)

ENV_SWITCH = "KVBRIDGE_LOCAL_COPY"
_PROBE_NBYTES = 16
_UCX_SHM_TRANSPORTS = frozenset({"all", "sm", "shm", "cma", "posix", "sysv"})


def allowed(enabled: bool) -> bool:
    """Whether this process may use same-host copies at all (config, environment, OS)."""
    if not enabled or sys.platform != "linux":
        return False
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}:
        return False
    tls = os.environ.get("UCX_TLS", "").strip()
    if not tls:
        return True
    names = {name.strip().lower() for name in tls.removeprefix("^").split(",")}
    if tls.startswith("^"):  # an exclusion list
        return not names & {"sm", "shm", "cma"}
    return bool(names & _UCX_SHM_TRANSPORTS)


def host_memory(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor lives in this process's host memory."""
    return all(t.device.type == "cpu" for t in tensors)


def host_identity() -> tuple[str, str]:
    """``(boot id, pid namespace)`` of this process: equal pairs share pids and a kernel.

    Raises:
        OSError: ``/proc`` does not say (not Linux, or masked).
    """
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    ns = os.stat("/proc/self/ns/pid")
    return boot_id, f"{ns.st_dev}:{ns.st_ino}"


def map_shared(pid: int, fd: int, nbytes: int, inode: int | None = None, *,
               populate: bool = False) -> mmap.mmap | None:
    """A read-only map of ``nbytes`` of the file process ``pid`` holds open as ``fd`` (a
    memfd), or None: not allowed, not that size, or (``inode``) not that file.

    ``populate``: every page mapped now (``MAP_POPULATE``) rather than at its first
    touch, for a small map read at random places (the grant board: without it
    each of a run of reads took a page fault on a page of its own).
    """
    try:
        file = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        logger.debug("fd %d of pid %d not mapped: %s", fd, pid, exc)
        return None
    try:
        stat = os.fstat(file)
        if stat.st_size != nbytes or (inode is not None and stat.st_ino != inode):
            return None
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(file, nbytes, flags=flags, prot=mmap.PROT_READ)
    except OSError as exc:
        logger.debug("fd %d of pid %d not mapped: %s", fd, pid, exc)
        return None
    finally:
        os.close(file)


class ProbeCell:
    """The server's proof of identity: random bytes at an address it advertises."""

    def __init__(self) -> None:
        self._cell = np.frombuffer(bytearray(secrets.token_bytes(_PROBE_NBYTES)), dtype=np.uint8)

    def host_info(self, board: GrantBoard | None = None) -> wire.HostInfo | None:
        """What the handshake offers, or None where this host cannot say who it is.

        ``board``: the server's grant board, offered with it.
        """
        try:
            boot_id, pid_namespace = host_identity()
        except OSError as exc:
            logger.info("no same-host copies: %s", exc)
            return None
        return wire.HostInfo(
            boot_id, pid_namespace, os.getpid(), self._cell.ctypes.data, self._cell.tobytes(),
            board_address=board.address if board is not None else 0,
            board_slots=board.num_slots if board is not None else 0,
            board_fd=board.fd if board is not None else -1,
        )
