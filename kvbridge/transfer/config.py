"""Tunables of the transfer agent and the description of one worker's KV cache.

``AgentConfig`` holds every timeout and buffer size (all waits in the agent take
their deadline from here). ``LocalKV`` checks the worker's registered caches
against its ``EngineTopology`` and answers what the handshake advertises.
Both are built by ``TransferAgent`` (``agent.py``) from its constructor arguments;
``AgentConfig.from_options`` builds the config from a deployment's overrides
(``kvbridge serve --transfer-option``, the vLLM connector's ``agent`` setting).
"""

from __future__ import annotations

import hashlib
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from kvbridge.errors import ConfigError
from kvbridge.layout import KVLayout
from kvbridge.topology import EngineTopology
from kvbridge.transfer import wire

# msgspec has no "finite" constraint: the largest float as upper bound keeps out
# inf, and NaN fails every comparison.
_FINITE_MAX = sys.float_info.max
#: Seconds, finite and > 0.
_Seconds = Annotated[float, msgspec.Meta(gt=0, le=_FINITE_MAX)]
#: Seconds, finite and >= 0 (0: off).
_SecondsOrOff = Annotated[float, msgspec.Meta(ge=0, le=_FINITE_MAX)]
_Positive = Annotated[int, msgspec.Meta(gt=0)]
_PositiveOrOff = Annotated[int, msgspec.Meta(ge=0)]
_UpTo64 = Annotated[int, msgspec.Meta(gt=0, le=64)]


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Timeouts (seconds) and sizes (bytes) of one transfer agent.

    Built by keyword (``AgentConfig(read_timeout_s=30)``) or with
    :meth:`from_options`; either way every field is checked against its
    annotation (type, finite, bounds) and a bad value raises ``ConfigError``
    naming the field and the value. Change one with ``msgspec.structs.replace``.

    Attributes:
        connect_timeout_s: UCX connect plus id swap.
        handshake_timeout_s: each handshake message.
        reply_timeout_s: a control reply (data header, lease renewal, pong).
        chunk_timeout_s: one data chunk, from credit to arrival.
        read_timeout_s: a whole request's read, all ranks together.
        heartbeat_s: a reader pings an idle link this often; a link silent for
            ``3 * heartbeat_s`` is dead.
        server_idle_timeout_s: a server drops a connection silent this long.
        chunk_nbytes: target bytes per data chunk (at least one block).
        window_chunks: chunks a reader keeps posted per read (credit window).
        num_read_slots: reads staged at once (each holds ``window_chunks`` buffers).
        num_serve_buffers: chunk buffers shared by all reads this agent serves.
        max_frame_nbytes: largest control frame accepted.
        lease_s: lease asked for when renewing a grant during a long read.
        renew_every_s: how often a long read renews its grant.
        expire_every_s: how often the server expires grants while it holds any
            (holding none, it sleeps until one is issued).
        grant_wait_s: how long the server waits for a grant it has not issued yet
            (the engine returns the token to D before its workers issue it), before
            rejecting a read or dropping a done report naming it.
        direct_reads: read straight from the server's blocks into ours when both
            caches store them alike (no staging, pack or unpack); False forces
            the staged path (tests, or a transport that handles IOV messages badly).
        local_copy: when reader and server share a host, the reader copies a
            direct read's blocks out of the server's memory itself (one pass,
            ``local_copy.py``) instead of receiving them through UCX. Also off
            with ``KVBRIDGE_LOCAL_COPY=0`` or a ``UCX_TLS`` without shared memory.
        local_copy_min_nbytes: smaller direct reads go through UCX even on one
            host: below ~8 MiB UCX's shared memory, both processes copying at
            once, is as fast as one copy (measured in docs/benchmarks.md; from
            8 MiB up the copy wins, by more the larger the read).
        copy_threads: threads one same-host copy is split over (large reads).
        grant_board: when serving same-host copies, also publish live grants on
            the board same-host readers check themselves (``grant_board.py``), so
            they need not ask before they copy. False: every copy asks.
        test_chunk_delay_s: TEST ONLY, never set in production (0: off). The server
            sleeps this long before sending each data chunk, so that fault tests
            (tests/faults) can kill, cut or abort "mid-transfer" deterministically.
    """

    connect_timeout_s: _Seconds = 5.0
    handshake_timeout_s: _Seconds = 5.0
    reply_timeout_s: _Seconds = 10.0
    chunk_timeout_s: _Seconds = 10.0
    read_timeout_s: _Seconds = 120.0
    heartbeat_s: _Seconds = 2.0
    server_idle_timeout_s: _Seconds = 30.0
    chunk_nbytes: _Positive = 16 << 20
    window_chunks: _UpTo64 = 2
    num_read_slots: _Positive = 4
    num_serve_buffers: _Positive = 4
    max_frame_nbytes: _Positive = 1 << 20
    lease_s: _Seconds = 30.0
    renew_every_s: _Seconds = 10.0
    expire_every_s: _Seconds = 0.2
    grant_wait_s: _Seconds = 2.0
    direct_reads: bool = True
    local_copy: bool = True
    local_copy_min_nbytes: _PositiveOrOff = 8 << 20
    copy_threads: _UpTo64 = 2
    grant_board: bool = True
    test_chunk_delay_s: _SecondsOrOff = 0.0

    def __post_init__(self) -> None:
        # msgspec checks types and bounds when it converts (from_options), not when
        # a caller constructs by keyword: check every field here for both.
        for name in self.__struct_fields__:
            _check_field(name, getattr(self, name), strict=True)

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, strict: bool = True) -> AgentConfig:
        """The defaults with ``options`` applied, converted by ``msgspec.convert``.

        Args:
            options: Field name -> value, e.g. ``{"read_timeout_s": 30}``.
            strict: False: also convert text, as given on a command line
                (``"2.5"`` -> 2.5, ``"true"``/``"1"`` -> True).

        Raises:
            ConfigError: an unknown field, or a value of the wrong type or out
                of bounds (the message names the field and the value).
        """
        unknown = sorted(set(options) - set(cls.__struct_fields__))
        if unknown:
            raise ConfigError(f"unknown AgentConfig field(s) {unknown}: known are "
                              f"{sorted(cls.__struct_fields__)}")
        for name, value in options.items():  # msgspec's own message names no value
            _check_field(name, value, strict)
        try:
            return msgspec.convert(dict(options), cls, strict=strict)
        except msgspec.ValidationError as exc:  # every field was checked: not expected
            raise ConfigError(f"AgentConfig: {exc}") from None


def _field_rules() -> dict[str, tuple[type, object, str]]:
    """Per ``AgentConfig`` field: its plain type, its annotated type, and its bounds in words."""
    rules: dict[str, tuple[type, object, str]] = {}
    for info in msgspec.structs.fields(AgentConfig):
        kind, *metas = typing.get_args(info.type) or (info.type,)
        words = ["finite"] if kind is float else []
        for meta in metas:
            assert isinstance(meta, msgspec.Meta)
            for op, bound in ((">", meta.gt), (">=", meta.ge), ("<=", meta.le)):
                if bound is not None and bound != _FINITE_MAX:
                    words.append(f"{op} {bound}")
        rules[info.name] = (kind, info.type, " and ".join(words))
    return rules


_KIND_WORDS = {float: "a number", int: "an integer", bool: "a bool (true or false)"}


def _check_field(name: str, value: object, strict: bool) -> None:
    """Raise ``ConfigError`` unless ``value`` converts to field ``name``'s type and bounds."""
    kind, annotated, bounds = _RULES[name]
    try:
        typed: object = msgspec.convert(value, kind, strict=strict)
    except msgspec.ValidationError:
        raise ConfigError(f"AgentConfig.{name}: {value!r} is not {_KIND_WORDS[kind]}") from None
    try:
        msgspec.convert(typed, annotated)
    except msgspec.ValidationError:
        raise ConfigError(f"AgentConfig.{name} must be {bounds}, got {value!r}") from None


