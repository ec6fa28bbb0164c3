"""Hostile clients of a transfer agent's port, and an agent host that reports its tables.

Used by ``test_fuzz_agent.py`` and ``test_security.py``. The agent under attack
lives in a :class:`FaultHost` child process (``tests/transfer/agent_proc.py``'s
host plus a ``counters`` command, so tests can see the agent's session, read,
report, staging and UCX tables and its RSS). The attacks come from this process:

* :class:`CaseMaker` draws cases from a seeded ``random.Random``: raw bytes,
  truncated / oversized / corrupt frames, msgpack with wrong types or values out
  of range, valid messages in the wrong order, and schema-valid messages with
  hostile values (unknown, forged, expired or foreign grants, block ids outside
  the cache or the grant, impossible head/layer ranges, unsolicited data frames).
* :class:`FuzzClient` plays them over real UCX. An *opening* case replaces the
  ``Hello`` of a fresh connection. A *session* is a good handshake, many cases
  the agent must survive (checked by a ``Ping`` that must come back as ``Pong``)
  and one final case that must end the session.

Every reply is checked as it arrives: a ``DataHeader`` (the start of KV bytes
leaving the agent) is never acceptable, and a reject must name a read we sent.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import random
import secrets
import struct
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from kvbridge.transfer.agent import AgentCounters
from kvbridge.transfer.errors import (
    PeerClosedError,
    PeerTimeoutError,
    ProtocolError,
    TransferError,
)
from kvbridge.transfer.protocol import security, wire
from kvbridge.transfer.protocol.handshake import Identity, reader_handshake, recv_msg, send_msg
from kvbridge.transfer.protocol.wire import channel_of
from kvbridge.transfer.serving.grants import GRANT_LEN
from kvbridge.transfer.ucx.connection import UcxConnection
from kvbridge.transfer.ucx.worker import UcxWorker
from tests.integration.reads import issue, read, wait_read, wait_released
from tests.transfer.agent_proc import AgentRef, Host, Spec, logical, make_caches
from tests.waiting import wait_until

MAX_FRAME = 1 << 20  # AgentConfig.max_frame_nbytes default
CODEC = wire.MessageCodec()
_FRAME = struct.Struct("<II")
R = wire.RejectReason

#: Counters that must come back to their idle value once attackers are gone.
IDLE_FIELDS = (
    "num_sessions", "num_serving_reads", "num_read_tasks", "num_pending_reports",
    "num_staging_lent", "num_grants", "num_ucx_requests", "num_ucx_connections",
    "num_ucx_tasks",
)


# ---------------------------------------------------------------- agent host


def _child(conn: Any) -> None:
    import logging

    from kvbridge.transfer.agent import TransferAgent
    from kvbridge.transfer.agent_config import AgentConfig
    from kvbridge.transfer.clock import ManualClock

    logging.basicConfig(level=logging.ERROR)
    # kvbridge's own log lines are kept for the ``logs`` command (tests check that
    # refusals are logged) instead of flooding stderr.
    lines: collections.deque[str] = collections.deque(maxlen=5000)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(  # type: ignore[method-assign]
        f"{record.levelname} {record.name}: {record.getMessage()}")
    kvbridge_logger = logging.getLogger("kvbridge")
    kvbridge_logger.setLevel(logging.INFO)
    kvbridge_logger.addHandler(handler)
    kvbridge_logger.propagate = False
    agents: dict[str, tuple[TransferAgent, list[torch.Tensor]]] = {}
    clocks: dict[str, ManualClock] = {}  # of specs with manual_clock: moved by "advance"
    conn.send(("ok", None))
    while True:
        cmd, name, args = conn.recv()
        try:
            result: Any = None
            if cmd == "exit":
                for agent, _ in agents.values():
                    agent.close()
                conn.send(("ok", None))
                return
            if cmd == "logs":  # and forget them
                result = list(lines)
                lines.clear()
            elif cmd == "advance":  # (seconds,)
                result = clocks[name].advance(args[0])
            elif cmd == "add":
                spec = args
                if spec.manual_clock:
                    clocks[name] = ManualClock(1000.0)
                agent = TransferAgent(
                    spec.engine_id, spec.topology(), spec.tp_rank, 0, spec.compat(),
                    port=spec.port, secret=spec.secret, config=AgentConfig(**spec.config),
                    clock=clocks.get(name),
                )
                caches = make_caches(spec)
                agent.register_kv_caches(caches)
                agents[name] = (agent, caches)
                result = agent.start()
            else:
                agent, caches = agents[name]
                if cmd == "issue":
                    request_id, block_ids, num_readers, lease_s, token = args
                    result = agent.issue_grant(request_id, block_ids, num_readers,
                                               lease_s=lease_s, grant=token).grant
                elif cmd == "read":
                    agent.start_read(**args)
                elif cmd == "poll":
                    sending, recving = agent.get_finished()
                    result = (sending, recving, agent.get_failed_block_ids(), agent.get_stats())
                elif cmd == "caches":
                    result = caches
                elif cmd == "counters":
                    result = agent.counters()
                elif cmd == "grant_stats":
                    result = (agent.grants.stats(), len(agent.grants))
                else:
                    raise ValueError(cmd)
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", repr(exc)))


class FaultHost(Host):
    """A child process hosting agents; also answers ``counters`` (``AgentCounters``)
    and ``logs`` (kvbridge's log lines since the last call, INFO and up)."""

    def __init__(self) -> None:  # same as Host, with this module's child loop
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(child_conn,), daemon=True)
        self.process.start()
        self._wait("start", 120.0)

    def rss_nbytes(self) -> int:
        """Resident set size of the child process."""
        pid = self.process.pid
        with open(f"/proc/{pid}/status") as status:
            lines = status.read().splitlines()
        for line in lines:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {pid}")


