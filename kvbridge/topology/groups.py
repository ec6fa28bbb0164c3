"""KV cache groups: which blocks of each group a transfer moves, and which it must not.

An engine whose layers keep different kinds of cache (vLLM's hybrid KV cache
manager: full attention beside sliding-window layers or beside linear-attention
/ Mamba layers) gives each kind its own block table, a *group*. Block ids come
from one pool, so a block belongs to one group; a group's table is indexed by
block position (block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``)
and holds a null block where nothing is kept. Kinds (:class:`CacheGroup`)::

    tokens  every block of the prompt (full attention)
    window  a sliding window of ``window`` tokens: only the blocks the next
            token attends to; the engine freed the others (null blocks)
    state   a recurrent state (Mamba, gated delta net): one block holding the
            state after the last computed token. It cannot be rewound: D must
            continue exactly where P stopped (``remote_num_tokens == end``);
            in the classic flow P stops one token short of the prompt for it.

P holds one contiguous run of blocks per group (a *span*: first block index,
number of blocks); D reads, per group, the blocks its own manager allocated
(not null) in the blocks of ``[first_token, end)``, each from P's block at the
same position, and the state into its block of token ``end - 1``::

    block index   0   1   2   3   4   5        first_token = 64, end = 190, block 32
    tokens  P    b0  b1  b2  b3  b4  b5        span (0, 6)
            D    h   h   n   n   n   n         reads 2..5 (h: D's prefix hit, kept)
    window  P    -   -   -   b3  b4  b5        span (3, 3)  (-: null, out of window)
            D    -   -   -   -   n   n         reads 4..5: what D's window needs
    state   P    -   -   -   -   -   s         span (5, 1): the state after end tokens
            D    -   -   -   -   -   n         reads 5 <- 5

All of a request's groups move in one read: the block pairs of every group,
concatenated (:func:`plan_group_read`). Block sizes must be equal on both
sides (vLLM's CPU caches are refused otherwise at the handshake).
Pure functions: no I/O, no tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CacheGroup",
    "GroupKind",
    "GroupRead",
    "HeldGroups",
    "hold_groups",
    "load_problem",
    "plan_group_read",
]

GroupKind = Literal["tokens", "window", "state"]


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One KV cache group of an engine.

    Attributes:
        kind: ``"tokens"``, ``"window"`` or ``"state"`` (module docstring).
        window: tokens a position attends to, itself included (``"window"`` only).
        label: what the group is, for messages (e.g. ``"sliding window 96"``).

    Raises:
        ValueError: a window kind without a positive window, or a window elsewhere.
    """

    kind: GroupKind = "tokens"
    window: int = 0
    label: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("tokens", "window", "state"):
            raise ValueError(f"group kind must be tokens, window or state, got {self.kind!r}")
        if (self.kind == "window") != (self.window > 0):
            raise ValueError(f"a {self.kind} group with window {self.window}: only window "
                             f"groups have one, and theirs is > 0")

    @property
    def name(self) -> str:
        """The label, or the kind."""
        return self.label or self.kind


@dataclass(frozen=True, slots=True)
class HeldGroups:
    """What P holds of one request: the blocks of every group, and where they sit.

    Attributes:
        block_ids: the held blocks, group after group (each group's in position order).
        spans: per group, ``(first block index, number of blocks)`` of its run.
    """

    block_ids: list[int]
    spans: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class GroupRead:
    """One request's read over all its groups.

    Attributes:
        remote_block_ids: P's blocks to read, group after group.
        local_block_ids: D's blocks they land in (same length and order).
        missing: D's blocks that need KV P does not hold (the read leaves
            them unwritten: the load must count as failed).
    """

    remote_block_ids: list[int]
    local_block_ids: list[int]
    missing: list[int]


