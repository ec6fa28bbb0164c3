"""kvbridge's side of the transfer benchmark: a serving and a reading agent process.

Used by ``kvbridge/bench/transfer_bench.py``. :class:`AgentPair` starts two
processes (``python -m kvbridge.bench.transfer_agents serve|read``), each with one
``TransferAgent`` over ``num_layers`` bf16 caches of ``[2, num_pool_blocks, 16,
8, 128]`` (NHD), where its ``Placement`` says: both on loopback, or the server
in one network namespace and the reader in another (``kvbridge/bench/peers/
placement.py``), both started at once (the reader learns the server's address
with each read), with the ``AgentConfig`` options the pair is given. The parent
drives them through a socket pair each (a child gets its end as an inherited
descriptor, which ``ip netns exec`` passes on), one request at a time::

    parent --grant(ids)--> server             issue_grant, reply with the token
    parent --read(ids, token, addr)--> reader start_read ... get_finished, reply seconds
    parent --verify(ids)--> reader            count wrong blocks, reply the count
    parent --where--> server                  its pid and cache addresses (``kvbridge_copy``)
    parent --copy(ids, where)--> reader       bare process_vm_readv of the blocks, reply seconds
    parent --restart(options, env)--> both    a new agent on the same caches, reply as at start

The server's caches hold a pattern: 8-byte word ``w`` of half ``h`` (K or V) of
block ``b`` in layer ``l`` is ``((l << 48) | (h << 47) | (b << 20) | w) * MIX + 1``
(mod 2**64; MIX is odd, so the map is one-to-one). The reader recomputes it for
the blocks it read, so a misplaced, torn or stray block is caught.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.bench.peers.child_env import package_path
from kvbridge.bench.peers.placement import LOOPBACK, Placement, Side
from kvbridge.bench.peers.results import PeerResult, summarize

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
_HALF_WORDS = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2 // 8  # one layer's K (or V) of a block
_MIX = np.uint64(0x9E3779B97F4A7C15)
_NUM_WARMUP = 2  # the first read also handshakes
_WAIT_S = 1.0
_SEED = 7


class AgentPairError(RuntimeError):
    """A benchmark agent process failed, timed out or reported a failed read."""


def pattern(layer: int, block_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """The server's content of ``block_ids`` in ``layer`` as ``[2, n, words]`` uint64."""
    half = np.arange(2, dtype=np.uint64)[:, None, None] << np.uint64(47)
    blocks = block_ids.astype(np.uint64)[None, :, None] << np.uint64(20)
    words = np.arange(_HALF_WORDS, dtype=np.uint64)[None, None, :]
    key = (np.uint64(layer) << np.uint64(48)) | half | blocks | words
    return key * _MIX + np.uint64(1)


