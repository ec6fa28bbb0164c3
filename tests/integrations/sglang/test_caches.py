"""SGLang's KV pool as kvbridge registers it (``integrations/sglang/caches.py``).

SGLang hands a backend addresses (``KVArgs``); the tests build that ``KVArgs``
(a ``SimpleNamespace``) from real CPU tensors laid out as SGLang's pools lay
them out, so no SGLang is needed:

    MHA (MHATokenToKVPool), L layers: K0 .. K(L-1) V0 .. V(L-1), each
        [size + page_size, heads, head_dim] (SGLang pads one page: rows = pages * page_size)
    MLA (MLATokenToKVPool): one [size + page_size, 1, kv_lora_rank + rope_dim] per layer

The default finder looks tensors up by address among live objects, so each test
keeps its tensors alive (``Pool.buffers``) while ``sglang_caches`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.integrations.sglang.caches import find_tensors, sglang_caches
from kvbridge.topology import KVLayout

MODEL = "tiny-llama@rev1"


@dataclass
class Pool:
    """SGLang-like buffers and the ``KVArgs`` that describes them."""

    buffers: list[torch.Tensor]
    kv_args: SimpleNamespace
    num_pages: int  # pages of each buffer, SGLang's padding page included


def mha_pool(*, num_layers: int = 2, size_pages: int = 3, page_size: int = 4, heads: int = 2,
             head_dim: int = 8, total_heads: int | None = None,
             dtype: torch.dtype = torch.float16, **extra: Any) -> Pool:
    """Every layer's K buffer then every layer's V buffer, each with distinct values."""
    rows = size_pages * page_size + page_size
    buffers = [(torch.arange(rows * heads * head_dim) + 1000 * i).to(dtype)
               .view(rows, heads, head_dim) for i in range(2 * num_layers)]
    return Pool(buffers, _kv_args(buffers, page_size, heads, total_heads or heads, **extra),
                size_pages + 1)


def mla_pool(*, num_layers: int = 3, size_pages: int = 2, page_size: int = 16,
             latent_dim: int = 576, dtype: torch.dtype = torch.bfloat16) -> Pool:
    rows = size_pages * page_size + page_size
    buffers = [torch.full((rows, 1, latent_dim), float(i), dtype=dtype)
               for i in range(num_layers)]
    return Pool(buffers, _kv_args(buffers, page_size, 1, 1), size_pages + 1)


def _kv_args(buffers: Sequence[torch.Tensor], page_size: int, heads: int, total_heads: int,
             **extra: Any) -> SimpleNamespace:
    _, _, head_dim = buffers[0].shape
    fields: dict[str, Any] = dict(
        kv_data_ptrs=[t.data_ptr() for t in buffers],
        kv_data_lens=[t.nbytes for t in buffers],
        kv_item_lens=[page_size * heads * head_dim * buffers[0].element_size()] * len(buffers),
        page_size=page_size, kv_head_num=heads, total_kv_head_num=total_heads,
        state_types=[], num_draft_entries=0, kv_layout=None)
    return SimpleNamespace(**{**fields, **extra})


def finder_of(buffers: Sequence[torch.Tensor], calls: list[Any]) -> Any:
    """A ``find=`` callable over ``buffers`` that records what it was asked."""
    by_ptr = {t.data_ptr(): t for t in buffers}

    def find(pointers: Sequence[int], nbytes: Sequence[int]) -> list[torch.Tensor]:
        calls.append((list(pointers), list(nbytes)))
        return [by_ptr[p] for p in pointers]

    return find


@pytest.mark.parametrize("explicit_finder", [False, True], ids=["find_tensors", "find="])
def test_mha_planes_alias_sglang_buffers_in_split_kv_order(explicit_finder: bool) -> None:
    pool = mha_pool(num_layers=3, size_pages=3, page_size=4, heads=2, head_dim=8)
    calls: list[Any] = []
    options = {"find": finder_of(pool.buffers, calls)} if explicit_finder else {}
    caches = sglang_caches(pool.kv_args, is_mla=False, attn_tp_size=1, model_id=MODEL,
                           **options)

    assert caches.num_pages == pool.num_pages == 4
    ks, vs = pool.buffers[:3], pool.buffers[3:]
    assert len(caches.planes) == 6
    for layer in range(3):
        for plane, buffer in ((caches.planes[2 * layer], ks[layer]),
                              (caches.planes[2 * layer + 1], vs[layer])):
            assert plane.shape == (4, 4, 2, 8) and plane.dtype == torch.float16
            assert plane.data_ptr() == buffer.data_ptr()
            assert torch.equal(plane.reshape(-1, 2, 8), buffer)
    if explicit_finder:
        item_nbytes = 4 * 2 * 8 * 2
        assert calls == [(pool.kv_args.kv_data_ptrs, [4 * item_nbytes] * 6)]


def test_writing_a_plane_writes_the_sglang_buffer_at_its_token_rows() -> None:
    pool = mha_pool(num_layers=2, size_pages=3, page_size=4, heads=2, head_dim=8)
    before = [t.clone() for t in pool.buffers]
    caches = sglang_caches(pool.kv_args, is_mla=False, attn_tp_size=1, model_id=MODEL)
    caches.planes[3][2, 1] = -7.0  # V of layer 1, page 2, token 1 of the page
    v1 = pool.buffers[3]
    assert torch.equal(v1[2 * 4 + 1], torch.full((2, 8), -7.0, dtype=torch.float16))
    v1[2 * 4 + 1] = before[3][2 * 4 + 1]
    for buffer, old in zip(pool.buffers, before, strict=True):
        assert torch.equal(buffer, old)  # nothing else was written


def test_mha_topology_and_compat() -> None:
    pool = mha_pool(num_layers=2, page_size=4, heads=2, head_dim=8, dtype=torch.bfloat16)
    caches = sglang_caches(pool.kv_args, is_mla=False, attn_tp_size=1, model_id=MODEL)
    top = caches.topology
    assert (top.tp_size, top.pp_size, top.block_size) == (1, 1, 4)
    assert (top.num_layers, top.num_kv_heads, top.num_heads_per_rank) == (4, 2, 2)
    assert top.split_kv and not top.is_mla and not top.fused_kv
    assert top.layout == KVLayout.NHD
    compat = caches.compat
    assert (compat.model, compat.dtype) == (MODEL, "bfloat16")
    assert (compat.num_kv_heads, compat.head_dim, compat.num_layers, compat.block_size) == (
        2, 8, 4, 4)
    assert compat.split_kv and not compat.is_mla and compat.layout == KVLayout.NHD


def test_attention_tp_2_holds_half_the_heads_per_rank() -> None:
    pool = mha_pool(heads=2, total_heads=4)  # this rank's 2 of the model's 4 KV heads
    caches = sglang_caches(pool.kv_args, is_mla=False, attn_tp_size=2, model_id=MODEL)
    assert (caches.topology.tp_size, caches.topology.num_kv_heads) == (2, 4)
    assert caches.topology.num_heads_per_rank == 2
    assert caches.compat.num_kv_heads == 4  # the whole model's, as P and D must agree
    assert caches.planes[0].shape[2] == 2


def test_total_heads_default_to_rank_heads_times_tp() -> None:
    pool = mha_pool(heads=2, total_kv_head_num=None)
    caches = sglang_caches(pool.kv_args, is_mla=False, attn_tp_size=2, model_id=MODEL)
    assert caches.topology.num_kv_heads == 4


@pytest.mark.parametrize("explicit_finder", [False, True], ids=["find_tensors", "find="])
def test_mla_planes_and_topology(explicit_finder: bool) -> None:
    pool = mla_pool(num_layers=3, size_pages=2, page_size=16, latent_dim=576)
    options = {"find": finder_of(pool.buffers, [])} if explicit_finder else {}
    caches = sglang_caches(pool.kv_args, is_mla=True, attn_tp_size=2, model_id=MODEL,
                           **options)
    assert caches.num_pages == 3
    assert [p.shape for p in caches.planes] == [(3, 16, 576)] * 3
    for plane, buffer in zip(caches.planes, pool.buffers, strict=True):
        assert plane.data_ptr() == buffer.data_ptr()
        assert torch.equal(plane.reshape(-1, 1, 576), buffer)
    caches.planes[1][2, 15] = 5.0
    assert torch.equal(pool.buffers[1][2 * 16 + 15, 0], torch.full((576,), 5.0,
                                                                   dtype=torch.bfloat16))
    top = caches.topology
    assert top.is_mla and not top.split_kv
    assert (top.num_layers, top.num_kv_heads, top.num_heads_per_rank, top.tp_size) == (
        3, 1, 1, 2)
    compat = caches.compat
    assert (compat.is_mla, compat.split_kv, compat.head_dim, compat.num_layers) == (
        True, False, 576, 3)
    assert (compat.num_kv_heads, compat.dtype) == (1, "bfloat16")


class _StateType(Enum):  # SGLang's StateType values
    MAMBA = "mamba"
    SWA = "swa"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"state_types": [_StateType.MAMBA, _StateType.SWA]},
         rf"{MODEL}.*mamba, swa.*--disaggregation-transfer-backend mooncake"),
        ({"num_draft_entries": 2}, rf"{MODEL}.*--speculative-algorithm"),
        ({"kv_layout": "HND"}, "layout 'HND'.*NHD"),
        ({"kv_layout": "page_first"}, "layout 'page_first'"),
    ],
    ids=["state", "draft", "hnd", "page-first"],
)
def test_what_kvbridge_cannot_move_is_refused_with_the_setting(extra: dict[str, Any],
                                                               named: str) -> None:
    pool = mha_pool(**extra)
    with pytest.raises(ConfigError, match=named):
        sglang_caches(pool.kv_args, is_mla=False, attn_tp_size=1, model_id=MODEL)


def test_refused_pool_shapes() -> None:
    pool = mha_pool(num_layers=2)
    args = pool.kv_args

    def refused(match: str, **changes: Any) -> None:
        with pytest.raises(ConfigError, match=match):
            sglang_caches(SimpleNamespace(**{**vars(args), **changes}), is_mla=False,
                          attn_tp_size=1, model_id=MODEL)

    refused("3 MHA buffers", kv_data_ptrs=args.kv_data_ptrs[:3],
            kv_data_lens=args.kv_data_lens[:3], kv_item_lens=args.kv_item_lens[:3])
    refused("item sizes", kv_item_lens=[*args.kv_item_lens[:3], args.kv_item_lens[0] * 2])
    refused("0 addresses", kv_data_ptrs=[], kv_data_lens=[], kv_item_lens=[])
    refused("page of 128 bytes != 2 tokens", page_size=2)
    refused(r"no contiguous tensor at 1 of .*0x8\b.*--disaggregation-transfer-backend",
            kv_data_ptrs=[*args.kv_data_ptrs[:3], 8])


def test_heads_inconsistent_with_tp_are_refused() -> None:
    pool = mha_pool(heads=2, total_heads=8)  # 8 heads over TP 2 would be 4 per rank
    with pytest.raises(ConfigError, match="holds 2 KV heads; 8 heads over attention TP 2"):
        sglang_caches(pool.kv_args, is_mla=False, attn_tp_size=2, model_id=MODEL)
    odd = mha_pool(heads=2, total_heads=3)
    with pytest.raises(ConfigError, match="tp_size 2 and num_kv_heads 3"):
        sglang_caches(odd.kv_args, is_mla=False, attn_tp_size=2, model_id=MODEL)


def test_buffers_of_different_dtypes_or_rows_are_refused() -> None:
    pool = mha_pool(num_layers=1)
    other = pool.buffers[1].to(torch.float32)
    args = SimpleNamespace(**{**vars(pool.kv_args), "kv_data_ptrs": [
        pool.buffers[0].data_ptr(), other.data_ptr()]})
    with pytest.raises(ConfigError, match="differ in dtype or row shape"):
        sglang_caches(args, is_mla=False, attn_tp_size=1, model_id=MODEL,
                      find=finder_of([pool.buffers[0], other], []))


def test_mla_buffers_with_several_heads_are_refused() -> None:
    rows, latent = 8, 64
    buffers = [torch.zeros(rows, 2, latent) for _ in range(2)]
    args = _kv_args(buffers, page_size=4, heads=2, total_heads=2)
    with pytest.raises(ConfigError):
        sglang_caches(args, is_mla=True, attn_tp_size=1, model_id=MODEL)


def test_find_tensors_prefers_the_3d_buffer_to_the_flat_arena_it_starts() -> None:
    rows, heads, head_dim = 12, 2, 8
    arena = torch.zeros(4 * rows * heads * head_dim, dtype=torch.float16)
    buffer = arena[: rows * heads * head_dim].view(rows, heads, head_dim)
    found = find_tensors([buffer.data_ptr()], [buffer.nbytes])
    assert len(found) == 1 and found[0].shape == (rows, heads, head_dim)
    assert found[0].data_ptr() == arena.data_ptr()
    # Asked for more than the 3-D view holds, only the arena is big enough.
    assert find_tensors([arena.data_ptr()], [buffer.nbytes + 2])[0].dim() == 1
    assert buffer is not None  # alive until here: find_tensors looks it up by address


def test_find_tensors_refuses_addresses_of_no_live_tensor() -> None:
    t = torch.zeros(8, 2, 4)
    with pytest.raises(ConfigError, match="no contiguous tensor at 1 of"):
        find_tensors([t.data_ptr(), t.data_ptr() + 4], [t.nbytes, 4])
    with pytest.raises(ConfigError, match="no contiguous tensor"):  # too small
        find_tensors([t.data_ptr()], [t.nbytes + 1])
    base = torch.zeros(8, 4)
    column = base[:, 1]  # not contiguous, and no other tensor starts where it does
    with pytest.raises(ConfigError, match="no contiguous tensor"):
        find_tensors([column.data_ptr()], [4])
    assert find_tensors([t.data_ptr()], [t.nbytes])[0] is t
