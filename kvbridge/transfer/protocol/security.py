"""Handshake security and compatibility checks (pure: no network, no state).

The transfer agent calls these during the handshake with a peer engine's rank:

* **Cluster secret.** ``load_cluster_secret`` reads it from a file or an env var
  (None means "no authentication configured"). With a secret, both sides prove
  they know it by an HMAC over a nonce the *other* side chose, so a recorded
  proof is useless later. The proof also covers a context naming the direction
  and both endpoints (``handshake_context``), so a reader's proof cannot be
  replayed as a server's proof, nor towards another engine or rank.
* **Compatibility.** ``CompatInfo`` describes the KV cache. Both sides compare
  ``compat_hash`` values and, on mismatch, put ``compat_diff`` in the ``Reject``.
  Layout and block size are left out of the hash by default because kvbridge
  converts between them on arrival (unpack relayouts HND <-> NHD and re-blocks);
  ``include_conversion_fields=True`` hashes them too, for a fast path that
  needs identical blocks.

Suggested mutual handshake (the wire messages live in ``wire.py``)::

    server -> reader   Challenge(server_nonce = make_nonce())
    reader -> server   Hello(PROTOCOL_VERSION, compat_hash, reader_nonce = make_nonce(),
                             proof = prove(secret, server_nonce, ctx("reader")))
    server             verify(secret, server_nonce, ctx("reader"), hello.proof) else Reject
    server -> reader   Welcome(metadata, proof = prove(secret, reader_nonce, ctx("server")))
    reader             verify(secret, reader_nonce, ctx("server"), welcome.proof) else drop

where ``ctx(role) = handshake_context(role, reader_engine_id, reader_rank,
server_engine_id, server_rank)``.

Example::

    from kvbridge.topology import KVLayout
    from kvbridge.transfer.protocol import security as sec

    secret = sec.load_cluster_secret()                  # bytes | None
    nonce = sec.make_nonce()
    ctx = sec.handshake_context("reader", "engine-d", 0, "engine-p", 1)
    proof = sec.prove(b"s3cret-of-32-bytes-or-more......", nonce, ctx)
    assert sec.verify(b"s3cret-of-32-bytes-or-more......", nonce, ctx, proof)

    info = sec.CompatInfo("llama-3-8b@abc123", "bfloat16", num_kv_heads=8, head_dim=128,
                          num_layers=32, layout=KVLayout.NHD, block_size=16, is_mla=False)
    sec.compat_hash(info)                 # 64 hex chars, same in every process
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from kvbridge.errors import ConfigError
from kvbridge.topology import KVLayout

logger = logging.getLogger(__name__)

PROTOCOL_VERSION: int = 11  # 2: direct reads, prompt-bound grants; 3: same-host copies;
# 4: the grant board (copies without asking); 5: fused K/V caches (fused_kv in TopologyInfo,
# AgentMetadata and the compat hash); 6: a lease renewal names its read (RenewLease and
# LeaseRenewed carry xfer_id; a refused one is Reject(xfer_id, renewal=True), not xfer_id 0);
# 7: HostInfo says where every block plane is (origins, block_stride, place): a same-host
# reader copies on the board's word from its first read; 8: HostInfo.board_fd (the board's
# memfd, which a same-host reader maps); 9: RejectReason.BUSY (a server at its session
# cap may answer a new connection with a Reject instead of a Challenge); 10:
# RejectReason.NO_READ (a server renews a lease only for a read of it in flight, and
# refuses any other renewal so; a 9 peer's decoder fails on the new value, which
# would end its whole link: the handshake refuses it first); 11: split K/V caches
# (split_kv in TopologyInfo, AgentMetadata and the compat hash: SGLang's one tensor per
# K and per V, each a layer entry of one plane)
NONCE_NBYTES = 32
PROOF_NBYTES = 32  # HMAC-SHA256
MIN_SECRET_NBYTES = 16  # shorter secrets are accepted with a warning

HandshakeRole = Literal["reader", "server"]

# Fields that kvbridge converts between P and D, so they may differ.
_CONVERSION_FIELDS = ("layout", "block_size")


def load_cluster_secret(
    env_var: str = "KVBRIDGE_SECRET",
    secret_file: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> bytes | None:
    """Read the cluster secret: ``secret_file`` if given, else ``env_var``.

    Args:
        env_var: environment variable holding the secret (UTF-8 text).
        secret_file: file holding the secret; trailing newlines are stripped. A
            file readable by every user is accepted with a warning.
        environ: environment to read (default ``os.environ``).

    Returns:
        The secret bytes, or None when no file is given and the variable is unset.

    Raises:
        ConfigError: the file cannot be read or is empty, or the variable is set
            but empty (an empty secret would silently turn authentication off).
    """
    if secret_file is not None:
        path = Path(secret_file)
        try:
            mode = path.stat().st_mode
            secret = path.read_bytes().rstrip(b"\r\n")
        except OSError as e:
            raise ConfigError(f"cannot read cluster secret file {str(path)!r}: {e}") from e
        if not secret:
            raise ConfigError(f"cluster secret file {str(path)!r} is empty")
        if mode & stat.S_IROTH:
            logger.warning(
                "cluster secret file %r is readable by every user (mode %o); "
                "chmod 600 it", str(path), stat.S_IMODE(mode)
            )
        source = f"file {str(path)!r}"
    else:
        value = (os.environ if environ is None else environ).get(env_var)
        if value is None:
            return None
        if not value:
            raise ConfigError(f"environment variable {env_var} is set but empty")
        secret = value.encode()
        source = f"${env_var}"
    if len(secret) < MIN_SECRET_NBYTES:
        logger.warning(
            "cluster secret from %s has %d bytes; use at least %d random bytes",
            source, len(secret), MIN_SECRET_NBYTES,
        )
    return secret


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """32-byte digest of a prompt's token ids, binding a grant to the prompt it holds.

    P issues a grant with the digest of the prompt it prefilled; D sends the
    digest of its own request's prompt with every read, and P refuses a read
    whose digest differs: KV computed for one prompt never lands under another
    prompt's block hashes in D's prefix cache.

    Raises:
        ValueError: a token id outside int64.
    """
    try:
        packed = np.asarray(list(token_ids), dtype="<i8").tobytes()
    except OverflowError as exc:
        raise ValueError(f"token ids must fit int64: {exc}") from None
    return hashlib.sha256(b"kvbridge-prompt-v1\0" + packed).digest()


def make_nonce() -> bytes:
    """Return ``NONCE_NBYTES`` (32) fresh random bytes for one handshake."""
    return secrets.token_bytes(NONCE_NBYTES)


def handshake_context(
    role: HandshakeRole,
    reader_engine_id: str,
    reader_rank: int,
    server_engine_id: str,
    server_rank: int,
) -> bytes:
    """Bytes naming who proves to whom, to bind a proof to one direction and pair.

    Both sides build it from the same values: the reader's and the server's
    engine id and rank, whichever side is proving.

    Args:
        role: ``"reader"`` when the reader proves to the server, ``"server"`` back.

    Returns:
        An unambiguous encoding (JSON array) of the protocol version and arguments.

    Raises:
        ConfigError: ``role`` is not ``"reader"`` or ``"server"``.
    """
    if role not in ("reader", "server"):
        raise ConfigError(f"handshake role must be 'reader' or 'server', got {role!r}")
    fields = ["kvbridge-handshake", PROTOCOL_VERSION, role,
              reader_engine_id, reader_rank, server_engine_id, server_rank]
    return json.dumps(fields, separators=(",", ":")).encode()


def _check_hmac_inputs(secret: bytes, nonce: bytes) -> None:
    if not secret:
        raise ConfigError("cluster secret must not be empty")
    if len(nonce) != NONCE_NBYTES:
        # A fixed nonce length makes context || nonce unambiguous.
        raise ConfigError(f"nonce must be {NONCE_NBYTES} bytes, got {len(nonce)}")


def prove(secret: bytes, nonce: bytes, context: bytes) -> bytes:
    """Return HMAC-SHA256(secret, context || nonce): ``PROOF_NBYTES`` bytes.

    Args:
        secret: the cluster secret.
        nonce: the peer's ``make_nonce()`` for this handshake.
        context: ``handshake_context(...)`` for this direction.

    Raises:
        ConfigError: empty secret or a nonce that is not ``NONCE_NBYTES`` long.
    """
    _check_hmac_inputs(secret, nonce)
    return hmac.digest(secret, context + nonce, hashlib.sha256)


def verify(secret: bytes, nonce: bytes, context: bytes, proof: bytes) -> bool:
    """Check a peer's proof in constant time.

    Returns:
        True when ``proof == prove(secret, nonce, context)``; False for any
        other proof, including one of the wrong length.

    Raises:
        ConfigError: as for ``prove`` (the secret and nonce are ours, not the peer's).
    """
    return hmac.compare_digest(prove(secret, nonce, context), proof)


@dataclass(frozen=True, slots=True)
class CompatInfo:
    """What P and D must agree on about the KV cache.

    Attributes:
        model: model identity (name plus revision or weights hash).
        dtype: KV cache dtype name, e.g. ``"bfloat16"`` (a ``"torch."`` prefix is dropped).
        num_kv_heads: KV heads of the whole model (not per TP rank); 1 for MLA.
        head_dim: head dimension (the latent dimension for MLA).
        num_layers: attention layers with a KV cache.
        layout: ``KVLayout`` (a string is parsed).
        block_size: tokens per block.
        is_mla: one latent per token instead of separate K and V.
        fused_kv: K and V fused in one plane per head (vLLM's CPU cache, K
            transposed in each block; ``EngineTopology.fused_kv``). Hashed: a
            fused and a non-fused cache never pair.
        split_kv: K and V in separate tensors, one layer entry each (SGLang's
            cache; ``EngineTopology.split_kv``; ``num_layers`` counts those
            entries). Hashed: a split and a non-split cache never pair.

    Raises:
        ConfigError: empty model or dtype, or a count that is not >= 1.
        ValueError: unknown layout.
    """

    model: str
    dtype: str
    num_kv_heads: int
    head_dim: int
    num_layers: int
    layout: KVLayout
    block_size: int
    is_mla: bool
    fused_kv: bool = False
    split_kv: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("CompatInfo.model must be a non-empty identity string")
        dtype = str(self.dtype).removeprefix("torch.")
        if not dtype:
            raise ConfigError("CompatInfo.dtype must be a non-empty dtype name")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "layout", KVLayout.parse(self.layout))
        for name in ("num_kv_heads", "head_dim", "num_layers", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CompatInfo.{name} must be an int >= 1, got {value!r}")
        for name in ("is_mla", "fused_kv", "split_kv"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"CompatInfo.{name} must be a bool, got {value!r}")


def compat_fields(info: CompatInfo) -> dict[str, object]:
    """Every field of ``info`` by name (``CompatInfo(**compat_fields(info)) == info``)."""
    return {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}


def _compared_fields(info: CompatInfo, include_conversion_fields: bool) -> dict[str, object]:
    fields: dict[str, object] = {
        f.name: getattr(info, f.name) for f in dataclasses.fields(info)
    }
    if not include_conversion_fields:
        for name in _CONVERSION_FIELDS:
            del fields[name]
    return fields


def compat_hash(info: CompatInfo, include_conversion_fields: bool = False) -> str:
    """SHA-256 (hex) of a stable encoding of ``info``; equal in every process.

    Args:
        info: this side's cache description.
        include_conversion_fields: also hash ``layout`` and ``block_size``. Off by
            default because kvbridge converts between them; the two kinds of hash
            never collide (the choice is part of the hashed bytes).

    Returns:
        64 lowercase hex characters.
    """
    fields = _compared_fields(info, include_conversion_fields)
    doc = {
        "schema": "kvbridge-compat-v1",
        "conversion_fields": include_conversion_fields,
        "fields": {k: str(v) if isinstance(v, KVLayout) else v for k, v in fields.items()},
    }
    encoded = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(encoded.encode()).hexdigest()


def compat_diff(
    local: CompatInfo, remote: CompatInfo, include_conversion_fields: bool = False
) -> list[str]:
    """Human-readable differences, one line per field, for a ``Reject`` reason.

    Returns:
        Lines like ``"num_kv_heads: local 8 != remote 4"``; empty when the
        hashes (with the same ``include_conversion_fields``) would be equal.
    """
    mine = _compared_fields(local, include_conversion_fields)
    theirs = _compared_fields(remote, include_conversion_fields)

    def show(v: object) -> str:
        return repr(str(v)) if isinstance(v, str) else repr(v)

    return [
        f"{name}: local {show(mine[name])} != remote {show(theirs[name])}"
        for name in mine
        if mine[name] != theirs[name]
    ]
