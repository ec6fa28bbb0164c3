"""The libucp version check of ``transfer/ucx/ucp_lib.py`` (its ctypes structs are hand-written)."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError
from kvbridge.transfer.ucx.ucp_lib import SUPPORTED_UCP, UcpLibrary, check_ucp_version


@pytest.mark.parametrize("found", [(1, 19, 0), (1, 21, 0), (1, 21, 7)])
def test_versions_in_the_range_pass(found: tuple[int, int, int]) -> None:
    check_ucp_version(found)


@pytest.mark.parametrize(("found", "text"), [
    ((1, 18, 9), "libucp 1.18.9"),
    ((1, 22, 0), "libucp 1.22.0"),
    ((2, 0, 0), "libucp 2.0.0"),
    ((0, 9, 0), "libucp 0.9.0"),
])
def test_versions_outside_the_range_are_refused_naming_both(
    found: tuple[int, int, int], text: str
) -> None:
    with pytest.raises(ConfigError, match=text) as refused:
        check_ucp_version(found)
    assert "[1.19, 1.22)" in str(refused.value)


def test_a_range_of_our_own_is_honoured() -> None:
    check_ucp_version((2, 3, 1), supported=((2, 0), (3, 0)))
    with pytest.raises(ConfigError, match=r"libucp 1\.21\.0 .*\[2\.0, 3\.0\)"):
        check_ucp_version((1, 21, 0), supported=((2, 0), (3, 0)))


def test_the_loaded_libucp_is_the_installed_one_and_in_range() -> None:
    import libucx  # the wheel ucxx loads libucp from
    import ucxx._lib.libucxx  # noqa: F401  (maps the libucp this binding attaches to)

    lib = UcpLibrary()
    assert ".".join(map(str, lib.version)) == libucx.__version__
    low, high = SUPPORTED_UCP
    assert low <= lib.version[:2] < high
