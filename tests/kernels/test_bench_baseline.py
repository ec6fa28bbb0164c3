"""The benchmark's three-pass baseline really does the reference's fix (else its GB/s mislead)."""

from __future__ import annotations

import pytest
import torch

from kvbridge.bench.kernel_bench import _three_pass
from kvbridge.kernels import pack, packed_format, unpack
from kvbridge.topology import KVLayout
from tests.kernels.helpers import CacheSpec, random_caches
from tests.kernels.reference import as_layers, raw

NHD, HND = KVLayout.NHD, KVLayout.HND


@pytest.mark.parametrize(
    ("remote", "local"),
    [((HND, 4), (NHD, 4)), ((HND, 4), (HND, 8)), ((HND, 2), (NHD, 8))],
)
def test_three_pass_matches_unpack(
    remote: tuple[KVLayout, int], local: tuple[KVLayout, int]
) -> None:
    ratio = local[1] // remote[1]
    p_spec = CacheSpec(remote[0], remote[1], num_heads=3, head_dim=8, num_blocks=20)
    d_spec = CacheSpec(local[0], local[1], num_heads=3, head_dim=8, num_blocks=6)
    source = random_caches(p_spec, 0)
    p_ids = torch.randperm(20, generator=torch.Generator().manual_seed(0))[: 4 * ratio].tolist()
    d_ids = torch.tensor([3, 0, 5, 1])
    buf = pack(source, p_ids, 0, 3, remote[0])
    ours = random_caches(d_spec, 1)
    unpack(buf, packed_format(source, remote[0], 0, 3), len(p_ids), ours, d_ids, local[0])

    # what a direct RDMA write leaves behind: each local block holds `ratio` remote
    # payloads back to back, in the remote layout; then the three passes fix it
    landed = random_caches(d_spec, 1)
    payloads = buf.view(len(as_layers(landed)), 2, len(d_ids), -1)
    for layer, per_layer in zip(as_layers(landed), payloads, strict=True):
        for kv in range(2):
            for j, block_id in enumerate(d_ids.tolist()):
                raw(layer)[kv, block_id].view(-1).view(torch.uint8).copy_(per_layer[kv, j])
        _three_pass(layer, d_ids, remote, local)

    for got, want in zip(as_layers(landed), as_layers(ours), strict=True):
        assert torch.equal(raw(got)[:, d_ids], raw(want)[:, d_ids])
