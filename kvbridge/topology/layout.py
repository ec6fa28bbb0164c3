"""KV cache memory layouts shared by topology, kernels and transfer.

Per layer, K and V::

    NHD  [2, num_blocks, block_size, num_kv_heads, head_dim]
    HND  [2, num_blocks, num_kv_heads, block_size, head_dim]

MLA keeps one latent per token: ``[num_blocks, block_size, latent_dim]``.

vLLM's CPU backend fuses K and V into one plane per layer (``fused_kv`` in
``EngineTopology``), always heads outer::

    fused  [num_blocks, num_kv_heads, block_size, 2 * head_dim]
           per block and head: K^T [head_dim, block_size] | V [block_size, head_dim]

kvbridge treats its last dim as one "row" per head and token slot (HND, one
plane), which is exact for whole blocks and head slices only: K is not
token-major, so such blocks are never re-blocked or relaid out.

SGLang keeps K and V of each layer in two tensors (``split_kv`` in
``EngineTopology``): every entry of the layer list is one plane, NHD, and the
list alternates K and V::

    split  [num_blocks, block_size, num_kv_heads, head_dim]   K0, V0, K1, V1, ...

kvbridge treats each entry as a layer of one plane (``[1, ...]`` NHD). It is
token-major, so it converts block sizes and takes head slices as NHD does.
"""

from __future__ import annotations

from enum import StrEnum


class KVLayout(StrEnum):
    """Order of the token and head dimensions inside one block."""

    NHD = "NHD"
    HND = "HND"

    @classmethod
    def parse(cls, value: str | KVLayout) -> KVLayout:
        """Return the layout named by ``value`` (case-insensitive).

        Raises:
            ValueError: ``value`` names no layout.
        """
        try:
            return cls(str(value).upper())
        except ValueError:
            raise ValueError(
                f"unknown KV cache layout {value!r}; expected one of "
                f"{[m.value for m in cls]}"
            ) from None


def planes_per_block(is_mla: bool, fused_kv: bool, split_kv: bool) -> int:
    """Planes one block of one layer entry holds: K and V (2), or one (an MLA latent,
    a fused K/V plane, a split cache's K or V)."""
    return 1 if is_mla or fused_kv or split_kv else 2
