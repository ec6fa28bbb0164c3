"""``kv_transfer_params``: what P hands to D (through the proxy) about one request.

The proxy sends a request to P with ``{"do_remote_decode": true}``; P's
``ConnectorScheduler.request_finished`` answers with the params D needs to pull
the prompt's KV (``do_remote_prefill`` plus where and what to read). The proxy
copies them into the request it sends to D, whose engine parses them with
:func:`parse_kv_transfer_params` and hands them to its ``ConnectorScheduler``.

Parsing never raises: params that are missing a field, have a wrong type or an
out-of-range value, or are not a JSON object become ``None`` with a warning, and
the engine then prefills the request locally. ``expires_at`` is wall-clock epoch
seconds (``time.time()`` on P): P's monotonic clock means nothing on D.

Params are signed. They travel through clients and routers, and vLLM takes
them from any HTTP client that reaches D: with a cluster secret, P signs
what it hands out (:func:`sign_params`, an HMAC-SHA256 under a key derived
from the secret for this use only) and D plans no read from params that do
not verify (:func:`check_signature`): a forger can neither point D at a
server of its own nor change what it reads from P. Without a secret
(explicitly insecure) params are neither signed nor checked.

Example::

    params = parse_kv_transfer_params(body.get("kv_transfer_params"))
    if params is not None and params.do_remote_prefill:
        ...  # the connector will load remote_num_tokens tokens from P
    json.dumps(params.to_json_dict())
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Annotated, Any, Literal

import msgspec

__all__ = ["KVTransferParams", "ParamsRefusal", "check_signature", "params_key",
           "parse_kv_transfer_params", "sign_params"]

logger = logging.getLogger(__name__)

_MAX_ID_LEN = 256
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_ID_LEN)]
_OMIT_WHEN_EMPTY = frozenset({"remote_groups", "first_token_flow"})
Hex32 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
_KEY_DOMAIN = b"kvbridge-kv-transfer-params-v1"

#: Why D refuses params it was handed (logged, counted, and the request is
#: prefilled locally): ``unsigned`` (this engine has a secret, the params carry no
#: signature), ``bad_signature`` (forged or changed on the way, or P has another
#: secret), ``prompt_mismatch`` (signed for another prompt), ``expired`` (P's lease ended).
ParamsRefusal = Literal["unsigned", "bad_signature", "prompt_mismatch", "expired"]


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request transfer instructions; every field is optional.

    Attributes:
        do_remote_decode: (to P) keep the prompt's KV for a remote decoder and
            answer with params for it.
        first_token_flow: (to P, with ``do_remote_decode``) D's prompt will be
            this prompt and P's token (``kvbridge proxy``'s first-token flow).
            Without it D recomputes the prompt's last token (the classic flow:
            vllm-router, vLLM's toy proxy), and P of a model with a recurrent
            state stops one token short: the state D needs is the one before it.
        do_remote_prefill: (to D) load the prompt's KV from the remote prefill.
        remote_engine_id: P's engine id.
        remote_host: P's transfer host.
        remote_port: P's transfer base port; its global rank ``g`` listens on base + g
            (when ``remote_ports`` is given: the port of its rank 0).
        remote_ports: the port of each of P's global ranks, when its workers
            listen on ports of their own choosing (empty: ``remote_port + g``).
        remote_block_ids: P's blocks holding the prompt, in token order; with
            several KV cache groups, the held blocks of each group, group after group.
        remote_groups: per KV cache group, ``(first block index, number of blocks)``
            of its run in ``remote_block_ids`` (``kvbridge.topology.groups``);
            empty: one group, every block from token 0.
        remote_tp_size: P's tensor-parallel size.
        remote_pp_size: P's pipeline-parallel size.
        remote_block_size: P's tokens per block.
        remote_num_tokens: prompt tokens whose KV P computed (from token 0).
        grant: the string naming P's grant for the blocks (a secret: do not log it).
        expires_at: wall-clock epoch seconds after which P may have freed the blocks;
            P hands out whole seconds, which every JSON parser reads back exactly
            (a router that re-encodes the params must not change a signed value).
        kv_digest: hex ``binding.kv_digest`` of the prompt tokens and blocks P
            holds: D compares its own before reading anything.
        signature: hex HMAC of every other field (:func:`sign_params`), None
            when P runs without a secret.
    """

    do_remote_decode: bool = False
    first_token_flow: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: Name | None = None
    remote_host: Name | None = None
    remote_port: Port | None = None
    remote_ports: Annotated[list[Port], msgspec.Meta(max_length=4096)] = []
    remote_block_ids: list[Count] = []
    remote_groups: Annotated[list[tuple[Count, Count]], msgspec.Meta(max_length=1024)] = []
    remote_tp_size: Size = 1
    remote_pp_size: Size = 1
    remote_block_size: Size | None = None
    remote_num_tokens: Count = 0
    grant: Name | None = None
    expires_at: float | None = None
    kv_digest: Hex32 | None = None
    signature: Hex32 | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (fields that are ``None`` are left out, and
        ``remote_groups`` when it is empty: one group, ``first_token_flow`` when false)."""
        built: dict[str, Any] = msgspec.to_builtins(self)
        return {key: value for key, value in built.items()
                if value is not None and not (key in _OMIT_WHEN_EMPTY and not value)}

    def missing_for_prefill(self) -> list[str]:
        """Names of fields a ``do_remote_prefill`` request lacks (empty: complete)."""
        missing = [
            name
            for name in ("remote_engine_id", "remote_host", "remote_port",
                         "remote_block_size", "grant")
            if getattr(self, name) is None
        ]
        if self.remote_num_tokens < 1:
            missing.append("remote_num_tokens")
        num_ranks = self.remote_tp_size * self.remote_pp_size
        if self.remote_ports and len(self.remote_ports) != num_ranks:
            missing.append(f"remote_ports ({len(self.remote_ports)} ports for {num_ranks} ranks)")
        if not self.remote_block_ids:
            missing.append("remote_block_ids")
        elif self.remote_groups:
            num_held = sum(count for _, count in self.remote_groups)
            if num_held != len(self.remote_block_ids) or not all(
                    count for _, count in self.remote_groups):
                missing.append(f"remote_block_ids ({len(self.remote_block_ids)} blocks for "
                               f"groups {self.remote_groups})")
        elif self.remote_block_size is not None:
            num_needed = -(-self.remote_num_tokens // self.remote_block_size)
            if len(self.remote_block_ids) < num_needed:
                missing.append(
                    f"remote_block_ids ({len(self.remote_block_ids)} blocks of "
                    f"{self.remote_block_size} for {self.remote_num_tokens} tokens)"
                )
        return missing


def params_key(secret: bytes | None) -> bytes | None:
    """The key that signs params, derived from the cluster secret for this use only.

    A MAC made with it is never a valid handshake proof, nor the other way round.

    Returns:
        32 bytes, or None when there is no secret (params are not signed).
    """
    if secret is None:
        return None
    return hmac.digest(secret, _KEY_DOMAIN, hashlib.sha256)


def _mac(params: KVTransferParams, key: bytes) -> str:
    # msgspec encodes every field in declaration order: one byte string per value of
    # the struct, and D decodes P's JSON back to the same struct (its one float,
    # expires_at, is integral: it survives routers whose parsers are off by 1 ULP);
    # the fields that only ask P for something are not P's to vouch for
    unsigned = msgspec.structs.replace(params, signature=None, do_remote_decode=False,
                                       first_token_flow=False)
    return hmac.new(key, msgspec.json.encode(unsigned), hashlib.sha256).hexdigest()


def sign_params(params: KVTransferParams, key: bytes | None) -> KVTransferParams:
    """``params`` with their signature (unchanged when ``key`` is None: no secret).

    Args:
        params: what P hands out for one request.
        key: :func:`params_key` of the cluster secret.
    """
    if key is None:
        return params
    return msgspec.structs.replace(params, signature=_mac(params, key))


def check_signature(params: KVTransferParams, key: bytes | None) -> ParamsRefusal | None:
    """Why D must not read with ``params`` as far as their signature goes, or None.

    Args:
        params: parsed params of a ``do_remote_prefill`` request.
        key: :func:`params_key` of this engine's secret; None (no secret,
            explicitly insecure): every params pass unchecked.

    Returns:
        None when they verify (compared in constant time); ``"unsigned"`` or
        ``"bad_signature"`` otherwise.
    """
    if key is None:
        return None
    if params.signature is None:
        return "unsigned"
    if not hmac.compare_digest(_mac(params, key), params.signature):
        return "bad_signature"
    return None


def parse_kv_transfer_params(raw: object) -> KVTransferParams | None:
    """Validate a request's ``kv_transfer_params`` (a JSON object or a struct).

    Never raises. A request that asks for both a remote prefill and a remote
    decode keeps only the prefill: a request loaded from a remote engine is not
    served to another one (no transfer chains or loops). Fields given as JSON
    ``null`` count as absent (vLLM's toy proxy sends ``"remote_block_ids": null``
    and friends to P), and fields kvbridge does not know are ignored.

    Args:
        raw: ``None``, a ``dict`` decoded from JSON, or a :class:`KVTransferParams`.

    Returns:
        The params, or ``None`` (prefill locally) when ``raw`` is ``None`` or
        malformed (a warning names the problem).
    """
    if raw is None:
        return None
    try:
        if isinstance(raw, KVTransferParams):
            raw = msgspec.to_builtins(raw)
        if not isinstance(raw, dict):
            raise TypeError(f"expected a JSON object, got {type(raw).__name__}")
        raw = {key: value for key, value in raw.items() if value is not None}
        params = msgspec.convert(raw, KVTransferParams)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        logger.warning("ignoring malformed kv_transfer_params (prefilling locally): %s", exc)
        return None
    if params.do_remote_prefill:
        missing = params.missing_for_prefill()
        if missing:
            logger.warning(
                "ignoring kv_transfer_params without %s (prefilling locally)", ", ".join(missing)
            )
            return None
        if params.do_remote_decode:
            logger.warning("kv_transfer_params ask for a remote prefill and a remote decode; "
                           "a remotely loaded request is not served again: dropping the decode")
            params = msgspec.structs.replace(params, do_remote_decode=False)
    return params
