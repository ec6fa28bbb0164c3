"""The server's board of live grants, which a same-host reader checks for itself.

A protocol in memory rather than on the wire: the server writes the board
(``GrantBoard``, kept by its grant table, ``serving/grants.py``), a reader on
its host reads it (``find_grant``, through ``reading/copy_source.py``); both agree on
the slot format below.

A same-host copy (``reading/same_host.py``) needs the server's word that the grant is
live and holds the read's blocks. Asked for (``CopyGo``), that word costs a
round trip through the server's event loop, and on a busy host the server may
wait for a core until the reader's own copy threads leave one. The board gives
the same word without asking: the server writes every live grant (grant digest,
block ids, prompt digest, lease deadline) into a table in its memory, and the
reader reads it from there with the same ``process_vm_readv`` it copies with.

Each slot is a *sequence lock*. The server changes a slot only under the grant
table's lock, and only like this::

    publish    seq odd -> fields written -> seq + 1 (even: live)
    withdraw   seq + 1 (odd: gone)      before the grant's blocks go back to its owner
    renew      the deadline alone (one aligned 8-byte store; seq unchanged)

A reader reads ``seq`` (before the slot's other fields: a separate iovec of the
same call, and the kernel copies iovecs in order), checks the fields, copies the
blocks, then reads ``seq`` again. The same even value both times means the grant
was live, unchanged, from before the copy to after it: its blocks cannot have
been handed back (withdraw comes first) while they were copied. Any other value
and the copy is dropped; the reader then asks the server as usual, which also
answers a grant that really is gone with the usual rejection. A slot found busy,
a grant not on the board (more than ``MAX_BLOCKS`` blocks, or a full window),
anything unexpected: the reader asks. The board never says no, it only lets a
reader skip asking when it says yes.

A slot (``SLOT_NBYTES``)::

    word 0   seq                     u64   0 never used, odd gone/writing, even live
    words 1-2  grant digest          16 B  blake2b of the grant string
    words 3-4  prompt digest digest  16 B  blake2b of the grant's prompt digest
    word 5   deadline                f64   lease end, ``time.monotonic()`` seconds
    word 6   num_blocks | bound<<32  u64   bound: the grant names a prompt
    word 7   place                   u64   where the caches were (``LocalKV.place``)
    then     block ids               u32 x MAX_BLOCKS

A grant's slot is one of ``WINDOW`` slots from its grant digest's home slot, so a
reader finds it with one read of ``WINDOW`` slots.

Where it can, the board lives in a ``memfd`` (``GrantBoard.fd``) that a reader
maps read-only through ``/proc/<pid>/fd/<fd>`` (the same permission as
``process_vm_readv``): then finding a grant is plain loads from the reader's own
mapping, no system call (``reading/copy_source.py``). After the slots comes the board's tag
(``TAG_NBYTES`` random bytes): a reader compares it through ``process_vm_readv``
at the advertised address with its mapping's before it trusts the mapping.

The order of loads and stores, on any CPU (``memory_fence``). The writer puts a
full fence between the odd seq and the fields, and between the fields and the
even seq (and after a withdraw's seq, before the blocks go back). A reader of
the mapped board loads the window's seqs, fences, then loads the fields
(``find_grant``), and fences again after its copy before it loads the seq once
more (``slot_seq``). x86 (TSO) keeps loads in order with loads and stores with
stores, and each Python operation is its own C call (no compiler reorders
across it): there the fence is a no-op. Elsewhere (aarch64: GH200/GB200 hosts)
it is libatomic's ``atomic_thread_fence(memory_order_seq_cst)`` (``dmb ish``);
where that is not loadable, no board is offered and none is mapped (the reader
asks the server; ``board_supported``). Reads through ``process_vm_readv`` need no
fence of ours: the kernel copies each remote iovec after pinning its pages and
unpins them (a value-returning atomic, fully ordered) before the next
(``mm/process_vm_access.c``), so a slot's seq row is loaded before its fields,
and the blocks before the seq copied after them.

Where the blocks are the board does not say: the reader takes that from an
earlier ``CopyGo``, and only if the go's ``place`` (a fingerprint of the cache
tensors' addresses when the go was made) equals the slot's (taken when the
grant was published). Caches that moved since (a tensor's storage can move,
e.g. into shared memory when it is pickled to another process) make the two
differ, and the reader asks. The server also looks every ``expire_every_s`` and
takes everything off the board when its caches moved (``GrantTable.refresh_board``):
caches that move while grants are live are not supported on any path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import logging
import mmap
import os
import platform
import secrets
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "MAX_BLOCKS",
    "SLOT_NBYTES",
    "TAG_NBYTES",
    "WINDOW",
    "BoardSpot",
    "GrantBoard",
    "board_supported",
    "find_grant",
    "home_slot",
    "memory_fence",
    "slot_seq",
    "grant_digest",
]

logger = logging.getLogger(__name__)

MAX_BLOCKS = 256  # block ids a slot holds; larger grants are not on the board
WINDOW = 4  # slots a grant may sit in, from its home slot on
NUM_SLOTS = 4096  # home slots (the table has WINDOW - 1 more, so windows never wrap)
_HEADER_WORDS = 8
SLOT_NBYTES = _HEADER_WORDS * 8 + MAX_BLOCKS * 4
_SEQ, _GRANT, _PROMPT, _DEADLINE, _COUNT, _PLACE = 0, 1, 3, 5, 6, 7
_BOUND = 1 << 32
_MAX_ID = (1 << 32) - 1
TAG_NBYTES = 16
# a slot's header after its seq, in one unpack (the seq is loaded apart, before a fence)
_FIELDS = struct.Struct("<16s16sdQQ")
_U64 = struct.Struct("<Q")
_WINDOW_SEQS = struct.Struct("<" + f"Q{SLOT_NBYTES - 8}x" * (WINDOW - 1) + "Q")  # in one load
# CPUs that keep loads in order with loads and stores with stores (TSO)
_ORDERED_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})
_SEQ_CST = 5  # C11 memory_order_seq_cst


def _no_fence() -> None:
    """Nothing to do: the CPU keeps the order (see ``memory_fence``)."""


def _libatomic_fence() -> Callable[[], None] | None:
    """libatomic's ``atomic_thread_fence(memory_order_seq_cst)``, or None if not loadable."""
    for name in ("libatomic.so.1", ctypes.util.find_library("atomic")):
        if not name:
            continue
        try:
            fence = ctypes.CDLL(name).atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fence.argtypes, fence.restype = [ctypes.c_int], None
        return functools.partial(fence, _SEQ_CST)
    return None


