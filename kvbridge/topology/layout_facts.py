"""Facts about a KV cache tensor read from its shape and strides (plain int tuples).

The transfer agent registers cache memory and turns block ids into addresses;
for that it needs to know, for the tensor it was handed:

- whether K and V are the outer dimension (K/V-first, ``[2, num_blocks, ...]``)
  or blocks are (blocks-first, ``[num_blocks, 2, ...]``), *in memory*;
- whether all layers are stacked in one tensor (cross-layer blocks: a leading
  ``num_layers`` dimension);
- where the block-size dimension sits in memory, and whether tokens or heads
  are outer inside a block (the physical :class:`KVLayout`).

``shape`` is the logical shape, one of these templates (``L`` = num_layers,
``N`` = num_blocks, ``B`` = block_size, ``H`` = heads, ``D`` = head dim)::

    K/V-first      [(L,) 2, N, B, H, D]   (NHD)    [(L,) 2, N, H, B, D]   (HND)
    blocks-first   [(L,) N, 2, B, H, D]   (NHD)    [(L,) N, 2, H, B, D]   (HND)
    MLA            [(L,) N, B, D]

``strides`` (in elements) give the memory order, as a permuted torch view would:
the physical order lists logical dims from largest stride to smallest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.topology.layout import KVLayout


@dataclass(frozen=True, slots=True)
class CacheLayoutFacts:
    """Where each dimension of a KV cache tensor is, logically and in memory.

    Attributes:
        cross_layers: A leading layers dimension stacks all layers.
        layers_dim: Logical index of the layers dimension, or None.
        kv_dim: Logical index of the size-2 K/V dimension, or None for MLA.
        blocks_dim: Logical index of the num_blocks dimension.
        block_size_dim: Logical index of the block-size (token) dimension.
        heads_dim: Logical index of the heads dimension, or None for MLA.
        feature_dim: Logical index of the head-dim / latent-dim dimension.
        physical_order: Logical dims from outermost to innermost in memory.
        blocks_first: In memory, blocks are outside K/V (always True for MLA).
        block_size_position: Index of the block-size dim in ``physical_order``.
        physical_layout: Token/head order inside a block in memory.
        block_stride: Elements between the starts of consecutive blocks.
        plane_block_contiguous: One block of one plane (K, V or latent) of one
            layer is a dense run of memory, as the read plan's byte ranges assume.
        is_dense: The whole tensor is a dense permutation (no padding, no gaps).
    """

    cross_layers: bool
    layers_dim: int | None
    kv_dim: int | None
    blocks_dim: int
    block_size_dim: int
    heads_dim: int | None
    feature_dim: int
    physical_order: tuple[int, ...]
    blocks_first: bool
    block_size_position: int
    physical_layout: KVLayout
    block_stride: int
    plane_block_contiguous: bool
    is_dense: bool

    @property
    def split_k_and_v(self) -> bool:
        """K and V of a block are separate memory regions (K/V-first, per layer)."""
        return self.kv_dim is not None and not self.blocks_first and not self.cross_layers


def _is_dense(shape: Sequence[int], strides: Sequence[int], dims: Sequence[int]) -> bool:
    """Whether ``dims`` (outermost first) tile a dense run of memory."""
    expected = 1
    for dim in reversed(dims):
        if shape[dim] == 1:
            continue  # a size-1 dim's stride is never used
        if strides[dim] != expected:
            return False
        expected *= shape[dim]
    return True


def _kv_first(first: int, second: int, num_blocks: int | None, hint: bool | None) -> bool:
    """Decide K/V-first vs blocks-first from the two outer per-layer dims."""
    kv_first_ok = first == 2 and (num_blocks is None or second == num_blocks)
    blocks_first_ok = second == 2 and (num_blocks is None or first == num_blocks)
    if hint is not None and (kv_first_ok if hint else blocks_first_ok):
        return hint
    if kv_first_ok and blocks_first_ok:
        raise ConfigError(
            f"cannot tell K/V-first from blocks-first: outer dims are ({first}, {second}); "
            f"pass kv_first"
        )
    if hint is not None or not (kv_first_ok or blocks_first_ok):
        expected = {None: "either order", True: "K/V-first", False: "blocks-first"}[hint]
        raise ConfigError(
            f"outer dims ({first}, {second}) do not fit {expected} with num_blocks {num_blocks}"
        )
    return kv_first_ok


def describe_cache(
    shape: Sequence[int],
    strides: Sequence[int],
    layout: KVLayout,
    is_mla: bool,
    num_layers: int | None = None,
    *,
    block_size: int | None = None,
    num_blocks: int | None = None,
    kv_first: bool | None = None,
) -> CacheLayoutFacts:
    """Describe a KV cache tensor from its logical shape and strides.

    Args:
        shape: Logical shape, one of the module docstring's templates.
        strides: Strides in elements, same length as ``shape``.
        layout: Logical token/head order of ``shape`` (ignored for MLA).
        is_mla: The tensor holds an MLA latent.
        num_layers: If given, a leading dim must equal it to count as cross-layer.
        block_size: If given, the block-size dim must equal it.
        num_blocks: If given, the num_blocks dim must equal it.
        kv_first: If given, the logical order of the K/V and num_blocks dims
            (True: ``[2, num_blocks, ...]``); needed only when both outer dims
            are 2, i.e. a 2-block cache, where the shape cannot tell.

    Returns:
        The :class:`CacheLayoutFacts`.

    Raises:
        ConfigError: the rank fits no template, sizes disagree with the given
            counts or ``kv_first``, strides are negative or of the wrong length,
            or K/V-first and blocks-first cannot be told apart.
    """
    shape, strides = tuple(shape), tuple(strides)
    if len(strides) != len(shape):
        raise ConfigError(f"{len(strides)} strides for a {len(shape)}-dim shape {shape}")
    if any(size < 1 for size in shape) or any(stride < 0 for stride in strides):
        raise ConfigError(f"bad shape {shape} or strides {strides}")
    base_ndim = 3 if is_mla else 5
    if len(shape) not in (base_ndim, base_ndim + 1):
        raise ConfigError(
            f"{'MLA' if is_mla else 'K/V'} cache needs {base_ndim} or {base_ndim + 1} dims, "
            f"got shape {shape}"
        )
    cross_layers = len(shape) == base_ndim + 1
    if cross_layers and num_layers is not None and shape[0] != num_layers:
        raise ConfigError(f"leading dim {shape[0]} of {shape} is not num_layers {num_layers}")
    first = 1 if cross_layers else 0
    if is_mla:
        kv_dim, heads_dim = None, None
        blocks_dim, block_size_dim = first, first + 1
    else:
        is_kv_first = _kv_first(shape[first], shape[first + 1], num_blocks, kv_first)
        kv_dim, blocks_dim = (first, first + 1) if is_kv_first else (first + 1, first)
        token_dim, head_dim = (2, 3) if KVLayout.parse(layout) is KVLayout.NHD else (3, 2)
        block_size_dim, heads_dim = first + token_dim, first + head_dim
    feature_dim = len(shape) - 1
    if block_size is not None and shape[block_size_dim] != block_size:
        raise ConfigError(f"block-size dim of {shape} is {shape[block_size_dim]}, not {block_size}")
    if num_blocks is not None and shape[blocks_dim] != num_blocks:
        raise ConfigError(f"num_blocks dim of {shape} is {shape[blocks_dim]}, not {num_blocks}")

    physical_order = tuple(sorted(range(len(shape)), key=lambda dim: (-strides[dim], dim)))
    position = physical_order.index
    blocks_first = kv_dim is None or position(blocks_dim) < position(kv_dim)
    if heads_dim is None:
        physical_layout = KVLayout.parse(layout)
        in_block = [block_size_dim, feature_dim]
    else:
        token_outer = position(block_size_dim) < position(heads_dim)
        physical_layout = KVLayout.NHD if token_outer else KVLayout.HND
        in_block = [block_size_dim, heads_dim, feature_dim]
    in_block.sort(key=position)
    # Dense among themselves is enough: other dims then only choose which run.
    plane_block_contiguous = _is_dense(shape, strides, in_block)
    return CacheLayoutFacts(
        cross_layers=cross_layers,
        layers_dim=0 if cross_layers else None,
        kv_dim=kv_dim,
        blocks_dim=blocks_dim,
        block_size_dim=block_size_dim,
        heads_dim=heads_dim,
        feature_dim=feature_dim,
        physical_order=physical_order,
        blocks_first=blocks_first,
        block_size_position=position(block_size_dim),
        physical_layout=physical_layout,
        block_stride=strides[blocks_dim],
        plane_block_contiguous=plane_block_contiguous,
        is_dense=_is_dense(shape, strides, physical_order),
    )
