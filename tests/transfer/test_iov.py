"""``iov_array`` (ranges of a direct read) and the typed errors of libucp requests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.transfer.errors import PeerClosedError, ProtocolError
from kvbridge.transfer.ucx.iov import iov_array
from kvbridge.transfer.ucx.ucp_lib import UcpError, UcpLibrary, UcpRequest


def test_scattered_ranges_are_kept_in_order() -> None:
    out = iov_array([3000, 1000, 5000], [100, 100, 100])
    assert out.dtype == np.uint64
    assert out.tolist() == [[3000, 100], [1000, 100], [5000, 100]]


def test_adjacent_ranges_merge() -> None:
    #  [1000, 1100) [1100, 1300) | [4000, 4050) | [4050, 4100) [4100, 4200)
    out = iov_array([1000, 1100, 4000, 4050, 4100], [100, 200, 50, 50, 100])
    assert out.tolist() == [[1000, 300], [4000, 200]]
    assert out.flags.c_contiguous and out.shape == (2, 2)


def test_touching_out_of_order_does_not_merge() -> None:
    # the second range ends where the first starts: stream order would break
    assert iov_array([1100, 1000], [100, 100]).tolist() == [[1100, 100], [1000, 100]]


@pytest.mark.parametrize(("addresses", "lengths"), [([], []), ([1, 2], [3]), ([1], [0])])
def test_bad_ranges_are_refused(addresses: list[int], lengths: list[int]) -> None:
    with pytest.raises(ValueError, match="range"):
        iov_array(addresses, lengths)


@given(st.lists(st.tuples(st.integers(0, 64), st.integers(1, 64)), min_size=1, max_size=40))
def test_merging_keeps_the_byte_stream(pieces: list[tuple[int, int]]) -> None:
    """Whatever merges, the bytes named (in order) are the same as before."""
    addresses, lengths, cursor = [], [], 0
    for gap, length in pieces:
        cursor += gap
        addresses.append(cursor)
        lengths.append(length)
        cursor += length

    def stream(ranges: np.ndarray) -> list[int]:
        return [b for address, length in ranges.tolist() for b in range(address, address + length)]

    merged = iov_array(addresses, lengths)
    assert stream(merged) == stream(np.array(list(zip(addresses, lengths, strict=True))))
    assert len(merged) == 1 + sum(gap > 0 for gap, _ in pieces[1:])


@pytest.fixture(scope="module")
def lib() -> UcpLibrary:
    import ucxx._lib.libucxx  # noqa: F401  (loads the libucp this binding attaches to)

    return UcpLibrary()


@pytest.mark.parametrize(("status", "kind", "text"), [
    (-9, ProtocolError, "larger than the posted buffer"),
    (-16, PeerClosedError, "canceled"),
    (-25, PeerClosedError, "Connection reset"),
    (-2, UcpError, "No resources"),
])
def test_failed_request_raises_a_typed_error(
    lib: UcpLibrary, status: int, kind: type[Exception], text: str
) -> None:
    request = UcpRequest(lib, (1 << 64) + status, "recv from peer", None)  # UCS_PTR_STATUS
    assert request.completed
    with pytest.raises(kind, match=text):
        request.check_error()


def test_immediate_success_completes_cleanly(lib: UcpLibrary) -> None:
    request = UcpRequest(lib, None, "send to peer", None)  # NULL: done at once
    assert request.completed
    request.check_error()
