"""vLLM's KV cache groups as kvbridge reads them (``integrations/vllm/groups.py``), no server.

The specs are stand-ins named as vLLM's classes (the module reads only names
and attributes); the caches are real tensors sharing one buffer, as vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.groups import cache_groups, registered_caches
from kvbridge.topology import CacheGroup


@dataclass
class AttentionSpec:
    block_size: int = 32


@dataclass
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None


class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 96


@dataclass
class ChunkedLocalAttentionSpec(AttentionSpec):
    attention_chunk_size: int = 64


@dataclass
class MambaSpec:
    block_size: int = 32
    num_speculative_blocks: int = 0


@dataclass
class Group:
    kv_cache_spec: Any
    layer_names: list[str] = field(default_factory=lambda: ["layer"])


@dataclass
class Config:
    transfer_groups: list[Group]


def test_groups_of_each_kind() -> None:
    config = Config([Group(SlidingWindowSpec()), Group(FullAttentionSpec()), Group(MambaSpec()),
                     Group(MLAAttentionSpec()), Group(FullAttentionSpec(sliding_window=96))])
    kinds = [(g.kind, g.window) for g in cache_groups(config, 32)]
    # a sliding window made full attention (the hybrid manager off) keeps every block
    assert kinds == [("window", 96), ("tokens", 0), ("state", 0), ("tokens", 0), ("tokens", 0)]
    assert cache_groups(config, 32)[0] == CacheGroup("window", 96, "sliding window 96")


@pytest.mark.parametrize(("spec", "match"), [
    (ChunkedLocalAttentionSpec(), "--disable-hybrid-kv-cache-manager"),
    (MambaSpec(num_speculative_blocks=2), "speculative"),
    (FullAttentionSpec(block_size=16), "block size 16"),
])
def test_groups_kvbridge_cannot_move_stop_the_start(spec: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        cache_groups(Config([Group(FullAttentionSpec()), Group(spec)]), 32)


def test_a_shared_buffer_is_registered_once_through_its_attention_view() -> None:
    pages, page = 6, 2 * 4 * 8 * 2  # 2 heads x block 4 x row 8, bf16
    buffer = torch.zeros(pages * page, dtype=torch.uint8)
    attention = buffer.view(torch.bfloat16).view(pages, 2, 4, 8)
    state = buffer.view(pages, page)[:, : page - 16]  # a strided state view (padded pages)
    got = registered_caches({"l0.mamba": state, "l1.attn": attention, "l2.mamba": [state]})
    assert len(got) == 1 and got[0].data_ptr() == attention.data_ptr()
    assert got[0].shape == attention.shape


def test_a_buffer_only_states_live_in_gets_an_attention_shaped_view() -> None:
    pages, page = 6, 2 * 4 * 8 * 2
    first, second = (torch.zeros(pages * page, dtype=torch.uint8) for _ in range(2))
    attention = first.view(torch.bfloat16).view(pages, 2, 4, 8)
    state = second.view(pages, page)[:, : page - 16]
    got = registered_caches({"l0.attn": attention, "l1.mamba": state})
    assert [t.data_ptr() for t in got] == [attention.data_ptr(), second.data_ptr()]
    assert got[1].shape == attention.shape and got[1].dtype == attention.dtype
    got[1][2] = 1.0  # page 2 of the state buffer, through the view
    assert bool(second.view(pages, page)[2].any()) and not second.view(pages, page)[1].any()
    with pytest.raises(ConfigError, match="no attention"):
        registered_caches({"l1.mamba": state})
