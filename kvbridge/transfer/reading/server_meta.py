"""Check a server's handshake metadata against this reader's own cache, before any use.

``PeerLink.open`` calls :func:`check_server_meta` right after the handshake. The
metadata sizes everything a read allocates (staging buffers are
``chunk_blocks * block_nbytes`` of the *server's* blocks) and plans every byte
range, so a server that is wrong about its cache (a bug, or a peer that knows
the secret and lies) must be caught here, with a typed error naming the field,
not by an allocation of whatever size it claims or a read planned on it.

What must agree is what the compatibility hash already binds (head size,
element size, MLA, fused K/V, split K/V, KV heads); what may differ (layout, block size,
TP/PP) must be self-consistent and within what this reader's cache could ever
hold: no remote block larger than our whole cache, no block byte count other
than its shape implies.
"""

from __future__ import annotations

from kvbridge.errors import ConfigError
from kvbridge.topology import planes_per_block
from kvbridge.transfer.errors import ProtocolError
from kvbridge.transfer.local_kv import LocalKV, topology_of
from kvbridge.transfer.protocol import wire

__all__ = ["MAX_RANKS", "check_server_meta"]

#: Ranks (TP x PP) a server's engine may claim: plans loop over them.
MAX_RANKS = 1 << 16


def _problems(meta: wire.AgentMetadata, local: LocalKV) -> list[str]:
    topo = local.topology
    problems = [
        f"{name} {theirs} != ours {ours}"
        for name, theirs, ours in (
            ("head_dim", meta.head_dim, local.head_dim),
            ("elem_nbytes", meta.elem_nbytes, local.elem_nbytes),
            ("is_mla", meta.is_mla, topo.is_mla),
            ("fused_kv", meta.fused_kv, topo.fused_kv),
            ("split_kv", meta.split_kv, topo.split_kv),
            ("num_kv_heads", meta.num_kv_heads, topo.num_kv_heads),
        )
        if theirs != ours
    ]
    if meta.tp_size * meta.pp_size > MAX_RANKS:
        problems.append(f"{meta.tp_size} x {meta.pp_size} ranks > {MAX_RANKS}")
    elif meta.tp_rank >= meta.tp_size or meta.pp_rank >= meta.pp_size:
        problems.append(f"rank tp {meta.tp_rank}/{meta.tp_size} pp {meta.pp_rank}/{meta.pp_size}")
    else:  # what its rank must hold, by its own engine's shape
        try:
            theirs = topology_of(meta)
        except (ConfigError, ValueError) as exc:
            problems.append(f"no engine shape: {exc}")
        else:
            if meta.num_heads != theirs.num_heads_per_rank:
                problems.append(f"num_heads {meta.num_heads} != {theirs.num_heads_per_rank} per "
                                f"rank of {meta.num_kv_heads} over TP {meta.tp_size}")
            num_layers = len(theirs.layers_of(meta.pp_rank))
            if meta.num_layers != num_layers:
                problems.append(f"num_layers {meta.num_layers} != {num_layers} of PP rank "
                                f"{meta.pp_rank}")
    if meta.num_heads > meta.num_kv_heads:
        problems.append(f"num_heads {meta.num_heads} > num_kv_heads {meta.num_kv_heads}")
    if meta.num_layers > meta.num_model_layers:
        problems.append(f"num_layers {meta.num_layers} > num_model_layers "
                        f"{meta.num_model_layers}")
    our_tokens = local.num_blocks * topo.block_size
    if meta.block_size > our_tokens:  # could never land here: refuse before sizing on it
        problems.append(f"block_size {meta.block_size} > the {our_tokens} tokens our whole "
                        f"cache holds")
    num_planes = planes_per_block(meta.is_mla, meta.fused_kv, meta.split_kv)
    block_nbytes = meta.block_size * meta.num_heads * meta.head_dim * meta.elem_nbytes * num_planes
    if len(meta.layer_block_nbytes) != meta.num_layers or any(
            n != block_nbytes for n in meta.layer_block_nbytes):
        problems.append(f"layer_block_nbytes {meta.layer_block_nbytes[:4]}... for "
                        f"{meta.num_layers} layers of {block_nbytes}-byte blocks")
    return problems


def check_server_meta(meta: wire.AgentMetadata, local: LocalKV, peer: str) -> None:
    """Raise unless ``meta`` describes a cache this reader can read from.

    Raises:
        ProtocolError: naming every field that is wrong (the link is not opened).
    """
    problems = _problems(meta, local)
    if problems:
        raise ProtocolError(f"{peer} describes a cache this reader cannot read from: "
                            f"{'; '.join(problems)}")
