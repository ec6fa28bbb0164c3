"""A userspace netem: delay and drop a host's outgoing packets through NFQUEUE.

Used by ``netns.py`` (``NetnsLab.netem``) where the kernel has no ``sch_netem``
qdisc. An nftables rule in the host's namespace hands every packet leaving its
``eth0`` to queue ``N`` (``queue num N bypass``: if this process is gone, packets
pass untouched); this process, run inside that namespace, holds each packet for
the delay and then lets it go, or drops it with the loss probability::

    app -> [nft output hook: queue N] -> this process: drop? / hold delay -> ACCEPT -> eth0

Only the verdict crosses netlink: packets are queued with ``COPY_META`` (no
payload copy) and GSO packets whole (``F_GSO``), so one verdict can release a
large TCP segment. Release order is arrival order (no reordering; jitter only
varies the gaps). Run as ``python nfqueue_link.py --queue N --delay-ms D
[--jitter-ms J] [--loss-pct P] [--seed S]``; it prints ``READY`` once bound and
runs until SIGTERM. Talks the nfnetlink_queue protocol directly (no library).
"""

from __future__ import annotations

import argparse
import collections
import errno
import random
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG = 0, 1, 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND = 1
COPY_META = 1
F_GSO = 4
ATTR_PACKET_HDR, ATTR_VERDICT_HDR = 1, 2
NF_DROP, NF_ACCEPT = 0, 1
QUEUE_MAXLEN = 4096  # like netem's packet limit: more waiting packets are dropped

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big endian, packed by hand)
_NLATTR = struct.Struct("=HH")  # len, type


def _attr(kind: int, payload: bytes) -> bytes:
    raw = _NLATTR.pack(_NLATTR.size + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(msg_type: int, queue: int, attrs: bytes, seq: int, flags: int) -> bytes:
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    kind = (NFNL_SUBSYS_QUEUE << 8) | msg_type
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, flags, seq, 0) + body


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """``(type, payload after nlmsghdr)`` of each netlink message in one datagram."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            return
        yield kind, data[offset + _NLMSGHDR.size : offset + length]
        offset += (length + 3) & ~3


def _packet_id(payload: bytes) -> int | None:
    """The queue's id of the packet in one ``NFQNL_MSG_PACKET`` payload."""
    offset = _NFGENMSG.size
    while offset + _NLATTR.size <= len(payload):
        length, kind = _NLATTR.unpack_from(payload, offset)
        if length < _NLATTR.size:
            return None
        if kind & 0x3FFF == ATTR_PACKET_HDR:
            return int(struct.unpack_from("!I", payload, offset + _NLATTR.size)[0])
        offset += (length + 3) & ~3
    return None


class DelayLine:
    """Bound to one queue: holds or drops its packets (see the module docstring)."""

    def __init__(self, queue: int, delay_s: float, jitter_s: float, loss: float,
                 seed: int) -> None:
        self.queue, self.delay_s, self.jitter_s, self.loss = queue, delay_s, jitter_s, loss
        self._rng = random.Random(seed)
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root)
        self._sock.bind((0, 0))
        self._seq = 0
        self._held: collections.deque[tuple[float, int]] = collections.deque()
        self._last_release = 0.0
        self.num_accepted = self.num_dropped = 0
        self._configure(_attr(CFG_CMD, struct.pack("!BxH", CMD_BIND, 0)))
        self._configure(_attr(CFG_PARAMS, struct.pack("!IB", 0, COPY_META))
                        + _attr(CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)))
        self._configure(_attr(CFG_FLAGS, struct.pack("!I", F_GSO))
                        + _attr(CFG_MASK, struct.pack("!I", F_GSO)))

    def _configure(self, attrs: bytes) -> None:
        """Send one config message and wait for the kernel's ack (raises OSError on refusal)."""
        self._seq += 1
        self._sock.send(_message(MSG_CONFIG, self.queue, attrs, self._seq,
                                 NLM_F_REQUEST | NLM_F_ACK))
        deadline = time.monotonic() + 5
        self._sock.settimeout(5)  # every wait here has a deadline; run() uses select
        while time.monotonic() < deadline:
            for kind, payload in _messages(self._sock.recv(65536)):
                if kind == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", payload)
                    if code:
                        raise OSError(-code, f"nfqueue config refused: {errno.errorcode[-code]}")
                    return
        raise TimeoutError("no answer from nfnetlink_queue")

    def _verdict(self, packet_id: int, verdict: int) -> None:
        self._seq += 1
        attrs = _attr(ATTR_VERDICT_HDR, struct.pack("!II", verdict, packet_id))
        self._sock.send(_message(MSG_VERDICT, self.queue, attrs, self._seq, NLM_F_REQUEST))

    def _arrived(self, packet_id: int) -> None:
        if self.loss and self._rng.random() < self.loss:
            self._verdict(packet_id, NF_DROP)
            self.num_dropped += 1
            return
        wanted = time.monotonic() + self.delay_s + self._rng.uniform(-self.jitter_s, self.jitter_s)
        self._last_release = max(self._last_release, wanted)  # keep arrival order
        self._held.append((self._last_release, packet_id))

    def _release_due(self) -> None:
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            self._verdict(self._held.popleft()[1], NF_ACCEPT)
            self.num_accepted += 1

    def run(self, stop: list[bool]) -> None:
        """Serve the queue until ``stop[0]`` is set (by a signal handler)."""
        while not stop[0]:
            wait_s = max(0.0, self._held[0][0] - time.monotonic()) if self._held else 0.2
            readable, _, _ = select.select([self._sock], [], [], wait_s)
            if readable:
                try:
                    data = self._sock.recv(1 << 20)
                except OSError as exc:
                    if exc.errno != errno.ENOBUFS:  # the kernel dropped some: go on
                        raise
                    data = b""
                for kind, payload in _messages(data):
                    if kind == (NFNL_SUBSYS_QUEUE << 8) | MSG_PACKET:
                        packet_id = _packet_id(payload)
                        if packet_id is not None:
                            self._arrived(packet_id)
            self._release_due()
        for _, packet_id in self._held:  # let the held ones go rather than lose them
            self._verdict(packet_id, NF_ACCEPT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--loss-pct", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    line = DelayLine(args.queue, args.delay_ms / 1e3, args.jitter_ms / 1e3,
                     args.loss_pct / 100, args.seed)
    stop = [False]

    def on_signal(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("READY", flush=True)
    line.run(stop)
    print(f"accepted {line.num_accepted} dropped {line.num_dropped}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