_RULES = _field_rules()


class LocalKV:
    """One worker's registered caches, checked against its topology.

    Args:
        topology: the local engine's description.
        tp_rank: this worker's TP rank.
        pp_rank: this worker's PP rank.
        layer_caches: one tensor per layer this rank holds, all the same shape:
            NHD ``[2, num_blocks, block_size, num_heads, head_dim]``, HND
            ``[2, num_blocks, num_heads, block_size, head_dim]``, MLA
            ``[num_blocks, block_size, latent_dim]``, fused K/V (``topology.fused_kv``,
            vLLM CPU) ``[num_blocks, num_heads, block_size, 2 * head_size]`` or its
            single-plane view ``[1, num_blocks, ...]``; contiguous, CPU.

    Fused caches are kept as single-plane views (``layers``), the form the
    kernels take; ``head_dim`` is then the whole ``2 * head_size`` row.

    Raises:
        ConfigError: a tensor disagrees with the topology or with the others.
    """

    def __init__(
        self,
        topology: EngineTopology,
        tp_rank: int,
        pp_rank: int,
        layer_caches: Sequence[torch.Tensor],
    ) -> None:
        self.topology = topology
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.global_rank = topology.global_rank(tp_rank, pp_rank)
        self.layers = list(layer_caches)
        num_layers = len(topology.layers_of(pp_rank))
        if len(self.layers) != num_layers:
            raise ConfigError(
                f"rank (tp {tp_rank}, pp {pp_rank}) holds {num_layers} layers, "
                f"got {len(self.layers)} cache tensors"
            )
        if topology.fused_kv:  # [N, H, B, row] -> [1, N, H, B, row]: one K/V plane
            self.layers = [t.unsqueeze(0) if t.dim() == 4 else t for t in self.layers]
        first = self.layers[0]
        for index, layer in enumerate(self.layers):
            if layer.shape != first.shape or layer.dtype != first.dtype:
                raise ConfigError(
                    f"layer {index} cache {tuple(layer.shape)} {layer.dtype} differs from "
                    f"layer 0 {tuple(first.shape)} {first.dtype}"
                )
            if not layer.is_contiguous():
                raise ConfigError(f"layer {index} cache is not contiguous")
        self.num_heads = topology.num_heads_per_rank
        if topology.is_mla:
            expected_rank, (num_blocks, block_size, head_dim) = 3, tuple(first.shape[-3:])
        else:
            expected_rank = 5
            num_kv = 1 if topology.fused_kv else 2
            if first.dim() != 5 or first.shape[0] != num_kv:
                want = ("[num_blocks, heads, block_size, 2 * head_size] fused K/V"
                        if topology.fused_kv else "[2, ...] 5-D K/V")
                raise ConfigError(f"expected a {want} cache, got {tuple(first.shape)}")
            _, num_blocks, a, b, head_dim = first.shape
            block_size, heads = (a, b) if topology.layout is KVLayout.NHD else (b, a)
            if heads != self.num_heads:
                raise ConfigError(
                    f"cache holds {heads} heads, topology says {self.num_heads} per rank"
                )
        if first.dim() != expected_rank or block_size != topology.block_size:
            kind = "MLA" if topology.is_mla else "fused" if topology.fused_kv else topology.layout
            raise ConfigError(
                f"cache shape {tuple(first.shape)} does not match block size "
                f"{topology.block_size} ({kind})"
            )
        self.num_blocks = int(num_blocks)
        self.head_dim = int(head_dim)
        self.elem_nbytes = first.element_size()
        self.dtype = str(first.dtype).removeprefix("torch.")
        # One block of one layer: the MLA latent rows, or each of its planes (K and
        # V, or the one fused plane) together.
        plane_numel = first[0].numel() if topology.is_mla else first[0, 0].numel()
        self.block_nbytes = plane_numel * self.num_planes * self.elem_nbytes
        # (layers.start, layers.stop) -> (the tensors' addresses, plane_origins)
        self._origins: dict[tuple[object, ...], tuple[tuple[int, ...], npt.NDArray[np.uint64]]] = {}

    @property
    def num_planes(self) -> int:
        """Planes per block and layer: K and V, or one (MLA's latent, fused K/V)."""
        return 1 if self.topology.is_mla or self.topology.fused_kv else 2

    def place(self) -> int:
        """A fingerprint (63 bits, never 0) of where the caches are now: it changes if one moves."""
        pointers = np.array([layer.data_ptr() for layer in self.layers], dtype=np.uint64)
        digest = hashlib.blake2b(pointers.tobytes(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 1) or 1

    def plane_origins(self, layers: slice) -> npt.NDArray[np.uint64]:
        """Address of block 0 of each plane of ``layers``: ``[layer0 K, layer0 V, layer1 K, ...]``
        (one plane per layer, the tensor's own address, for MLA and fused K/V).

        Read from the tensors on every call (a storage can move in place:
        ``share_memory_``, or pickling a tensor to another process, does that);
        only the array is cached, for as long as the addresses stay the same.
        """
        pointers = tuple(layer.data_ptr() for layer in self.layers[layers])
        key = (layers.start, layers.stop)
        cached = self._origins.get(key)
        if cached is not None and cached[0] == pointers:
            return cached[1]
        plane_nbytes = self.num_blocks * self.plane_block_nbytes
        origins = (np.array(pointers, dtype=np.uint64)[:, None]
                   + np.arange(self.num_planes, dtype=np.uint64)[None, :] * np.uint64(plane_nbytes))
        origins = origins.reshape(-1)
        origins.flags.writeable = False
        self._origins[key] = (pointers, origins)
        return origins

    @property
    def plane_block_nbytes(self) -> int:
        """Bytes of one block of one K (or V, MLA latent, fused K/V) plane of one layer."""
        return self.block_nbytes // self.num_planes

    def metadata(
        self, engine_id: str, proof: bytes | None, host: wire.HostInfo | None = None
    ) -> wire.AgentMetadata:
        """The handshake's description of this rank (``host``: offer same-host copies)."""
        topo = self.topology
        return wire.AgentMetadata(
            engine_id=engine_id,
            tp_size=topo.tp_size,
            pp_size=topo.pp_size,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
            block_size=topo.block_size,
            layout=str(topo.layout),
            num_blocks=self.num_blocks,
            num_layers=len(self.layers),
            num_model_layers=topo.num_layers,
            layer_block_nbytes=[self.block_nbytes] * len(self.layers),
            num_kv_heads=topo.num_kv_heads,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            elem_nbytes=self.elem_nbytes,
            is_mla=topo.is_mla,
            proof=proof,
            host=host,
            fused_kv=topo.fused_kv,
        )


def topology_info(topology: EngineTopology) -> wire.TopologyInfo:
    """The handshake form of an engine's topology (sent by readers in ``Hello``)."""
    return wire.TopologyInfo(
        tp_size=topology.tp_size,
        pp_size=topology.pp_size,
        block_size=topology.block_size,
        num_kv_heads=topology.num_kv_heads,
        is_mla=topology.is_mla,
        layout=str(topology.layout),
        num_layers=topology.num_layers,
        fused_kv=topology.fused_kv,
    )


def topology_from_info(info: wire.TopologyInfo) -> EngineTopology:
    """Rebuild a reader's topology from its ``Hello``.

    Raises:
        ConfigError: the values are inconsistent (a peer bug or attack).
        ValueError: unknown layout name.
    """
    return EngineTopology(
        tp_size=info.tp_size,
        pp_size=info.pp_size,
        block_size=info.block_size,
        num_kv_heads=info.num_kv_heads,
        is_mla=info.is_mla,
        layout=KVLayout.parse(info.layout),
        num_layers=info.num_layers,
        fused_kv=info.fused_kv,
    )


def topology_of(meta: wire.AgentMetadata) -> EngineTopology:
    """Rebuild a peer engine's topology from its handshake metadata.

    Raises:
        ConfigError: the metadata is inconsistent (a peer bug or attack).
    """
    return EngineTopology(
        tp_size=meta.tp_size,
        pp_size=meta.pp_size,
        block_size=meta.block_size,
        num_kv_heads=meta.num_kv_heads,
        is_mla=meta.is_mla,
        layout=KVLayout.parse(meta.layout),
        num_layers=meta.num_model_layers,
        fused_kv=meta.fused_kv,
    )
