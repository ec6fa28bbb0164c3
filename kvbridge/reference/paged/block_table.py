"""Per-request block tables and slot mapping for the attention kernels.

The model runner of each worker owns one ``BlockTable`` per KV cache group
(``MultiGroupBlockTable``). Row ``i`` holds the block ids of the request in
batch slot ``i``; ``compute_slot_mapping`` turns (request index, token position)
pairs into flat cache slots (``block_id * block_size + offset``) for the cache
write kernels. The table lives in numpy on the host and is mirrored to a torch
tensor on the device by ``commit_block_table``.

Two twists on the plain table:

- A kernel block size smaller than the manager's block size: each manager block
  ``b`` is stored as ``k = block_size // kernel_block_size`` kernel blocks
  ``b*k .. b*k + k-1``. Slots are unchanged by the split.
- Decode context parallelism (DCP): token positions are dealt out to
  ``dcp_world_size`` ranks in runs of ``cp_kv_cache_interleave_size`` tokens.
  A rank stores only its own tokens; the others map to slot ``-1``.

``MultiGroupBlockTable`` checks an edit on every group before it writes any,
through ``BlockTable``'s private halves (``_prepare_append`` / ``_write_row``,
``_check_slot_inputs`` / ``_fill_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvbridge.errors import ConfigError

_INT32_MAX = int(np.iinfo(np.int32).max)

#: Slot written for a token that another context-parallel rank stores.
REMOTE_SLOT = -1


@dataclass(frozen=True, slots=True)
class ContextParallelConfig:
    """Decode context-parallel placement of tokens, identical on every table.

    Attributes:
        dcp_world_size: Number of ranks the tokens of one request are spread over.
        dcp_rank: This rank, in ``[0, dcp_world_size)``.
        cp_kv_cache_interleave_size: Consecutive tokens stored on one rank before
            the next rank takes over; must divide the kernel block size.
    """

    dcp_world_size: int = 1
    dcp_rank: int = 0
    cp_kv_cache_interleave_size: int = 1

    def __post_init__(self) -> None:
        if self.dcp_world_size < 1:
            raise ConfigError(f"dcp_world_size must be >= 1, got {self.dcp_world_size}")
        if not 0 <= self.dcp_rank < self.dcp_world_size:
            raise ConfigError(
                f"dcp_rank {self.dcp_rank} out of range for dcp_world_size {self.dcp_world_size}"
            )
        if self.cp_kv_cache_interleave_size < 1:
            raise ConfigError(
                f"cp_kv_cache_interleave_size must be >= 1, got {self.cp_kv_cache_interleave_size}"
            )


@dataclass(frozen=True, slots=True)
class GroupTableSpec:
    """Shape of the block table of one KV cache group.

    Attributes:
        block_size: Tokens per manager block on this rank (per-rank, not virtual).
        max_num_blocks_per_req: Manager blocks one request may hold.
        kernel_block_size: Tokens per block as the attention kernel sees it; must
            divide ``block_size``. ``None`` means no split.
    """

    block_size: int
    max_num_blocks_per_req: int
    kernel_block_size: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_blocks_per_req < 1:
            raise ConfigError(
                f"max_num_blocks_per_req must be >= 1, got {self.max_num_blocks_per_req}"
            )
        kernel = self.kernel_block_size
        if kernel is not None and (kernel < 1 or self.block_size % kernel != 0):
            raise ConfigError(
                f"kernel_block_size {kernel} does not divide block_size {self.block_size}"
            )

    @classmethod
    def for_max_model_len(
        cls,
        block_size: int,
        max_model_len: int,
        dcp_world_size: int = 1,
        kernel_block_size: int | None = None,
    ) -> GroupTableSpec:
        """Size a row for the longest request.

        Each rank stores ``1 / dcp_world_size`` of the tokens, so one row spans
        ``block_size * dcp_world_size`` positions per manager block.

        Args:
            block_size: Per-rank tokens per manager block.
            max_model_len: Longest request in tokens.
            dcp_world_size: Decode context-parallel world size.
            kernel_block_size: See the class attributes.

        Returns:
            The spec with ``max_num_blocks_per_req = ceil(max_model_len / (block_size * W))``.

        Raises:
            ConfigError: a non-positive size.
        """
        if max_model_len < 1 or dcp_world_size < 1 or block_size < 1:
            raise ConfigError(
                f"max_model_len {max_model_len}, block_size {block_size} and "
                f"dcp_world_size {dcp_world_size} must all be >= 1"
            )
        span = block_size * dcp_world_size
        return cls(block_size, -(-max_model_len // span), kernel_block_size)


class _HostDeviceBuffer:
    """A host tensor (with a numpy view) and its device mirror of the same shape."""

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool
    ) -> None:
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
        self.np: npt.NDArray[np.integer] = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device)
        self._non_blocking = pin_memory

    def commit(self, num_rows: int) -> None:
        self.device[:num_rows].copy_(self.host[:num_rows], non_blocking=self._non_blocking)


class BlockTable:
    """Block ids of every running request of one KV cache group on one rank.

    Rows hold *kernel* block ids; ``num_blocks_per_row`` counts those entries.
    Without a kernel split they equal the manager's block ids.
    """

    def __init__(
        self,
        spec: GroupTableSpec,
        *,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        cp: ContextParallelConfig | None = None,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        """Allocate the host table, its device mirror and the slot-mapping buffer.

        Raises:
            ConfigError: non-positive sizes, or an interleave size that does not
                divide the kernel block size.
        """
        if max_num_reqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_reqs {max_num_reqs} and max_num_batched_tokens "
                f"{max_num_batched_tokens} must be >= 1"
            )
        self.cp = cp if cp is not None else ContextParallelConfig()
        self.spec = spec
        self.kernel_block_size = spec.kernel_block_size or spec.block_size
        self.num_kernel_blocks_per_block = spec.block_size // self.kernel_block_size
        interleave = self.cp.cp_kv_cache_interleave_size
        if self.kernel_block_size % interleave != 0:
            # Otherwise a rank's share of one virtual block spills past its block.
            raise ConfigError(
                f"cp_kv_cache_interleave_size {interleave} does not divide "
                f"kernel block size {self.kernel_block_size}"
            )
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_kernel_blocks_per_req = (
            spec.max_num_blocks_per_req * self.num_kernel_blocks_per_block
        )
        dev = torch.device(device)
        pin = pin_memory and torch.cuda.is_available()
        self._table = _HostDeviceBuffer(
            (max_num_reqs, self.max_num_kernel_blocks_per_req), torch.int32, dev, pin
        )
        self._slots = _HostDeviceBuffer((max_num_batched_tokens,), torch.int64, dev, pin)
        self._num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    # -- read-only views ---------------------------------------------------

    @property
    def virtual_block_size(self) -> int:
        """Positions covered by one kernel block across all DCP ranks."""
        return self.kernel_block_size * self.cp.dcp_world_size

    @property
    def block_ids_np(self) -> npt.NDArray[np.integer]:
        """Host table ``[max_num_reqs, max_num_kernel_blocks_per_req]`` (read-only view)."""
        return _read_only(self._table.np)

    @property
    def block_ids_device(self) -> torch.Tensor:
        """Device mirror of the table, current as of the last ``commit_block_table``."""
        return self._table.device

    @property
    def num_blocks_per_row(self) -> npt.NDArray[np.integer]:
        """Kernel block ids stored in each row (read-only view)."""
        return _read_only(self._num_blocks)

    @property
    def slot_mapping_np(self) -> npt.NDArray[np.integer]:
        """Host slot mapping written by ``compute_slot_mapping`` (read-only view)."""
        return _read_only(self._slots.np)

    @property
    def slot_mapping_device(self) -> torch.Tensor:
        """Device mirror of the slot mapping, current as of ``commit_slot_mapping``."""
        return self._slots.device

    # -- row edits -----------------------------------------------------------

    def append_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Append manager block ids to the end of a row.

        Args:
            block_ids: Manager block ids, each split into kernel blocks.
            row_idx: Batch slot of the request.

        Raises:
            ValueError: ``row_idx`` out of range, a negative or too large block
                id, or more blocks than ``max_num_blocks_per_req``. The table
                is unchanged.
        """
        kernel_ids = self._prepare_append(block_ids, row_idx, reset=False)
        self._write_row(kernel_ids, row_idx, reset=False)

    def add_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Replace a row with ``block_ids`` (a newly scheduled request).

        Raises:
            ValueError: as ``append_row``; the table is unchanged.
        """
        kernel_ids = self._prepare_append(block_ids, row_idx, reset=True)
        self._write_row(kernel_ids, row_idx, reset=True)

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` over row ``tgt`` (batch condensing); ``src`` keeps its ids.

        Raises:
            ValueError: a row index out of range.
        """
        self._check_row(src)
        self._check_row(tgt)
        num_blocks = int(self._num_blocks[src])
        self._table.np[tgt, :num_blocks] = self._table.np[src, :num_blocks]
        self._num_blocks[tgt] = num_blocks

    def swap_row(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` and their block counts.

        Raises:
            ValueError: a row index out of range.
        """
        self._check_row(a)
        self._check_row(b)
        self._table.np[[a, b]] = self._table.np[[b, a]]
        self._num_blocks[[a, b]] = self._num_blocks[[b, a]]

    def clear(self) -> None:
        """Empty every row, on the host and on the device."""
        self._table.np.fill(0)
        self._table.device.fill_(0)
        self._num_blocks.fill(0)

    def commit_block_table(self, num_reqs: int) -> None:
        """Copy the first ``num_reqs`` rows to the device mirror.

        Raises:
            ValueError: ``num_reqs`` outside ``[0, max_num_reqs]``.
        """
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs {num_reqs} outside [0, {self.max_num_reqs}]")
        self._table.commit(num_reqs)

    def commit_slot_mapping(self, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` slots to the device mirror.

        Raises:
            ValueError: ``num_tokens`` outside ``[0, max_num_batched_tokens]``.
        """
        if not 0 <= num_tokens <= self.max_num_batched_tokens:
            raise ValueError(f"num_tokens {num_tokens} outside [0, {self.max_num_batched_tokens}]")
        self._slots.commit(num_tokens)

    # -- slot mapping --------------------------------------------------------

    def compute_slot_mapping(
        self, req_indices: npt.NDArray[np.integer], positions: npt.NDArray[np.integer]
    ) -> None:
        """Write the cache slot of each token into ``slot_mapping_np[:len(positions)]``.

        Args:
            req_indices: Row of each token, shape ``[num_tokens]``.
            positions: Position of each token in its request, shape ``[num_tokens]``.

        Raises:
            ValueError: mismatched shapes, more tokens than
                ``max_num_batched_tokens``, a row out of range, or a position
                beyond the blocks of its row. The slot mapping is unchanged.
        """
        self._check_slot_inputs(req_indices, positions)
        self._fill_slots(req_indices, positions)

    def _fill_slots(
        self, req_indices: npt.NDArray[np.integer], positions: npt.NDArray[np.integer]
    ) -> None:
        # A virtual block is one kernel block on every DCP rank side by side.
        # W=2 ranks, interleave I=2, kernel block size 4 -> virtual block of 8:
        #
        #   position in virtual block   0 1 2 3 4 5 6 7
        #   owner rank ((p // I) % W)   0 0 1 1 0 0 1 1
        #   offset on rank 0            0 1 . . 2 3 . .
        #   offset on rank 1            . . 0 1 . . 2 3
        #
        # offset = p // (W*I) * I + p % I; a "." is stored elsewhere (slot -1).
        kernel_bs = self.kernel_block_size
        virtual_bs = self.virtual_block_size
        rows = req_indices.astype(np.int64, copy=False)
        positions = positions.astype(np.int64, copy=False)
        flat_idx = rows * self.max_num_kernel_blocks_per_req + positions // virtual_bs
        block_ids = self._table.np.ravel()[flat_idx].astype(np.int64)
        out = self._slots.np[: positions.shape[0]]
        world = self.cp.dcp_world_size
        if world == 1:
            np.add(block_ids * kernel_bs, positions % kernel_bs, out=out)
            return
        interleave = self.cp.cp_kv_cache_interleave_size
        in_virtual = positions % virtual_bs
        is_local = (in_virtual // interleave) % world == self.cp.dcp_rank
        offsets = in_virtual // (world * interleave) * interleave + in_virtual % interleave
        out[:] = np.where(is_local, block_ids * kernel_bs + offsets, REMOTE_SLOT)

    # -- validation (never mutates) ------------------------------------------

    def _check_row(self, row_idx: int) -> None:
        if not 0 <= row_idx < self.max_num_reqs:
            raise ValueError(f"row_idx {row_idx} outside [0, {self.max_num_reqs})")

    def _prepare_append(
        self, block_ids: Sequence[int], row_idx: int, *, reset: bool
    ) -> npt.NDArray[np.int32]:
        """Validate an append and return the kernel block ids to write."""
        self._check_row(row_idx)
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        k = self.num_kernel_blocks_per_block
        num_held = 0 if reset else int(self._num_blocks[row_idx]) // k
        limit = self.spec.max_num_blocks_per_req
        if num_held + ids.size > limit:
            raise ValueError(
                f"row {row_idx} would hold {num_held + ids.size} blocks "
                f"({num_held} + {ids.size}), max_num_blocks_per_req is {limit}"
            )
        max_id = (_INT32_MAX + 1) // k - 1
        if ids.size and (ids.min() < 0 or ids.max() > max_id):
            raise ValueError(
                f"block ids must lie in [0, {max_id}], got min {ids.min()} max {ids.max()}"
            )
        # Manager block b -> kernel blocks b*k, b*k+1, ..., b*k+k-1.
        kernel_ids = (ids[:, None] * k + np.arange(k, dtype=np.int64)).reshape(-1)
        return kernel_ids.astype(np.int32)

    def _write_row(self, kernel_ids: npt.NDArray[np.int32], row_idx: int, *, reset: bool) -> None:
        start = 0 if reset else int(self._num_blocks[row_idx])
        self._table.np[row_idx, start : start + kernel_ids.size] = kernel_ids
        self._num_blocks[row_idx] = start + kernel_ids.size

    def _check_slot_inputs(
        self, req_indices: npt.NDArray[np.integer], positions: npt.NDArray[np.integer]
    ) -> None:
        if req_indices.ndim != 1 or req_indices.shape != positions.shape:
            raise ValueError(
                f"req_indices shape {req_indices.shape} and positions shape "
                f"{positions.shape} must be equal and 1-D"
            )
        for name, arr in (("req_indices", req_indices), ("positions", positions)):
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
        num_tokens = positions.shape[0]
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"{num_tokens} tokens exceed max_num_batched_tokens {self.max_num_batched_tokens}"
            )
        if num_tokens == 0:
            return
        if req_indices.min() < 0 or req_indices.max() >= self.max_num_reqs:
            raise ValueError(
                f"req_indices span [{req_indices.min()}, {req_indices.max()}], "
                f"rows are [0, {self.max_num_reqs})"
            )
        if positions.min() < 0:
            raise ValueError(f"negative position {positions.min()}")
        ends = self._num_blocks[req_indices].astype(np.int64) * self.virtual_block_size
        beyond = np.flatnonzero(positions >= ends)
        if beyond.size:
            i = int(beyond[0])
            raise ValueError(
                f"position {positions[i]} of row {req_indices[i]} is beyond its "
                f"{ends[i]} allocated positions ({self._num_blocks[req_indices[i]]} kernel "
                f"blocks of {self.virtual_block_size})"
            )


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV cache group; every edit applies to all groups.

    Edits are validated on every group before any group changes, so a bad call
    leaves all tables as they were.
    """

    def __init__(
        self,
        specs: Sequence[GroupTableSpec],
        *,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        cp: ContextParallelConfig | None = None,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        """Build one table per spec, in KV cache group order.

        Raises:
            ConfigError: no specs, or any ``BlockTable`` configuration error.
        """
        if not specs:
            raise ConfigError("MultiGroupBlockTable needs at least one group spec")
        self.block_tables = [
            BlockTable(
                spec,
                max_num_reqs=max_num_reqs,
                max_num_batched_tokens=max_num_batched_tokens,
                cp=cp,
                device=device,
                pin_memory=pin_memory,
            )
            for spec in specs
        ]

    def __getitem__(self, group_idx: int) -> BlockTable:
        return self.block_tables[group_idx]

    def __len__(self) -> int:
        return len(self.block_tables)

    def _check_groups(self, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.block_tables):
            raise ValueError(
                f"got block ids for {len(block_ids)} groups, table has {len(self.block_tables)}"
            )

    def append_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        """``BlockTable.append_row`` on each group with that group's block ids.

        Raises:
            ValueError: wrong number of groups or any group's ``append_row`` error.
        """
        self._edit_rows(block_ids, row_idx, reset=False)

    def add_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        """``BlockTable.add_row`` on each group with that group's block ids.

        Raises:
            ValueError: wrong number of groups or any group's ``add_row`` error.
        """
        self._edit_rows(block_ids, row_idx, reset=True)

    def _edit_rows(self, block_ids: Sequence[Sequence[int]], row_idx: int, *, reset: bool) -> None:
        self._check_groups(block_ids)
        prepared = [
            table._prepare_append(ids, row_idx, reset=reset)
            for table, ids in zip(self.block_tables, block_ids, strict=True)
        ]
        for table, kernel_ids in zip(self.block_tables, prepared, strict=True):
            table._write_row(kernel_ids, row_idx, reset=reset)

    def move_row(self, src: int, tgt: int) -> None:
        """``BlockTable.move_row`` on every group."""
        self.block_tables[0]._check_row(src)
        self.block_tables[0]._check_row(tgt)
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, a: int, b: int) -> None:
        """``BlockTable.swap_row`` on every group."""
        self.block_tables[0]._check_row(a)
        self.block_tables[0]._check_row(b)
        for table in self.block_tables:
            table.swap_row(a, b)

    def compute_slot_mapping(
        self, req_indices: npt.NDArray[np.integer], positions: npt.NDArray[np.integer]
    ) -> None:
        """``BlockTable.compute_slot_mapping`` on every group (validated on all first)."""
        for table in self.block_tables:
            table._check_slot_inputs(req_indices, positions)
        for table in self.block_tables:
            table._fill_slots(req_indices, positions)

    def commit_block_table(self, num_reqs: int) -> None:
        """``BlockTable.commit_block_table`` on every group."""
        for table in self.block_tables:
            table.commit_block_table(num_reqs)

    def commit_slot_mapping(self, num_tokens: int) -> None:
        """``BlockTable.commit_slot_mapping`` on every group."""
        for table in self.block_tables:
            table.commit_slot_mapping(num_tokens)

    def clear(self) -> None:
        """``BlockTable.clear`` on every group."""
        for table in self.block_tables:
            table.clear()


def _read_only(arr: npt.NDArray[np.integer]) -> npt.NDArray[np.integer]:
    view = arr.view()
    view.flags.writeable = False
    return view
