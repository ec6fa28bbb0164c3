"""Property tests: random transfer shapes, the kernels agree with the reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.kernels import Impl
from kvbridge.topology import KVLayout
from tests.kernels.checks import check_transfer
from tests.kernels.helpers import CacheSpec


@st.composite
def transfers(draw: st.DrawFn) -> dict[str, object]:
    remote_bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    local_bs = draw(
        st.sampled_from(
            [b for b in (1, 2, 4, 8, 16, 32) if b % remote_bs == 0 or remote_bs % b == 0]
        )
    )
    mla = draw(st.booleans())
    remote_heads = 1 if mla else draw(st.integers(1, 4))
    head_start = 0 if mla else draw(st.integers(0, remote_heads - 1))
    head_end = 1 if mla else draw(st.integers(head_start + 1, remote_heads))
    local_heads = 1 if mla else draw(st.integers(head_end - head_start, 5))
    num_remote = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float16, torch.float32, torch.uint8, torch.bfloat16]))
    return {
        "remote": CacheSpec(
            draw(st.sampled_from(list(KVLayout))),
            remote_bs,
            remote_heads,
            head_dim=draw(st.sampled_from([1, 4, 6, 16])),
            num_blocks=8,
            mla=mla,
            dtype=dtype,
            num_layers=draw(st.integers(1, 3)),
        ),
        "local": (draw(st.sampled_from(list(KVLayout))), local_bs, local_heads),
        "head_start": head_start,
        "head_end": head_end,
        "head_offset": draw(st.integers(0, local_heads - (head_end - head_start))),
        "num_remote_blocks": num_remote,
        "drop_tokens": draw(st.integers(0, num_remote * remote_bs - 1)),
        "token_offset": draw(st.integers(0, 2 * local_bs)),
        "seed": draw(st.integers(0, 1000)),
    }


def _run(impl: Impl, case: dict[str, object]) -> None:
    remote = case.pop("remote")
    local_shape = case.pop("local")
    assert isinstance(remote, CacheSpec)
    assert isinstance(local_shape, tuple)
    layout, block_size, heads = local_shape
    local = CacheSpec(
        layout, block_size, heads, head_dim=remote.head_dim, num_blocks=70, mla=remote.mla,
        dtype=remote.dtype, num_layers=remote.num_layers,
    )  # fmt: skip
    check_transfer(impl, remote, local, **case)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(transfers())
def test_torch_path_matches_reference(case: dict[str, object]) -> None:
    _run("torch", case)


@settings(max_examples=25, deadline=None)
@given(transfers())
def test_triton_kernels_match_reference(case: dict[str, object]) -> None:
    _run("triton", case)
