"""One worker's KV cache as the transfer agent sees it: ``LocalKV``, and topology on the wire.

``LocalKV`` checks the worker's registered caches against its
``EngineTopology`` and answers what the handshake advertises;
``topology_info`` / ``topology_from_info`` / ``topology_of`` convert a topology
to and from its wire form (``protocol/wire.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from kvbridge.errors import ConfigError
from kvbridge.topology import EngineTopology, KVLayout
from kvbridge.transfer.host_memory import shared_region
from kvbridge.transfer.protocol import wire

_data_ptr = torch.Tensor.data_ptr


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
            single-plane view ``[1, num_blocks, ...]``, split K/V
            (``topology.split_kv``, SGLang: K of layer 0, V of layer 0, K of layer
            1, ... one entry each) ``[num_blocks, block_size, num_heads, head_dim]``
            or its single-plane view; contiguous, CPU.

    Fused and split caches are kept as single-plane views (``layers``), the
    form the kernels take; a fused cache's ``head_dim`` is then the whole
    ``2 * head_size`` row. Each split entry is a layer of one plane here, at its
    own address: ``plane_origins`` lists one origin per entry.

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
        if self._single_plane:  # [N, A, B, row] -> [1, N, A, B, row]: one plane
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
            num_kv = 1 if self._single_plane else 2
            if first.dim() != 5 or first.shape[0] != num_kv:
                want = ("[num_blocks, heads, block_size, 2 * head_size] fused K/V"
                        if topology.fused_kv else
                        "[num_blocks, block_size, heads, head_dim] split K or V"
                        if topology.split_kv else "[2, ...] 5-D K/V")
                raise ConfigError(f"expected a {want} cache, got {tuple(first.shape)}")
            _, num_blocks, a, b, head_dim = first.shape
            block_size, heads = (a, b) if topology.layout is KVLayout.NHD else (b, a)
            if heads != self.num_heads:
                raise ConfigError(
                    f"cache holds {heads} heads, topology says {self.num_heads} per rank"
                )
        if first.dim() != expected_rank or block_size != topology.block_size:
            kind = ("MLA" if topology.is_mla else "fused" if topology.fused_kv
                    else "split" if topology.split_kv else topology.layout)
            raise ConfigError(
                f"cache shape {tuple(first.shape)} does not match block size "
                f"{topology.block_size} ({kind})"
            )
        self.num_blocks = int(num_blocks)
        self.head_dim = int(head_dim)
        self.elem_nbytes = first.element_size()
        self.dtype = str(first.dtype).removeprefix("torch.")
        # One block of one layer: the MLA latent rows, or each of its planes (K and
        # V, or the one fused or split plane) together.
        plane_numel = first[0].numel() if topology.is_mla else first[0, 0].numel()
        self.block_nbytes = plane_numel * self.num_planes * self.elem_nbytes
        self._place: tuple[tuple[int, ...], int] = ((), 0)  # the addresses, their place()
        # (layers.start, layers.stop) -> (the tensors' addresses, plane_origins, the tensors)
        self._origins: dict[
            tuple[object, ...], tuple[tuple[int, ...], npt.NDArray[np.uint64], list[torch.Tensor]]
        ] = {}

    @property
    def _single_plane(self) -> bool:
        """Each layer entry is one plane of ``[2, ...]``'s shape: fused or split K/V."""
        return self.topology.fused_kv or self.topology.split_kv

    @property
    def num_planes(self) -> int:
        """Planes per block and layer: K and V, or one (MLA's latent, fused K/V, or a
        split cache's K or V)."""
        return 1 if self.topology.is_mla or self._single_plane else 2

    def place(self) -> int:
        """A fingerprint (63 bits, never 0) of where the caches are now: it changes if one
        moves (to other addresses, or into other shared memory at the same ones)."""
        pointers = tuple(map(_data_ptr, self.layers))
        if self._place[0] == pointers:  # the same tensors (held here) at the same addresses
            return self._place[1]
        regions = [shared_region(layer) for layer in self.layers]
        words = np.array([*pointers, *(r.inode if r is not None else 0 for r in regions)],
                         dtype=np.uint64)
        digest = hashlib.blake2b(words.tobytes(), digest_size=8).digest()
        self._place = (pointers, (int.from_bytes(digest, "little") >> 1) or 1)
        return self._place[1]

    def shared_regions(self) -> bytes:
        """``wire.HostInfo.regions`` of the caches: every layer's memfd mapping, or
        b\"\" unless every layer is in one (``transfer/host_memory.py``)."""
        regions = [shared_region(layer) for layer in self.layers]
        if not regions or any(r is None for r in regions):
            return b""
        unique = {(r.address, r.nbytes, r.fd, r.inode) for r in regions if r is not None}
        if len(unique) > wire.MAX_COPY_ORIGINS:
            return b""
        return np.array(sorted(unique), dtype=np.uint64).tobytes()

    def plane_origins(self, layers: slice) -> npt.NDArray[np.uint64]:
        """Address of block 0 of each plane of ``layers``: ``[layer0 K, layer0 V, layer1 K, ...]``
        (one plane per layer, the tensor's own address, for MLA, fused and split K/V).

        Read from the tensors on every call (a storage can move in place:
        ``share_memory_``, or pickling a tensor to another process, does that);
        only the array is cached, for as long as the addresses stay the same.
        """
        key = (layers.start, layers.stop)
        cached = self._origins.get(key)
        if cached is not None and cached[0] == tuple(map(_data_ptr, cached[2])):
            return cached[1]
        held = self.layers[layers]
        pointers = tuple(map(_data_ptr, held))
        plane_nbytes = self.num_blocks * self.plane_block_nbytes
        origins = (np.array(pointers, dtype=np.uint64)[:, None]
                   + np.arange(self.num_planes, dtype=np.uint64)[None, :] * np.uint64(plane_nbytes))
        origins = origins.reshape(-1)
        origins.flags.writeable = False
        self._origins[key] = (pointers, origins, held)
        return origins

    @property
    def plane_block_nbytes(self) -> int:
        """Bytes of one block of one K (or V, MLA latent, fused K/V) plane of one layer
        (of one split K or V entry)."""
        return self.block_nbytes // self.num_planes

    def metadata(
        self, engine_id: str, proof: bytes | None, host: wire.HostInfo | None = None
    ) -> wire.AgentMetadata:
        """The handshake's description of this rank (``host``: offer same-host copies).

        An offer of same-host copies also says where every block plane is now
        (``wire.HostInfo.origins``), unless there are more planes than a go may list.
        """
        topo = self.topology
        if host is not None:
            origins = self.plane_origins(slice(None))
            if origins.size <= wire.MAX_COPY_ORIGINS:
                host = msgspec.structs.replace(
                    host, origins=origins.tobytes(), block_stride=self.plane_block_nbytes,
                    place=self.place(), regions=self.shared_regions(),
                )
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
            split_kv=topo.split_kv,
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
        split_kv=topology.split_kv,
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
        split_kv=info.split_kv,
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
        split_kv=meta.split_kv,
    )
