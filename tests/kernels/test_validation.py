"""Bad input raises KernelInputError (a ValueError) naming the values, and writes nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.kernels import (
    KernelInputError,
    PackedFormat,
    copy_blocks,
    pack,
    packed_format,
    unpack,
)
from kvbridge.topology import KVLayout
from tests.kernels.helpers import CacheSpec, clone, random_caches, same_bytes

NHD, HND = KVLayout.NHD, KVLayout.HND
SPEC = CacheSpec(NHD, 4, num_heads=4, head_dim=8, num_blocks=10)


def caches() -> list[torch.Tensor]:
    result = random_caches(SPEC, 0)
    assert isinstance(result, list)
    return result


def packed() -> tuple[torch.Tensor, PackedFormat]:
    src = caches()
    return pack(src, [1, 2], 0, 4, NHD), packed_format(src, NHD, 0, 4)


def test_error_type_is_a_value_error() -> None:
    assert issubclass(KernelInputError, ConfigError)
    assert issubclass(KernelInputError, ValueError)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c: pack(c, [3, 10], 0, 4, NHD), r"\[3, 10\].*10 blocks"),
        (lambda c: pack(c, [-1], 0, 4, NHD), r"\[-1, -1\]"),
        (lambda c: pack(c, torch.tensor([1.0]), 0, 4, NHD), "integer tensor"),
        (lambda c: pack(c, [[1, 2]], 0, 4, NHD), "flat sequence of ints"),  # type: ignore[list-item]
        (lambda c: pack(c, [1], 2, 5, NHD), r"\[2, 5\).*4 heads"),
        (lambda c: pack(c, [1], 3, 3, NHD), r"\[3, 3\)"),
        (lambda c: pack(c, [1], 0, 4, "XYZ"), "unknown KV cache layout"),  # type: ignore[arg-type]
        (lambda c: pack(c, [1], 0, 4, NHD, impl="cuda"), "impl must be"),  # type: ignore[arg-type]
        (
            lambda c: pack(c, [1, 2], 0, 4, NHD, out=torch.empty(100, dtype=torch.uint8)),
            "100 bytes",
        ),
        (
            lambda c: pack(c, [1], 0, 4, NHD, out=torch.empty(4096, dtype=torch.uint8)[1:]),
            "aligned",
        ),
        (lambda c: pack(c, [1], 0, 4, NHD, out=torch.empty(64, 64)[:, ::2]), "contiguous"),
        (lambda c: pack([], [1], 0, 4, NHD), "no layer tensors"),
        (lambda c: pack([c[0], c[1].float()], [1], 0, 4, NHD), r"float32.*float16"),
        (lambda c: pack([t.transpose(-1, -2) for t in c], [1], 0, 4, NHD), "stride 1"),
        (lambda c: pack([t[0] for t in c], [1], 0, 4, NHD), "5-D .* or 3-D"),
        (lambda c: pack([torch.cat([t, t]) for t in c], [1], 0, 4, NHD), "must be 2, got 4"),
        (lambda c: pack([t.to(torch.complex64) for t in c], [1], 0, 4, NHD), "unsupported dtype"),
    ],
)
def test_pack_rejects(call: Callable[[list[torch.Tensor]], object], match: str) -> None:
    c = caches()
    with pytest.raises(KernelInputError, match=match):
        call(c)


def _unpack(**overrides: object) -> None:
    buf, fmt = packed()
    args: dict[str, object] = {
        "buf": buf, "fmt": fmt, "num_remote_blocks": 2, "layer_caches": overrides.pop("dst"),
        "local_block_ids": [0, 1], "local_layout": NHD, "head_offset": 0,
    }  # fmt: skip
    args.update(overrides)
    unpack(**args)  # type: ignore[arg-type]


def _wire(**changes: object) -> PackedFormat:
    base = {"layout": NHD, "block_size": 4, "num_heads": 4, "head_dim": 8, "elem_nbytes": 2,
            "num_layers": 2}  # fmt: skip
    base.update(changes)
    return PackedFormat(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"local_block_ids": [0, 10]}, r"\[0, 10\].*10 blocks"),
        ({"local_block_ids": [0]}, "need 2 local block ids"),
        ({"local_block_ids": [3, 3]}, "repeat a destination block"),
        ({"fmt": _wire(head_dim=16)}, "head_dim remote 16 local 8"),
        ({"fmt": _wire(elem_nbytes=4)}, "elem_nbytes remote 4 local 2"),
        ({"fmt": _wire(num_layers=3)}, "num_layers remote 3 local 2"),
        ({"fmt": _wire(block_size=6)}, "remote block size 6 and local block size 4"),
        ({"fmt": _wire(block_size=3)}, "neither divides"),
        ({"fmt": _wire(num_heads=2), "head_offset": 3}, "2 remote heads at head_offset 3"),
        ({"head_offset": -1}, "head_offset -1"),
        ({"num_tokens": 9}, r"num_tokens 9 outside \[0, 8\]"),
        ({"token_offset": -2}, "token_offset"),
        (
            {"num_remote_blocks": 3, "local_block_ids": [0, 1, 2]},
            "buf holds 2048 bytes, 3072 needed",
        ),
        ({"buf": torch.zeros(64, dtype=torch.float32)}, "neither uint8 nor torch.float16"),
        ({"buf": torch.zeros(512, dtype=torch.uint8)[::2]}, "contiguous"),
        ({"fmt": "NHD"}, "PackedFormat"),
    ],
)
def test_unpack_rejects_and_writes_nothing(overrides: dict[str, object], match: str) -> None:
    dst = caches()
    before = clone(dst)
    with pytest.raises(KernelInputError, match=match):
        _unpack(dst=dst, **overrides)
    assert same_bytes(dst, before)


def test_unpack_rejects_mla_wire_for_kv_caches() -> None:
    fmt = PackedFormat(NHD, 4, 1, 8, 2, 2, is_mla=True)
    with pytest.raises(KernelInputError, match="is_mla remote True local False"):
        unpack(torch.zeros(1024, dtype=torch.uint8), fmt, 1, caches(), [0], NHD)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_ids": [1, 12]}, r"\[1, 12\]"),
        ({"block_ids": [1, 2], "dst_block_ids": [3]}, "2 source block ids but 1"),
        ({"block_ids": [1, 2], "dst_block_ids": [4, 4]}, "repeat a destination block"),
    ],
)
def test_copy_blocks_rejects(kwargs: dict[str, object], match: str) -> None:
    src, dst = caches(), caches()
    with pytest.raises(KernelInputError, match=match):
        copy_blocks(src, dst, **kwargs)  # type: ignore[arg-type]


def test_copy_blocks_rejects_mismatched_caches() -> None:
    src = caches()
    with pytest.raises(KernelInputError, match="differ"):
        copy_blocks(src, [t[:, :5] for t in src], [1])
    with pytest.raises(KernelInputError, match="float16 and dst dtype torch.bfloat16"):
        copy_blocks(src, [t.view(torch.bfloat16) for t in src], [1])


def test_forced_triton_without_interpreter_or_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU can run Triton for real")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelInputError, match="TRITON_INTERPRET=1"):
        pack(caches(), [1], 0, 4, NHD, impl="triton")


@pytest.mark.parametrize(
    "changes",
    [{"block_size": 0}, {"num_heads": -1}, {"elem_nbytes": 3}, {"is_mla": True}],
)
def test_packed_format_rejects(changes: dict[str, object]) -> None:
    with pytest.raises(KernelInputError):
        _wire(**changes)


def test_packed_format_sizes() -> None:
    fmt = _wire()
    assert fmt.payload_nbytes == 4 * 4 * 8 * 2
    assert fmt.block_nbytes == 2 * 2 * fmt.payload_nbytes
    assert fmt.nbytes(3) == 3 * fmt.block_nbytes
    with pytest.raises(KernelInputError):
        fmt.nbytes(-1)
