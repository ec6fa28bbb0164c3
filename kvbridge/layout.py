"""KV cache memory layouts shared by topology, kernels and transfer.

Per layer, K and V::

    NHD  [2, num_blocks, block_size, num_kv_heads, head_dim]
    HND  [2, num_blocks, num_kv_heads, block_size, head_dim]

MLA keeps one latent per token: ``[num_blocks, block_size, latent_dim]``.
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
