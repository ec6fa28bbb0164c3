"""Property tests: random valid engine pairs (any head/layer counts, not only powers
of two) satisfy every read-plan invariant; random non-dividing sizes are refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.topology import (
    EngineTopology,
    IncompatibleTopologyError,
    KVLayout,
    TpKVTopology,
    block_size_ratio,
    build_read_plan,
    num_expected_readers,
    signed_ratio,
)
from tests.topology.plan_checks import check_pair


def _related(draw: st.DrawFn, size: int, limit: int) -> int:
    """A size that divides ``size`` or is a small multiple of it, at most ``limit``."""
    options = [d for d in range(1, size + 1) if size % d == 0]
    options += [size * k for k in range(2, 5) if size * k <= limit]
    return draw(st.sampled_from(options))


@st.composite
def engine_pairs(draw: st.DrawFn) -> tuple[EngineTopology, EngineTopology]:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.integers(1, 12))
    num_layers = draw(st.integers(1, 9))
    local_tp = _related(draw, heads, 16)
    remote_tp = draw(
        st.sampled_from(
            [
                t
                for t in range(1, 17)
                if max(t, local_tp) % min(t, local_tp) == 0 and max(t, heads) % min(t, heads) == 0
            ]
        )
    )
    local_pp = draw(st.integers(1, min(num_layers, 4)))
    remote_pp = _related(draw, local_pp, num_layers)
    local_bs = draw(st.sampled_from([1, 2, 3, 4, 8, 12, 16]))
    remote_bs = _related(draw, local_bs, 48)

    def engine(tp: int, pp: int, block_size: int) -> EngineTopology:
        return EngineTopology(
            tp_size=tp,
            pp_size=pp,
            block_size=block_size,
            num_kv_heads=heads,
            is_mla=mla,
            layout=draw(st.sampled_from(KVLayout)),
            num_layers=num_layers,
        )

    return engine(local_tp, local_pp, local_bs), engine(remote_tp, remote_pp, remote_bs)


@settings(max_examples=150, deadline=None)
@given(engine_pairs())
def test_random_pairs_satisfy_plan_invariants(pair: tuple[EngineTopology, EngineTopology]) -> None:
    reader, server = pair
    check_pair(reader, server)
    check_pair(server, reader)  # roles swapped: both directions must hold


@st.composite
def non_dividing(draw: st.DrawFn) -> tuple[int, int]:
    a = draw(st.integers(2, 64))
    b = draw(st.integers(2, 64).filter(lambda b: a % b and b % a))
    return a, b


@settings(max_examples=100, deadline=None)
@given(non_dividing())
def test_non_dividing_sizes_raise(sizes: tuple[int, int]) -> None:
    a, b = sizes
    for fn in (lambda: signed_ratio("size", a, b), lambda: block_size_ratio(a, b)):
        with pytest.raises(ValueError, match=f"{max(a, b)}"):
            fn()

    def engine(tp: int = a, block_size: int = a, pp: int = a) -> EngineTopology:
        return EngineTopology(
            tp_size=tp,
            pp_size=pp,
            block_size=block_size,
            num_kv_heads=a * b,
            is_mla=False,
            layout=KVLayout.NHD,
            num_layers=a * b,
        )

    topo = TpKVTopology(engine(), 0, 0)
    for bad in (engine(tp=b), engine(block_size=b), engine(pp=b)):
        with pytest.raises(IncompatibleTopologyError, match=f"{max(a, b)}"):
            topo.add_remote("odd", bad)
        with pytest.raises(IncompatibleTopologyError):
            build_read_plan(engine(), 0, 0, bad, "odd")
        with pytest.raises(IncompatibleTopologyError):
            num_expected_readers(engine(), bad, 0, 0)
    assert topo.remote_engine_ids == ()
    for ratio in (topo.tp_ratio, topo.pp_ratio, topo.block_size_ratio):
        with pytest.raises(ValueError):
            ratio(b)