def _state_index(num_tokens: int, num_blocks: int, block_size: int) -> int:
    """Position of the block holding the state after ``num_tokens`` tokens.

    vLLM keeps it at the block of the last computed token when it caches
    states by position (prefix caching), else in a table of one block.
    """
    return min((num_tokens - 1) // block_size, num_blocks - 1)


def hold_groups(
    groups: Sequence[CacheGroup], block_ids: Sequence[Sequence[int]], num_tokens: int,
    block_size: int, null_block_id: int | None,
) -> HeldGroups:
    """P: the blocks to hold for a reader, per group, for the first ``num_tokens`` tokens.

    Args:
        groups: the engine's groups.
        block_ids: the request's block ids per group, by position from token 0.
        num_tokens: prompt tokens whose KV (and state, after them) P computed.
        block_size: tokens per block.
        null_block_id: the engine's placeholder for a freed position, if any.

    Raises:
        ValueError: the groups disagree with ``block_ids``, or a group lacks
            what a reader needs (a window's last block, the state).
    """
    if len(block_ids) != len(groups):
        raise ValueError(f"{len(block_ids)} block lists for {len(groups)} KV cache groups")
    if num_tokens < 1:
        raise ValueError(f"nothing to hold for {num_tokens} tokens")
    num_blocks = math.ceil(num_tokens / block_size)
    flat: list[int] = []
    spans: list[tuple[int, int]] = []
    for group, ids in zip(groups, block_ids, strict=True):
        if group.kind == "state":
            index = _state_index(num_tokens, len(ids), block_size) if ids else -1
            if index < 0 or ids[index] == null_block_id:
                raise ValueError(f"the {group.name} group holds no state after "
                                 f"{num_tokens} tokens ({len(ids)} blocks)")
            flat.append(ids[index])
            spans.append((index, 1))
            continue
        ids = ids[:num_blocks]
        stop = len(ids)
        start = stop
        while start > 0 and ids[start - 1] != null_block_id:  # the run ending last
            start -= 1
        if stop < num_blocks or start == stop:
            raise ValueError(f"the {group.name} group holds blocks [{start}, {stop}) of "
                             f"the {num_blocks} of {num_tokens} tokens")
        flat.extend(ids[start:stop])
        spans.append((start, stop - start))
    return HeldGroups(flat, spans)


def load_problem(
    groups: Sequence[CacheGroup], spans: Sequence[tuple[int, int]], first_token: int,
    end: int, remote_num_tokens: int, block_size: int,
) -> str | None:
    """D, before allocating: why loading ``[first_token, end)`` would not be exact, or None.

    Args:
        groups: this (D) engine's groups.
        spans: what P holds per group (``HeldGroups.spans``, from its params).
        first_token: first token to load (D's prefix hit, a block multiple).
        end: one past the last token to load (D computes from there).
        remote_num_tokens: tokens P computed (its state is the state after them).
        block_size: tokens per block, equal on both sides.
    """
    if len(spans) != len(groups):
        return (f"P's cache has {len(spans)} KV cache groups, this engine's "
                f"{len(groups)} (is vLLM's hybrid KV cache manager off on one side only? "
                f"--disable-hybrid-kv-cache-manager must match)")
    end_block = math.ceil(end / block_size)
    for group, (start, count) in zip(groups, spans, strict=True):
        if group.kind == "state":
            if remote_num_tokens != end:
                return (f"the {group.name} group's recurrent state on P is the state after "
                        f"{remote_num_tokens} tokens; this request continues after {end} "
                        f"(a state cannot be rewound: P computes the prompt without its last "
                        f"token unless asked for the first-token flow, and D must be asked "
                        f"the same way: the classic flow with the plain prompt, or the "
                        f"prompt and P's token after first_token_flow)")
            if count != 1:
                return f"P holds {count} blocks of the {group.name} group's state, not 1"
            continue
        needed = first_token if group.kind == "tokens" else max(first_token, end - group.window + 1)
        if start > needed // block_size or start + count < end_block:
            return (f"the {group.name} group needs blocks [{needed // block_size}, "
                    f"{end_block}) for tokens [{needed}, {end}); P holds "
                    f"[{start}, {start + count})")
    return None


def plan_group_read(
    groups: Sequence[CacheGroup], local_block_ids: Sequence[Sequence[int]],
    spans: Sequence[tuple[int, int]], remote_block_ids: Sequence[int], first_token: int,
    end: int, block_size: int, null_block_id: int | None,
) -> GroupRead:
    """D, after allocating: the block pairs of all groups for one read.

    Args:
        groups: this engine's groups.
        local_block_ids: the request's blocks per group, by position from token 0.
        spans: P's runs per group; ``remote_block_ids`` holds them group after group.
        remote_block_ids: P's held blocks.
        first_token: first token to load (a block multiple).
        end: one past the last token to load.
        block_size: tokens per block, equal on both sides.
        null_block_id: this engine's placeholder block, never written.

    Raises:
        ValueError: the lists disagree with the groups or the spans.
    """
    if not len(groups) == len(local_block_ids) == len(spans):
        raise ValueError(f"{len(local_block_ids)} block lists and {len(spans)} spans for "
                         f"{len(groups)} KV cache groups")
    if sum(count for _, count in spans) != len(remote_block_ids):
        raise ValueError(f"spans {list(spans)} do not cover {len(remote_block_ids)} blocks")
    first_block, end_block = first_token // block_size, math.ceil(end / block_size)
    remote: list[int] = []
    local: list[int] = []
    missing: list[int] = []
    offset = 0
    for group, ids, (start, count) in zip(groups, local_block_ids, spans, strict=True):
        held = remote_block_ids[offset : offset + count]
        offset += count
        if group.kind == "state":
            index = _state_index(end, len(ids), block_size) if ids else -1
            if index < 0 or ids[index] == null_block_id:
                raise ValueError(f"this engine allocated no block for the {group.name} "
                                 f"group's state after {end} tokens ({len(ids)} blocks)")
            remote.append(held[0])
            local.append(ids[index])
            continue
        if len(ids) < end_block:
            raise ValueError(f"the {group.name} group has {len(ids)} blocks, the load "
                             f"needs {end_block}")
        for index in range(first_block, end_block):
            block_id = ids[index]
            if block_id == null_block_id:  # outside what this engine keeps
                continue
            if start <= index < start + count:
                remote.append(held[index - start])
                local.append(block_id)
            else:
                missing.append(block_id)
    return GroupRead(remote, local, missing)