@functools.cache
def memory_fence() -> Callable[[], None] | None:
    """A full memory fence for the board on this CPU (see the module doc); None: none here.

    A no-op on x86; libatomic's fence elsewhere; None where that is not loadable.
    """
    machine = platform.machine().lower()
    if machine in _ORDERED_MACHINES:
        return _no_fence
    fence = _libatomic_fence()
    if fence is None:
        logger.warning("no memory fence on this %s CPU (libatomic.so.1 not loadable): no "
                       "grant board, same-host reads ask the server for each grant", machine)
    return fence


def board_supported() -> bool:
    """This process can write a board, or read a mapped one, in the right order."""
    return memory_fence() is not None


_GRANT_HASH = hashlib.blake2b(digest_size=16, person=b"kvbridge-grant")


def grant_digest(grant: str) -> bytes:
    """What the board keeps of a grant string (16 bytes)."""
    hasher = _GRANT_HASH.copy()  # half the cost of a new keyed blake2b
    hasher.update(grant.encode())
    return hasher.digest()


def _prompt_key(prompt_digest: bytes) -> bytes:
    return hashlib.blake2b(prompt_digest, digest_size=16, person=b"kvbridge-prompt").digest()


def home_slot(digest: bytes, num_slots: int) -> int:
    """The first slot of a grant's window."""
    return int.from_bytes(digest[:8], "little") % num_slots