@contextlib.contextmanager
def hosts(num_hosts: int) -> Iterator[list[FaultHost]]:
    """``num_hosts`` fresh agent hosts, closed afterwards."""
    started: list[FaultHost] = []
    try:
        for _ in range(num_hosts):
            started.append(FaultHost())
        yield started
    finally:
        for host in started:
            host.close()


def counters(agent: AgentRef) -> AgentCounters:
    """The agent's current :class:`AgentCounters`."""
    result: AgentCounters = agent.call("counters")
    return result


def idle_view(snapshot: AgentCounters) -> dict[str, int]:
    """The counters of ``snapshot`` that return to baseline when the agent is idle."""
    return {name: getattr(snapshot, name) for name in IDLE_FIELDS}


def wait_idle(agent: AgentRef, baseline: AgentCounters, timeout_s: float = 20.0) -> AgentCounters:
    """Poll until the agent's idle counters equal ``baseline``'s; fail with both if not."""
    return wait_until(lambda: counters(agent), timeout_s, interval_s=0.05,
                      until=lambda now: idle_view(now) == idle_view(baseline),
                      message=f"the agent back at baseline {idle_view(baseline)}",
                      describe=idle_view)


def good_read(server: AgentRef, reader: AgentRef, blocks: list[int], local: list[int]) -> None:
    """A well-behaved reader gets ``blocks`` byte for byte and the grant is released."""
    request_id = f"good-{secrets.token_hex(4)}"
    num_tokens = server.spec.block_size * len(blocks)
    token = issue([server], request_id, blocks, 1)
    read([reader], [server], request_id, token, blocks, local, num_tokens)
    assert wait_read(reader, request_id)["failed"] == set()
    got = logical(reader.call("caches"), reader.spec, local, num_tokens)
    want = logical(server.call("caches"), server.spec, blocks, num_tokens)
    assert torch.equal(got, want)
    wait_released(server, request_id)


# ---------------------------------------------------------------- frames and cases


def framed(payload: bytes, *, nbytes: int | None = None, crc: int | None = None) -> bytes:
    """A control frame: ``[nbytes : u32][crc32 : u32][payload]`` (both overridable)."""
    header = _FRAME.pack(len(payload) if nbytes is None else nbytes,
                         zlib.crc32(payload) if crc is None else crc)
    return header + payload