class _ChildAgent:
    """A child's caches and the ``TransferAgent`` over them, which ``restart`` replaces
    (other options, other environment) on the same caches and their content."""

    def __init__(self, engine_id: str, num_layers: int, num_pool_blocks: int,
                 local_copy: bool, device: str, options: dict[str, Any] | None) -> None:
        import torch

        from kvbridge.transfer.host_memory import kv_cache_zeros

        shape = (2, num_pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        # as the reference engine allocates its caches (huge pages where the OS has them)
        self.caches = [kv_cache_zeros(shape, torch.bfloat16, device) for _ in range(num_layers)]
        self._engine_id, self._local_copy = engine_id, local_copy
        self.agent = self._new(options or {})
        self._first_env = dict(os.environ)  # with what importing ucxx added

    def _new(self, options: dict[str, Any]) -> Any:
        from kvbridge.topology import EngineTopology, KVLayout
        from kvbridge.transfer.agent import TransferAgent
        from kvbridge.transfer.agent_config import AgentConfig
        from kvbridge.transfer.protocol.security import CompatInfo

        num_layers = len(self.caches)
        topo = EngineTopology(1, 1, BLOCK_SIZE, NUM_KV_HEADS, False, KVLayout.NHD, num_layers)
        compat = CompatInfo("bench", "bfloat16", NUM_KV_HEADS, HEAD_DIM, num_layers,
                            KVLayout.NHD, BLOCK_SIZE, False)
        config = AgentConfig.from_options(
            {"local_copy": self._local_copy, "listen_host": "0.0.0.0", **options})
        agent = TransferAgent(self._engine_id, topo, 0, 0, compat, config=config)
        agent.register_kv_caches(self.caches)
        return agent

    def restart(self, options: dict[str, Any], env: dict[str, str]) -> Any:
        """Close the agent; start one with ``options`` in the environment this process
        had at its first agent plus ``env`` (UCX reads it when the new agent's context is
        made). Returns what the new agent's ``start`` returns (a server: its port)."""
        self.agent.close()
        os.environ.clear()
        os.environ.update({**self._first_env, **env})
        self.agent = self._new(options)
        return self.agent.start()


def _words(cache: Any) -> npt.NDArray[np.uint64]:
    """``[2, num_blocks, words]`` uint64 view of one layer's cache (shares memory on
    the host; a copy of a device cache)."""
    import torch

    array: npt.NDArray[np.uint64] = cache.view(torch.int64).cpu().numpy().view(np.uint64)
    return array.reshape(2, cache.shape[1], -1)


def _fill(cache: Any, layer: int) -> None:
    """Write the pattern into every block of one layer's cache (host or device)."""
    import torch

    words = pattern(layer, np.arange(cache.shape[1], dtype=np.int64)).view(np.int64)
    cache.view(torch.int64).view(2, cache.shape[1], -1).copy_(torch.from_numpy(words))


def _serve_main(conn: Connection, num_layers: int, num_pool_blocks: int,
                local_copy: bool, device: str = "cpu",
                options: dict[str, Any] | None = None) -> None:
    child = _ChildAgent("bench-p", num_layers, num_pool_blocks, local_copy, device, options)
    for layer, cache in enumerate(child.caches):
        _fill(cache, layer)
    conn.send(child.agent.start())
    try:
        while (msg := conn.recv())[0] != "close":
            match msg:
                case ("grant", request_id, block_ids):
                    child.agent.get_finished()  # releases of earlier grants
                    conn.send(child.agent.issue_grant(request_id, block_ids, 1,
                                                      lease_s=120.0).grant)
                case ("where",):  # for the copy yardstick (``CopyYardstick``)
                    conn.send((os.getpid(), [cache.data_ptr() for cache in child.caches]))
                case ("restart", new_options, env):
                    conn.send(child.restart(new_options, env))
    finally:
        child.agent.close()
        conn.send("closed")


def _read_main(conn: Connection, num_layers: int, num_pool_blocks: int, local_copy: bool,
               device: str = "cpu", options: dict[str, Any] | None = None) -> None:
    child = _ChildAgent("bench-d", num_layers, num_pool_blocks, local_copy, device, options)
    caches = child.caches
    child.agent.start()
    copies = CopyYardstick(caches) if device == "cpu" else None
    conn.send("ready")
    try:
        while (msg := conn.recv())[0] != "close":
            match msg:
                case ("read", request_id, remote_ids, local_ids, token, host, port):
                    conn.send(_timed_read(child.agent, host, port, request_id, remote_ids,
                                          local_ids, token))
                case ("copy", remote_ids, local_ids, pid, bases):
                    conn.send("the copy yardstick reads host caches only" if copies is None
                              else copies.timed(remote_ids, local_ids, pid, bases))
                case ("zero",):
                    for cache in caches:
                        cache.zero_()
                    conn.send(0)
                case ("verify", remote_ids, local_ids):
                    conn.send(_num_wrong(caches, np.array(remote_ids), np.array(local_ids)))
                case ("restart", new_options, env):
                    child.restart(new_options, env)
                    conn.send("ready")
    finally:
        child.agent.close()
        conn.send("closed")


def _timed_read(agent: Any, host: str, port: int, request_id: str, remote_ids: list[int],
                local_ids: list[int], token: str) -> tuple[float, int] | str:
    """Seconds from ``start_read`` to the outcome and the read's message count, or the
    error text of a failed read."""
    started = time.perf_counter()
    agent.start_read(request_id, engine_id="bench-p", host=host, port=port,
                     remote_block_ids=remote_ids, local_block_ids=local_ids, grant=token,
                     num_tokens=len(remote_ids) * BLOCK_SIZE)
    while request_id not in agent.get_finished()[1]:
        agent.wait_finished(_WAIT_S)  # sleeps: polling would take the GIL from the agent
    elapsed = time.perf_counter() - started
    if agent.get_failed_block_ids():
        errors = [s.error for s in agent.get_stats() if not s.ok]
        return f"read {request_id} failed: {errors}"
    num_messages = sum(s.num_messages for s in agent.get_stats())
    return elapsed, num_messages


class CopyYardstick:
    """The kernel's part of a same-host read, alone: the ``kvbridge_copy`` pseudo-peer.

    The same blocks (every layer's K and V run of each, 32 KiB apiece, scattered
    ids) copied out of the server process by bare ``process_vm_readv`` calls
    (at most ``IOV_MAX`` rows each), with no grant, board, check or outcome
    around them, on one thread: what a same-host read would cost with no Python. Its
    ratio says how much of the kernel's speed a kvbridge read delivers; NIXL's
    UCX (``cma``) makes the same calls. The rows are built before the clock starts.
    """

    IOV_MAX = 1024

    def __init__(self, caches: list[Any]) -> None:
        self._caches = caches
        self._rows: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        libc = ctypes.CDLL(None, use_errno=True)
        self._readv = libc.process_vm_readv
        self._readv.restype = ctypes.c_ssize_t
        self._readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]

    def _ranges(self, bases: list[int], ids: list[int]) -> npt.NDArray[np.uint64]:
        """``struct iovec`` rows of ``ids`` in caches at ``bases``: layer, half, block order."""
        plane = self._caches[0][0].nbytes // self._caches[0].shape[1]  # one block's K run
        half = self._caches[0][0].nbytes
        starts = (np.array(bases, dtype=np.uint64)[:, None, None]
                  + np.array([0, half], dtype=np.uint64)[None, :, None]
                  + np.array(ids, dtype=np.uint64)[None, None, :] * np.uint64(plane))
        rows = np.empty((starts.size, 2), dtype=np.uint64)
        rows[:, 0] = starts.reshape(-1)
        rows[:, 1] = plane
        return rows

    def timed(self, remote_ids: list[int], local_ids: list[int], pid: int,
              bases: list[int]) -> float | str:
        """Seconds of one copy of the blocks, or the error text of a failed one."""
        key = (tuple(remote_ids), tuple(local_ids), pid, tuple(bases))
        if key not in self._rows:
            local = self._ranges([cache.data_ptr() for cache in self._caches], local_ids)
            self._rows[key] = (local, self._ranges(bases, remote_ids))
        local, remote = self._rows[key]
        calls = []
        for start in range(0, len(local), self.IOV_MAX):
            lo, re = local[start:start + self.IOV_MAX], remote[start:start + self.IOV_MAX]
            calls.append((lo.ctypes.data, len(lo), re.ctypes.data, len(re), int(lo[:, 1].sum())))
        readv = self._readv
        started = time.perf_counter()
        for lo_rows, num_lo, re_rows, num_re, want in calls:
            if readv(pid, lo_rows, num_lo, re_rows, num_re, 0) != want:
                return f"process_vm_readv: {os.strerror(ctypes.get_errno())} (or a short copy)"
        return time.perf_counter() - started


