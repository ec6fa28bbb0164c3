"""What binds P's grant to the KV it holds: a digest of the prompt tokens and their blocks.

Without it, anyone who can reach P and D directly could prefill one prompt on
P and hand its ``kv_transfer_params`` to D with another prompt: D would load
the first prompt's KV as the second's and keep it in its prefix cache under the
second prompt's block hashes, serving wrong answers to later clients.

Both connector halves compute :func:`kv_digest` and the transfer agent compares
the two (``TransferAgent.issue_grant`` / ``start_read``, reject reason
``prompt_mismatch``)::

    P  ConnectorScheduler._hold_for_readers   kv_digest(prompt[:n], held block ids)
         -> SendRequest.kv_digest -> ConnectorWorker.start_load_kv -> issue_grant
    D  ConnectorScheduler.get_num_new_matched_tokens
                                 kv_digest(own prompt[:remote_num_tokens], remote_block_ids)
         -> RecvRequest.kv_digest -> ConnectorWorker._start_read -> start_read

``n`` is ``remote_num_tokens`` of the params P hands out, so an honest D (the
proxy sends the same prompt text to both, tokenized alike) computes the same
bytes. The block ids are in the digest because a read names P's blocks only as
a set: with the prompt alone, params whose ``remote_block_ids`` were reordered
or repeated would still pass and put the right prompt's KV at wrong positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvbridge.transfer import prompt_digest

__all__ = ["KV_DIGEST_NBYTES", "kv_digest"]

KV_DIGEST_NBYTES = 32
_DOMAIN = b"kvbridge-grant-kv-v1\0"
_GROUPS = b"\0groups:\0"  # 9 bytes: a grouped digest never hashes as a plain one


def kv_digest(token_ids: Sequence[int], block_ids: Sequence[int],
              groups: Sequence[tuple[int, int]] = ()) -> bytes:
    """Digest of "these prompt tokens' KV, in these P blocks, in this order".

    Args:
        token_ids: the prompt tokens whose KV the grant holds (from token 0).
        block_ids: P's blocks holding them, in token order (group after group).
        groups: with several KV cache groups, each group's ``(first block
            index, number of blocks)`` (``KVTransferParams.remote_groups``):
            the same blocks in other positions or groups are another digest.

    Returns:
        ``KV_DIGEST_NBYTES`` bytes: sha256 over a domain prefix, the fixed-size
        ``prompt_digest(token_ids)``, the block ids as int64 little endian and,
        if ``groups`` is given, its numbers after a separator.

    Raises:
        ValueError: a token id outside int64 or a block id outside ``[0, 2**63)``.
    """
    if any(b < 0 for b in block_ids):
        bad = next(b for b in block_ids if b < 0)
        raise ValueError(f"block ids must be >= 0, got {bad}")
    try:
        packed = np.asarray(list(block_ids), dtype="<i8").tobytes()
    except OverflowError as exc:
        raise ValueError(f"block ids must fit int64: {exc}") from None
    if groups:
        spans = [n for span in groups for n in span]
        if any(n < 0 for n in spans):
            raise ValueError(f"group spans must be >= 0, got {list(groups)}")
        try:
            packed += _GROUPS + np.asarray(spans, dtype="<i8").tobytes()
        except OverflowError as exc:
            raise ValueError(f"group spans must fit int64: {exc}") from None
    return hashlib.sha256(_DOMAIN + prompt_digest(token_ids) + packed).digest()