def frame_of(msg: wire.Message | dict[str, Any]) -> bytes:
    """A correct frame around a message (a dict is encoded as is: any types)."""
    payload = CODEC.encode(msg) if isinstance(msg, msgspec.Struct) else msgspec.msgpack.encode(msg)
    return framed(payload)


@dataclass(frozen=True)
class Case:
    """Bytes to send as UCX messages ``(channel, data)``, and what the agent must do.

    ``keeps``: in a session, the session must survive the case; for an opening
    case, the agent may accept the connection (otherwise it must refuse it).
    """

    kind: str
    frames: tuple[tuple[int, bytes], ...]
    keeps: bool
    reasons: frozenset[str] = frozenset()  # opening: the allowed Reject reasons


@dataclass(frozen=True)
class Target:
    """What the fuzzer knows about the agent under attack."""

    spec: Spec
    live_grants: tuple[tuple[str, tuple[int, ...]], ...]  # tokens of other requests
    dead_tokens: tuple[str, ...]  # expired or released grants

    @property
    def num_heads(self) -> int:
        return self.spec.topology().num_heads_per_rank


_HOSTILE: tuple[Any, ...] = (
    -1, -(1 << 63), (1 << 64) - 1, 1 << 63, 1 << 32, (1 << 31) + 1, 1.5, float("inf"),
    "", "x", "\u00e9" * 300, None, True, [], {}, [[[]]], b"\x00" * 40, {"kind": "ping"},
)


def _rand_bytes(rng: random.Random, max_nbytes: int) -> bytes:
    return rng.randbytes(rng.randint(0, max_nbytes))