def _num_wrong(caches: list[Any], remote_ids: npt.NDArray[np.int64],
               local_ids: npt.NDArray[np.int64]) -> int:
    """Blocks whose content is wrong in any layer: named ones vs the pattern, others vs 0."""
    wrong = np.zeros(caches[0].shape[1], dtype=bool)
    untouched = np.ones_like(wrong)
    untouched[local_ids] = False
    for layer, cache in enumerate(caches):
        words = _words(cache)
        got = words[:, local_ids]
        wrong[local_ids] |= (got != pattern(layer, remote_ids)).any(axis=(0, 2))
        wrong[untouched] |= words[:, untouched].any(axis=(0, 2))
    return int(wrong.sum())


class AgentPair:
    """A serving and a reading agent process; a context manager that stops both.

    Args:
        num_layers: Layers of both caches.
        num_pool_blocks: Blocks of each cache (requests pick scattered ids in it).
        timeout_s: Deadline of every reply from a child.
        local_copy: let the reader copy out of the server's process (both are on
            this host: ``kvbridge.transfer.reading.same_host``); False reads through UCX.
            Off for both agents wherever ``placement`` puts them on two hosts.
        name: the name of the results.
        placement: Where the server and the reader run, and their extra environment.
        device: where both agents' caches live: ``cpu``, or ``cuda`` (reads then go
            through UCX's CUDA transports; no same-host copies, no copy yardstick).
        agent_options: ``AgentConfig`` fields both agents get on top of the
            benchmark's own (``AgentConfig.from_options``; JSON values).

    Raises:
        AgentPairError: a child did not start within ``timeout_s``.
    """

    def __init__(self, num_layers: int, num_pool_blocks: int, timeout_s: float,
                 local_copy: bool = True, name: str = "kvbridge",
                 placement: Placement = LOOPBACK, device: str = "cpu",
                 agent_options: Mapping[str, Any] = MappingProxyType({})) -> None:
        self.num_layers, self.num_pool_blocks, self.timeout_s = (
            num_layers, num_pool_blocks, timeout_s)
        self.name = name
        path = package_path().get("PYTHONPATH")
        self._env = {**os.environ, **placement.env,
                     "PYTHONPATH": os.pathsep.join(
                         p for p in (path, os.environ.get("PYTHONPATH")) if p)}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []  # reader last, so close() stops it first
        self._num_requests = 0
        same_host = placement.same_host
        options = dict(agent_options)
        self._host = placement.serve.ip
        try:  # both at once: each spends seconds importing torch and starting UCX
            self._server = self._spawn(placement.serve, "serve", num_layers, num_pool_blocks,
                                       same_host, device, options)
            self._reader = self._spawn(placement.read, "read", num_layers, num_pool_blocks,
                                       local_copy and same_host, device, options)
            self._port: int = self._recv(self._server)
            self._recv(self._reader)
        except BaseException:
            self.close()
            raise

    def _spawn(self, side: Side, role: str, *args: Any) -> Connection:
        """Start ``role`` on ``side``; the connection to it (its end of a socket pair)."""
        parent, child = mp.Pipe()
        with child:  # the process holds its own copy
            fd = child.fileno()
            try:
                self._procs.append(subprocess.Popen(
                    side.command([sys.executable, "-m", "kvbridge.bench.transfer_agents", role,
                                  str(fd), json.dumps(args)]),
                    env=self._env, pass_fds=(fd,)))
            except BaseException:
                parent.close()
                raise
        self._conns.append(parent)
        return parent

    def _recv(self, conn: Connection) -> Any:
        if not conn.poll(self.timeout_s):
            raise AgentPairError(f"no reply from a benchmark agent in {self.timeout_s:.0f} s "
                                 f"(exit codes: {[p.poll() for p in self._procs]})")
        try:
            return conn.recv()
        except EOFError:
            raise AgentPairError("a benchmark agent process exited early") from None

    def _call(self, conn: Connection, *msg: Any) -> Any:
        conn.send(msg)
        return self._recv(conn)

    def restart(self, agent_options: Mapping[str, Any],
                env: Mapping[str, str] = MappingProxyType({})) -> None:
        """New agents in both processes, on the same caches and content: with
        ``agent_options`` (instead of the pair's) and ``env`` over the environment each
        child had when its first agent started (what ``import ucxx`` added included).

        Raises:
            AgentPairError: a child did not answer within ``timeout_s``.
        """
        for conn in self._conns:
            conn.send(("restart", dict(agent_options), dict(env)))
        self._port = self._recv(self._server)
        self._recv(self._reader)

    def read_once(self, remote_ids: list[int], local_ids: list[int]) -> tuple[float, int]:
        """One granted read; its duration in seconds and the messages it took.

        Raises:
            AgentPairError: the read failed or a child stopped answering.
        """
        self._num_requests += 1
        request_id = f"bench-{self._num_requests}"
        token = self._call(self._server, "grant", request_id, remote_ids)
        outcome = self._call(self._reader, "read", request_id, remote_ids, local_ids, token,
                             self._host, self._port)
        if isinstance(outcome, str):
            raise AgentPairError(outcome)
        seconds, num_messages = outcome
        return float(seconds), int(num_messages)

    def measure(self, num_blocks: int, num_iters: int, nbytes: int,
                before_timed: Callable[[], object] | None = None) -> PeerResult:
        """Warm up, time ``num_iters`` reads of ``num_blocks`` scattered blocks, verify.

        Args:
            before_timed: called once warm-up is over, before the first timed read.

        Returns:
            The statistics, named ``self.name``; ``num_blocks`` counts 64 KiB pieces
            (blocks x layers) like the peers' results.

        Raises:
            AgentPairError: a read failed or a child stopped answering.
        """
        remote_ids, local_ids = self._block_ids(num_blocks)
        for _ in range(_NUM_WARMUP):
            self.read_once(remote_ids, local_ids)
        self._call(self._reader, "zero")
        if before_timed is not None:
            before_timed()
        timed = [self.read_once(remote_ids, local_ids) for _ in range(num_iters)]
        num_wrong = self._call(self._reader, "verify", remote_ids, local_ids)
        durations_s = [seconds for seconds, _ in timed]
        note = (f"{self.num_layers} layers x {num_blocks} blocks, "
                f"{max(n for _, n in timed)} messages per read")
        if num_wrong:
            note += f"; {num_wrong} of {num_blocks} blocks wrong"
        return summarize(self.name, nbytes, num_blocks * self.num_layers, durations_s,
                         num_wrong == 0, note)

    def measure_copy(self, num_blocks: int, num_iters: int, nbytes: int) -> PeerResult:
        """As ``measure``, for the bare copies of ``CopyYardstick`` (both on one host).

        Raises:
            AgentPairError: a copy failed or a child stopped answering.
        """
        remote_ids, local_ids = self._block_ids(num_blocks)
        pid, bases = self._call(self._server, "where")
        for _ in range(_NUM_WARMUP):
            self._call(self._reader, "copy", remote_ids, local_ids, pid, bases)
        self._call(self._reader, "zero")
        durations_s = []
        for _ in range(num_iters):
            outcome = self._call(self._reader, "copy", remote_ids, local_ids, pid, bases)
            if isinstance(outcome, str):
                raise AgentPairError(outcome)
            durations_s.append(float(outcome))
        num_wrong = self._call(self._reader, "verify", remote_ids, local_ids)
        note = f"{self.num_layers} layers x {num_blocks} blocks, bare process_vm_readv"
        if num_wrong:
            note += f"; {num_wrong} of {num_blocks} blocks wrong"
        return summarize(self.name, nbytes, num_blocks * self.num_layers, durations_s,
                         num_wrong == 0, note)

    def _block_ids(self, num_blocks: int) -> tuple[list[int], list[int]]:
        """The scattered remote and local block ids every system reads at this size."""
        rng = np.random.default_rng([_SEED, num_blocks])
        remote_ids = [int(b) for b in rng.choice(self.num_pool_blocks, num_blocks, False)]
        local_ids = [int(b) for b in rng.choice(self.num_pool_blocks, num_blocks, False)]
        return remote_ids, local_ids

    def close(self) -> None:
        """Ask both children to stop; kill any still alive after ``timeout_s``."""
        for conn in reversed(self._conns):
            with contextlib.suppress(OSError, EOFError, AgentPairError):
                conn.send(("close",))
                self._recv(conn)
        for proc in self._procs:
            try:
                proc.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()

    def kill(self) -> None:
        """Kill both children now, without asking (a pair that stopped answering).
        ``close`` after it does nothing more."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> AgentPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str]) -> None:
    """Child entry (:class:`AgentPair` starts it): ``serve|read <fd> <JSON list of the
    role's arguments>``, ``fd`` being the child's end of its socket pair."""
    match argv:
        case ["serve", fd, args]:
            _serve_main(Connection(int(fd)), *json.loads(args))
        case ["read", fd, args]:
            _read_main(Connection(int(fd)), *json.loads(args))
        case _:
            raise SystemExit(f"usage: python -m kvbridge.bench.transfer_agents serve|read FD ARGS; "
                             f"got {argv}")


if __name__ == "__main__":
    main(sys.argv[1:])