def _shared_memory(nbytes: int) -> tuple[mmap.mmap | bytearray, int]:
    """Zeroed memory a reader on this host can map (a memfd and its fd), else private (-1)."""
    try:
        fd = os.memfd_create("kvbridge-grant-board", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as exc:  # not Linux, or memfd not allowed
        logger.debug("grant board in private memory: %s", exc)
        return bytearray(nbytes), -1
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes), fd
    except OSError as exc:
        os.close(fd)
        logger.debug("grant board in private memory: %s", exc)
        return bytearray(nbytes), -1


class GrantBoard:
    """The server's side: slots written under the grant table's lock (see the module doc).

    Args:
        place: where the caches are now (``LocalKV.place``), asked at each publish.
        num_slots: home slots; a window of ``WINDOW`` slots starts at each.
    """

    def __init__(self, place: Callable[[], int], num_slots: int = NUM_SLOTS) -> None:
        fence = memory_fence()
        if fence is None:
            raise RuntimeError("no memory fence on this CPU: check board_supported() first")
        self._fence = fence
        self._place = place
        self.num_slots = num_slots
        rows = num_slots + WINDOW - 1
        self.nbytes = rows * SLOT_NBYTES  # of the slots; the tag follows
        memory, self.fd = _shared_memory(self.nbytes + TAG_NBYTES)
        if self.fd >= 0:
            weakref.finalize(self, os.close, self.fd)
        whole = np.frombuffer(memory, dtype=np.uint8)
        whole[: self.nbytes] = 0  # every page in now, not faulted in by a publish
        whole[self.nbytes :] = np.frombuffer(secrets.token_bytes(TAG_NBYTES), dtype=np.uint8)
        self._buf = whole[: self.nbytes]
        self._words = self._buf.view(np.uint64).reshape(rows, SLOT_NBYTES // 8)
        self._deadlines = self._buf.view(np.float64).reshape(rows, SLOT_NBYTES // 8)[:, _DEADLINE]
        self._ids = self._buf.view(np.uint32).reshape(rows, SLOT_NBYTES // 4)[:, 2 * _HEADER_WORDS:]
        self._used = np.zeros(rows, dtype=bool)
        self._slot_of: dict[str, int] = {}

    @property
    def address(self) -> int:
        """Where the table starts in this process."""
        return int(self._buf.ctypes.data)

    def __len__(self) -> int:
        return len(self._slot_of)

    def publish(self, grant: str, block_ids: Sequence[int], deadline_in_s: float,
                prompt_digest: bytes | None) -> bool:
        """Put a live grant on the board; False (not on it) when it does not fit.

        ``grant`` is the grant's string: readers look it up by the one they
        present, and it keys ``renew`` and ``withdraw``.
        """
        if len(block_ids) > MAX_BLOCKS or any(b > _MAX_ID for b in block_ids):
            return False
        digest = grant_digest(grant)
        home = home_slot(digest, self.num_slots)
        free = np.flatnonzero(~self._used[home : home + WINDOW])
        if free.size == 0:
            return False
        slot = home + int(free[0])
        words = self._words[slot]
        seq = int(words[_SEQ])
        words[_SEQ] = seq + 1 if seq % 2 == 0 else seq  # odd while written
        self._fence()
        words[_GRANT : _GRANT + 2] = np.frombuffer(digest, dtype=np.uint64)
        bound = prompt_digest is not None
        key = _prompt_key(prompt_digest) if prompt_digest is not None else bytes(16)
        words[_PROMPT : _PROMPT + 2] = np.frombuffer(key, dtype=np.uint64)
        self._deadlines[slot] = time.monotonic() + deadline_in_s
        words[_COUNT] = len(block_ids) | (_BOUND if bound else 0)
        words[_PLACE] = self._place()
        self._ids[slot, : len(block_ids)] = block_ids
        self._fence()
        words[_SEQ] = int(words[_SEQ]) + 1  # even: live
        self._used[slot] = True
        self._slot_of[grant] = slot
        return True

    def renew(self, grant: str, deadline_in_s: float) -> None:
        """Move a published grant's deadline (no-op when it is not on the board)."""
        slot = self._slot_of.get(grant)
        if slot is not None:
            self._deadlines[slot] = time.monotonic() + deadline_in_s

    def withdraw_moved(self) -> int:
        """Take off every grant published while the caches were elsewhere; how many."""
        place = self._place()
        moved = [t for t, slot in self._slot_of.items() if int(self._words[slot, _PLACE]) != place]
        for grant in moved:
            self.withdraw(grant)
        return len(moved)

    def withdraw(self, grant: str) -> None:
        """Take a grant off the board (before its blocks are handed back); idempotent."""
        slot = self._slot_of.pop(grant, None)
        if slot is None:
            return
        self._words[slot, _SEQ] = int(self._words[slot, _SEQ]) + 1  # odd: gone
        self._fence()
        self._used[slot] = False


class BoardSpot(NamedTuple):
    """Where a reader found its grant: the slot's seq address and the value it read."""

    seq_address: int
    seq: int


def slot_seq(board: bytes | mmap.mmap, at: int, fence: Callable[[], None]) -> int:
    """The seq at offset ``at`` of the mapped ``board``, loaded after every load before
    this call (``fence``: ``memory_fence()``)."""
    if fence is not _no_fence:
        fence()
    return int(_U64.unpack_from(board, at)[0])


def find_grant(
    board: bytes | mmap.mmap, first: int, board_address: int, digest: bytes,
    block_ids: Sequence[int], prompt_digest: bytes, now: float, place: int,
    fence: Callable[[], None] | None = None,
) -> BoardSpot | None:
    """The slot among ``WINDOW`` from offset ``first`` of ``board`` that allows the read,
    or None.

    ``board``: a copy of the server's board, or of a window of it, or a map of it;
    its offset 0 is the server's ``board_address``. Allows: live (even seq), the
    grant's ``digest``, every block id in the slot's, the read's prompt digest if
    the grant names one, ``now`` before the deadline, and the caches where ``place``
    (from the go the reader copies by) says.

    ``fence``: ``memory_fence()`` when ``board`` is a map of the live board (the
    window's seqs are loaded before it, the fields after); None for a copy.
    """
    if first + WINDOW * SLOT_NBYTES <= len(board):
        seqs: Sequence[int] = _WINDOW_SEQS.unpack_from(board, first)
    else:  # a board shorter than a window
        end = len(board) - SLOT_NBYTES + 1
        seqs = [_U64.unpack_from(board, at)[0] for at in range(first, end, SLOT_NBYTES)]
    if fence is not None and fence is not _no_fence:
        fence()
    start = first - SLOT_NBYTES
    for seq in seqs:
        start += SLOT_NBYTES
        if seq == 0 or seq & 1:
            continue
        named, prompt, deadline, count, slot_place = _FIELDS.unpack_from(board, start + 8)
        if named != digest:
            continue
        num_blocks = count & _MAX_ID
        if num_blocks > MAX_BLOCKS or not now < deadline or not place or slot_place != place:
            return None
        if count & _BOUND and (not prompt_digest or prompt != _prompt_key(prompt_digest)):
            return None
        ids_at = start + 8 * _HEADER_WORDS
        granted = set(struct.unpack_from(f"<{num_blocks}I", board, ids_at))
        if not granted.issuperset(block_ids):
            return None
        return BoardSpot(board_address + start, seq)
    return None