class CaseMaker:
    """Draws fuzz cases from a seeded generator (same seed, same cases)."""

    def __init__(self, seed: int, target: Target) -> None:
        self.rng = random.Random(seed)
        self.target = target

    # --------------------------------------------------- building blocks
    def _token(self) -> str:
        rng, t = self.rng, self.target
        choice = rng.randrange(5)
        if choice == 0 and t.dead_tokens:
            return rng.choice(t.dead_tokens)
        if choice == 1:  # forged: the right shape, 128 random bits
            return secrets.token_urlsafe(16)[:GRANT_LEN]
        if choice == 2:  # a guess: a live token with one character changed
            token = rng.choice(t.live_grants)[0] if t.live_grants else "a" * GRANT_LEN
            i = rng.randrange(len(token))
            return token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1 :]
        if choice == 3:
            return "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 256)))
        return rng.choice(["x", "grant", "0" * 256, "../../etc/passwd", "%s%n", "\x00"])

    def _bad_read(self, xfer_id: int) -> wire.ReadRequest:
        """A schema-valid read the agent must refuse (never a servable one)."""
        rng, t, spec = self.rng, self.target, self.target.spec
        heads, layers = (0, self.target.num_heads), (0, spec.num_layers)
        grant = self._token()
        blocks = [rng.randrange(spec.num_blocks) for _ in range(rng.randint(1, 8))]
        flaw = rng.randrange(6)
        if flaw == 0 and t.live_grants:  # someone else's grant, blocks outside it
            grant, granted = rng.choice(t.live_grants)
            outside = [b for b in range(spec.num_blocks) if b not in granted]
            blocks = [rng.choice(granted) for _ in range(rng.randint(0, 3))]
            blocks.insert(rng.randint(0, len(blocks)), rng.choice(outside))
        elif flaw == 1:  # outside the cache
            blocks[rng.randrange(len(blocks))] = rng.randint(spec.num_blocks, 1 << 31)
        elif flaw == 2:
            lo = rng.randint(0, 1 << 31)
            heads = rng.choice([(lo, rng.randint(1, max(1, lo))), (0, t.num_heads + 1 + lo)])
        elif flaw == 3:
            lo = rng.randint(0, 1 << 31)
            layers = rng.choice([(lo, rng.randint(1, max(1, lo))), (0, spec.num_layers + 1)])
        elif flaw == 4:  # a huge chunk
            grant = rng.choice(t.live_grants)[0] if t.live_grants else grant
            return wire.ReadRequest(xfer_id, grant, [spec.num_blocks - 1] * 2, *heads, *layers,
                                    rng.randint(1 << 20, 1 << 31))
        # flaw 5: only the grant is wrong (unknown, forged, guessed or expired)
        return wire.ReadRequest(xfer_id, grant, blocks, *heads, *layers, rng.randint(1, 64))

    def _wrong_type_message(self) -> dict[Any, Any]:
        """A message dict with one field of a wrong type / out of range, or a wrong shape."""
        rng = self.rng
        sample = rng.choice(_SAMPLES)
        body: dict[Any, Any] = msgspec.to_builtins(sample)
        names = list(body)
        mutation = rng.randrange(5)
        if mutation == 0:
            body[rng.choice(names)] = rng.choice(_HOSTILE)
        elif mutation == 1:
            body.pop(rng.choice([n for n in names if n != "kind"] or ["kind"]))
        elif mutation == 2:
            body["unexpected_" + str(rng.randrange(100))] = rng.choice(_HOSTILE)
        elif mutation == 3:
            body["kind"] = rng.choice(["", "teleport", "READ", "read ", 7, None])
        else:
            body = {rng.choice(["kind", 1, b"k"]): rng.choice(_HOSTILE)}
        return body

    def _garbage_frame(self) -> tuple[str, bytes]:
        """Bytes that are not one valid control frame."""
        rng = self.rng
        kind = rng.choice(["random", "framed_random", "truncated", "bad_crc", "oversized",
                           "msgpack_bomb", "wrong_type", "empty_frame"])
        if kind == "random":
            return kind, _rand_bytes(rng, 2048)
        if kind == "framed_random":
            return kind, framed(_rand_bytes(rng, 2048))
        if kind == "truncated":
            payload = CODEC.encode(wire.Ping(rng.randrange(1 << 31)))
            cut = rng.randrange(len(payload))
            claimed = rng.choice([len(payload), rng.randint(cut + 1, MAX_FRAME)])
            return kind, framed(payload, nbytes=claimed, crc=zlib.crc32(payload))[: 8 + cut]
        if kind == "bad_crc":
            payload = CODEC.encode(wire.Ping(rng.randrange(1 << 31)))
            return kind, framed(payload, crc=(zlib.crc32(payload) + rng.randint(1, 1 << 20))
                                & 0xFFFFFFFF)
        if kind == "oversized":  # bigger than the agent's receive buffer, or a lying length
            if rng.random() < 0.5:
                return kind, framed(b"\x90" * (MAX_FRAME + rng.randint(1, 4096)))
            return kind, framed(b"\x90", nbytes=rng.randint(MAX_FRAME + 1, (1 << 32) - 1))
        if kind == "msgpack_bomb":  # containers claiming 2**32 - 1 entries, or deep nesting
            payload = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
                                  b"\x91" * 10_000 + b"\x90", b"\xdb\xff\xff\xff\xff"])
            return kind, framed(payload)
        if kind == "wrong_type":
            while True:  # some mutations (a dropped optional field) leave a valid message
                payload = msgspec.msgpack.encode(self._wrong_type_message())
                try:
                    CODEC.decode(payload)
                except ProtocolError:
                    return kind, framed(payload)
        return kind, b""

    # --------------------------------------------------- cases
    def keeping(self, xfer_id: int) -> Case:
        """A case the session must survive (``xfer_id``: a fresh id for a read)."""
        rng = self.rng
        kind = rng.choice(["bad_read", "bad_read", "bad_read", "credit", "done", "renew",
                           "ping", "unsolicited_data"])
        if kind == "bad_read":
            msg: wire.Message = self._bad_read(xfer_id)
        elif kind == "credit":  # credit for reads that do not exist
            msg = wire.Credit(rng.randint(1, wire.MAX_XFER_ID), rng.randint(1, wire.MAX_CHUNKS))
        elif kind == "done":  # a done report naming a grant that is not live
            token = self._token()
            while any(token == live for live, _ in self.target.live_grants):
                token = self._token()
            msg = wire.ReadDone(token, self._token(), rng.random() < 0.5)
        elif kind == "renew":
            msg = wire.RenewLease(self._token(), rng.choice([1e-9, 1.0, 86400.0]),
                                  rng.randint(1, wire.MAX_XFER_ID))
        elif kind == "ping":
            msg = wire.Ping(rng.randrange(1 << 31))
        else:  # bytes on a data channel the agent never receives on (eager-sized:
            # a rendezvous-sized send would wait forever for a receive)
            channel = channel_of(rng.randint(1, wire.MAX_XFER_ID), rng.randrange(1 << 16))
            return Case(kind, ((channel, _rand_bytes(rng, 2048)),), True)
        return Case(kind, ((0, frame_of(msg)),), True)

    def ending(self, xfer_id: int) -> Case:
        """A case that must end the session (bad bytes, wrong order, a reused xfer id, Bye)."""
        rng = self.rng
        pick = rng.randrange(10)
        if pick < 5:
            kind, data = self._garbage_frame()
            return Case(kind, ((0, data),), False)
        if pick < 8:  # a valid message the reader side must never send
            msg = rng.choice(_SERVER_ONLY)
            return Case(f"order_{type(msg).__name__}", ((0, frame_of(msg)),), False)
        if pick == 8:  # reuse an xfer id while its read waits for its (forged) grant
            req = wire.ReadRequest(xfer_id, secrets.token_urlsafe(16), [0], 0, 1, 0, 1, 1)
            return Case("xfer_reuse", ((0, frame_of(req)), (0, frame_of(req))), False)
        return Case("bye", ((0, frame_of(wire.Bye(rng.choice(["", "bye", "x" * 1024])))),),
                    False)

    def opening(self) -> Callable[[bytes], Case]:
        """A case sent instead of a good ``Hello``; built from the server's nonce."""
        rng, t = self.rng, self.target
        pick = rng.randrange(6)
        if pick < 2:
            kind, data = self._garbage_frame()
            return lambda _: Case(kind, ((0, data),), False, frozenset({R.BAD_REQUEST}))
        if pick == 2:  # a valid message, but not a Hello
            msg = rng.choice([*_SERVER_ONLY[1:], self._bad_read(1), wire.Ping(1), wire.Bye(""),
                              wire.Credit(1, 1), wire.ReadDone(self._token(), "r", True)])
            return lambda _: Case(f"before_hello_{type(msg).__name__}", ((0, frame_of(msg)),),
                                  False, frozenset({R.BAD_REQUEST}))
        flaw = rng.choice(["version", "compat", "secret", "no_proof", "nonce", "topology"])
        wrong_versions = [0, security.PROTOCOL_VERSION + 1, 1 << 31]
        version = rng.choice(wrong_versions) if flaw == "version" else security.PROTOCOL_VERSION
        compat = security.compat_hash(t.spec.compat())
        if flaw == "compat":
            compat = rng.choice(["", "0" * 64, compat[:-1] + "x", compat.upper()])
        secret = t.spec.secret or b""
        if flaw == "secret":
            secret = rng.choice([b"", b"x" * 32, bytes([secret[0] ^ 1]) + secret[1:]])
        nonce = rng.randbytes(rng.choice([0, 8, 31, 64])) if flaw == "nonce" else rng.randbytes(
            security.NONCE_NBYTES)
        topology = None
        if flaw == "topology":  # valid types, values that may not pair with this server
            topology = wire.TopologyInfo(
                rng.choice([1, 3, 1 << 31]), rng.choice([1, 5, 1 << 31]),
                rng.choice([1, 16, 1 << 31]), rng.choice([1, 8, 7, 1 << 31]),
                rng.random() < 0.3, rng.choice(["NHD", "HND", "", "nhd", "X"]),
                rng.choice([1, 4, 1 << 31]))
        engine_id = rng.choice(["attacker", "p-x", "d" * 256])
        rank = rng.choice([0, 1, 1 << 31])
        reasons = {"version": {R.VERSION}, "compat": {R.COMPAT}, "secret": {R.AUTH},
                   "no_proof": {R.AUTH}, "nonce": {R.AUTH}, "topology": {R.BAD_REQUEST}}[flaw]
        if flaw in ("secret", "nonce") and not t.spec.secret:
            reasons = set()  # nothing to check without a secret: accepted

        def build(server_nonce: bytes) -> Case:
            context = security.handshake_context("reader", engine_id, rank, t.spec.engine_id,
                                                 t.spec.tp_rank)
            proof = None
            if flaw != "no_proof" and secret:
                proof = security.prove(secret, server_nonce, context)
            hello = wire.Hello(engine_id, rank, version, compat, nonce, proof, topology)
            return Case(f"hello_{flaw}", ((0, frame_of(hello)),), flaw == "topology"
                        or not reasons, frozenset(reasons))

        return build


