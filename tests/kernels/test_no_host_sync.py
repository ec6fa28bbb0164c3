"""On CUDA, pack and unpack given host block ids make the host wait for nothing (issue #41).

Block ids are checked on the host and copied over once without waiting; the
layers' offset tables stay on the device after the first launch on a cache set.
torch's sync debug mode turns any wait torch makes the host do into an error:
a GPU run only (``KVBRIDGE_TEST_DEVICE=cuda``). The offset tables' memo runs
everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvbridge.kernels import pack, packed_format, triton_kernels, unpack
from kvbridge.topology import KVLayout
from tests.kernels import reference
from tests.kernels.helpers import DEVICE, CacheSpec, clone, random_caches, same_bytes

NHD, HND = KVLayout.NHD, KVLayout.HND


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Any torch call inside that makes the host wait for the device raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host syncs: GPU runs only")
def test_pack_and_unpack_launch_without_waiting() -> None:
    remote, local = CacheSpec(NHD, 16, num_heads=4), CacheSpec(HND, 8, num_heads=8)
    src, dst = random_caches(remote, 0), random_caches(local, 1)
    fmt = packed_format(src, NHD, 0, 4)
    staging = torch.empty(fmt.nbytes(3), dtype=torch.uint8, device=DEVICE)
    ids, local_ids = [5, 1, 7], [3, 0, 9, 4, 11, 2]
    for warm_up in (True, False):  # the first launch compiles and makes the offset tables
        expected = clone(dst)
        with contextlib.nullcontext() if warm_up else no_host_sync():
            buf = pack(src, ids, 0, 4, NHD, out=staging)
            unpack(buf, fmt, 3, dst, local_ids, HND, head_offset=4, num_tokens=45)
        torch.cuda.synchronize()
        want = reference.pack(src, ids, 0, 4, NHD)
        assert torch.equal(buf, want)
        reference.unpack(want, fmt, 3, expected, local_ids, HND, 4, 45, 0)
        assert same_bytes(dst, expected)


def test_a_cache_sets_offset_table_is_made_once_and_follows_the_caches() -> None:
    layers = random_caches(CacheSpec(NHD, 4, num_heads=2, num_layers=3), 0)
    assert isinstance(layers, list)
    table = triton_kernels._layer_offsets(layers)
    assert triton_kernels._layer_offsets(layers) is table  # kept, not made again
    word = layers[0].element_size()
    assert table.tolist() == [(t.data_ptr() - layers[0].data_ptr()) // word for t in layers]
    assert table.device == layers[0].device
    moved = [t.clone() for t in reversed(layers)]  # other memory: another table
    other = triton_kernels._layer_offsets(moved)
    assert other is not table
    assert other.tolist() == [(t.data_ptr() - moved[0].data_ptr()) // word for t in moved]