_SAMPLES: list[msgspec.Struct] = [
    wire.Hello("d", 0, 1, "ab" * 32, b"x" * 32, b"p" * 32),
    wire.ReadRequest(7, "t" * GRANT_LEN, [1, 5], 0, 4, 0, 2, 16),
    wire.Credit(7, 2),
    wire.ReadDone("t" * GRANT_LEN, "d:0", False),
    wire.RenewLease("t" * GRANT_LEN, 30.0, 7),
    wire.Ping(1),
    wire.Bye("x"),
    wire.TopologyInfo(1, 1, 16, 8, False, "NHD", 4),  # not a message at all
]
_SERVER_ONLY: list[wire.Message] = [
    wire.Hello("d", 0, 1, "ab" * 32, b"x" * 32, b"p" * 32),  # a second Hello
    wire.Challenge(b"n" * 32, 1),
    wire.Reject(R.AUTH, "no", 0),
    wire.DataHeader(3, 1, 1 << 20),  # "here come the data" from the reader's side
    wire.Pong(1),
    wire.LeaseRenewed("t" * GRANT_LEN, 1.0, 7),
    wire.AgentMetadata("x", 1, 1, 0, 0, 16, "NHD", 8, 1, 1, [64], 1, 1, 1, "bf16", 2, False),
]


# ---------------------------------------------------------------- client


@dataclass
class FuzzReport:
    """What the client did and saw."""

    num_cases: int = 0
    num_connections: int = 0
    cases: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)  # message kind / reject reason
    silent_drops: Counter[str] = field(default_factory=Counter)  # ended without a Reject

    def saw(self, msg: wire.Message) -> None:
        name = f"reject:{msg.reason}" if isinstance(msg, wire.Reject) else type(msg).__name__
        self.replies[name] += 1


class FuzzClient:
    """Plays cases against one agent from this process's event loop.

    Args:
        target: the agent under attack (its port is ``port``).
        port: the agent's port.
        reply_timeout_s: how long to wait for an expected reply.
    """

    def __init__(self, target: Target, port: int, reply_timeout_s: float = 5.0) -> None:
        self.target = target
        self.port = port
        self.reply_timeout_s = reply_timeout_s
        self.report = FuzzReport()
        self._worker: UcxWorker | None = None
        secret = target.spec.secret
        self._me = Identity("fuzzer", 0, security.compat_hash(target.spec.compat()), secret)

    async def __aenter__(self) -> FuzzClient:
        self._worker = UcxWorker()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._worker is not None:
            await self._worker.close()

    async def _connect(self) -> UcxConnection:
        assert self._worker is not None
        self.report.num_connections += 1
        return await self._worker.connect("127.0.0.1", self.port, timeout_s=self.reply_timeout_s)

    async def _send(self, conn: UcxConnection, case: Case) -> None:
        self.report.num_cases += 1
        self.report.cases[case.kind] += 1
        for channel, data in case.frames:
            buf = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(0, np.uint8)
            await conn.send(buf, channel, timeout_s=self.reply_timeout_s, busy=False)

    async def _next(self, conn: UcxConnection, what: str) -> wire.Message | None:
        """The next reply, or None when the agent went quiet or hung up."""
        try:
            msg = await recv_msg(conn, CODEC, MAX_FRAME, self.reply_timeout_s)
        except (PeerTimeoutError, PeerClosedError):
            return None
        except ProtocolError as exc:
            raise AssertionError(f"{what}: the agent sent a bad frame: {exc}") from None
        self.report.saw(msg)
        assert not isinstance(msg, wire.DataHeader), f"{what}: the agent started sending KV"
        return msg

    async def opening(self, make: Callable[[bytes], Case]) -> None:
        """One fresh connection whose first message is the case instead of a good Hello."""
        conn = await self._connect()
        try:
            challenge = await self._next(conn, "challenge")
            assert isinstance(challenge, wire.Challenge), challenge
            case = make(challenge.nonce)
            await self._send(conn, case)
            reply = await self._next(conn, case.kind)
            if isinstance(reply, wire.AgentMetadata):
                assert case.keeps, f"{case.kind}: the agent accepted a bad Hello"
                # the reader topology is checked after the metadata went out
                with contextlib.suppress(TransferError):
                    await send_msg(conn, CODEC, wire.Ping(1), self.reply_timeout_s)
                reply = await self._next(conn, case.kind)
                if isinstance(reply, wire.Pong):  # accepted: leave politely
                    await send_msg(conn, CODEC, wire.Bye("done"), self.reply_timeout_s)
                    return
                if reply is None:  # dropped before our ping arrived
                    self.report.silent_drops[case.kind] += 1
                    return
            assert isinstance(reply, wire.Reject) and reply.xfer_id == 0, (case.kind, reply)
            assert reply.reason in case.reasons, (case.kind, reply)
        finally:
            conn.abort()

    async def session(self, keeping: list[Case], ending: Case, read_ids: set[int]) -> None:
        """Good handshake, the ``keeping`` cases (each must be survived), then ``ending``.

        Args:
            read_ids: xfer ids of the reads among the cases (rejects must name one).
        """
        conn = await self._connect()
        try:
            await reader_handshake(conn, CODEC, self._me, self.target.spec.engine_id,
                                   self.target.spec.tp_rank, max_nbytes=MAX_FRAME,
                                   timeout_s=self.reply_timeout_s)
            for case in keeping:
                await self._send(conn, case)
            seq = random.randrange(1 << 31)
            await send_msg(conn, CODEC, wire.Ping(seq), self.reply_timeout_s)
            while True:  # replies to the cases, then our Pong: the session survived
                msg = await self._next(conn, "after keeping cases")
                assert msg is not None, f"session died on {[c.kind for c in keeping]}"
                if isinstance(msg, wire.Pong) and msg.seq == seq:
                    break
                self._check_reply(msg, read_ids, [c.kind for c in keeping])
            await self._send(conn, ending)
            if ending.kind == "bye":  # a goodbye is not answered
                return
            while True:  # late rejects of reads, then the agent's last word
                msg = await self._next(conn, ending.kind)
                if msg is None:
                    self.report.silent_drops[ending.kind] += 1
                    return
                if isinstance(msg, wire.Reject) and msg.reason == R.BAD_REQUEST \
                        and msg.xfer_id == 0:
                    return
                self._check_reply(msg, read_ids, [ending.kind])
        finally:
            conn.abort()

    @staticmethod
    def _check_reply(msg: wire.Message, read_ids: set[int], kinds: list[str]) -> None:
        match msg:
            case wire.Reject(renewal=True, reason=reason):  # renewals of grants not live
                assert reason in (R.UNKNOWN_GRANT, R.EXPIRED_GRANT), (kinds, msg)
            case wire.Reject(xfer_id=xfer_id):
                assert xfer_id in read_ids, (kinds, msg)
            case wire.Pong():
                pass
            case _:
                raise AssertionError(f"unexpected {msg!r:.200} after {kinds}")
