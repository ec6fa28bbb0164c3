"""Tests for kvbridge.transfer.protocol.security: secrets, proofs, compatibility hashes."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvbridge.errors import ConfigError
from kvbridge.topology import KVLayout
from kvbridge.transfer.protocol import security as sec

SECRET = b"0123456789abcdef0123456789abcdef"


def ctx(role: sec.HandshakeRole = "reader", server_rank: int = 1) -> bytes:
    return sec.handshake_context(role, "engine-d", 0, "engine-p", server_rank)


# ------------------------------------------------------------------- proofs


def test_proof_round_trip() -> None:
    nonce = sec.make_nonce()
    proof = sec.prove(SECRET, nonce, ctx())
    assert len(proof) == sec.PROOF_NBYTES
    assert sec.verify(SECRET, nonce, ctx(), proof)


def test_nonces_are_fresh() -> None:
    nonces = {sec.make_nonce() for _ in range(100)}
    assert len(nonces) == 100 and all(len(n) == sec.NONCE_NBYTES for n in nonces)


def test_proof_fails_with_wrong_secret_nonce_context_or_proof() -> None:
    nonce = sec.make_nonce()
    proof = sec.prove(SECRET, nonce, ctx())
    assert not sec.verify(SECRET + b"x", nonce, ctx(), proof)
    assert not sec.verify(SECRET, sec.make_nonce(), ctx(), proof)
    assert not sec.verify(SECRET, nonce, ctx("server"), proof)  # replay in the other direction
    assert not sec.verify(SECRET, nonce, ctx(server_rank=2), proof)  # towards another rank
    assert not sec.verify(SECRET, nonce, ctx(), proof[:-1])
    assert not sec.verify(SECRET, nonce, ctx(), b"")
    flipped = bytes([proof[0] ^ 1]) + proof[1:]
    assert not sec.verify(SECRET, nonce, ctx(), flipped)


def test_contexts_are_unambiguous() -> None:
    # Moving characters between fields must change the context.
    a = sec.handshake_context("reader", "ab", 0, "c", 1)
    b = sec.handshake_context("reader", "a", 0, "bc", 1)
    c = sec.handshake_context("reader", "a,0", 0, "c", 1)
    assert len({a, b, c}) == 3


def test_prove_rejects_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="32 bytes, got 31"):
        sec.prove(SECRET, b"x" * 31, ctx())
    with pytest.raises(ConfigError, match="empty"):
        sec.prove(b"", sec.make_nonce(), ctx())
    with pytest.raises(ConfigError, match="role"):
        sec.handshake_context("client", "d", 0, "p", 0)  # type: ignore[arg-type]


# ------------------------------------------------------------------- secret loading


def test_secret_from_file_strips_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    assert sec.load_cluster_secret(secret_file=path, environ={}) == SECRET
    path.write_bytes(SECRET + b"\r\n")
    assert sec.load_cluster_secret(secret_file=str(path), environ={}) == SECRET


def test_secret_file_wins_over_env(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    env = {"KVBRIDGE_SECRET": "from-env-but-long-enough"}
    assert sec.load_cluster_secret(secret_file=path, environ=env) == SECRET


@pytest.mark.parametrize("content", [b"", b"\n", b"\r\n\n"])
def test_empty_secret_file_raises(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "secret"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="empty"):
        sec.load_cluster_secret(secret_file=path, environ={})


def test_missing_secret_file_raises(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        sec.load_cluster_secret(secret_file=tmp_path / "nope", environ={})


def test_world_readable_secret_file_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger=sec.__name__):
        sec.load_cluster_secret(secret_file=path, environ={})
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger=sec.__name__):
        assert sec.load_cluster_secret(secret_file=path, environ={}) == SECRET
    assert "readable by every user" in caplog.text


def test_secret_from_env() -> None:
    env = {"MY_SECRET": SECRET.decode()}
    assert sec.load_cluster_secret("MY_SECRET", environ=env) == SECRET
    assert sec.load_cluster_secret("OTHER", environ=env) is None
    with pytest.raises(ConfigError, match="MY_SECRET is set but empty"):
        sec.load_cluster_secret("MY_SECRET", environ={"MY_SECRET": ""})


def test_secret_defaults_to_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET.decode())
    assert sec.load_cluster_secret() == SECRET
    monkeypatch.delenv("KVBRIDGE_SECRET")
    assert sec.load_cluster_secret() is None


def test_short_secret_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=sec.__name__):
        assert sec.load_cluster_secret(environ={"KVBRIDGE_SECRET": "abc"}) == b"abc"
    assert "3 bytes" in caplog.text


# ------------------------------------------------------------------- compatibility

INFO = sec.CompatInfo(
    model="tiny-llama@seed0",
    dtype="bfloat16",
    num_kv_heads=8,
    head_dim=128,
    num_layers=32,
    layout=KVLayout.NHD,
    block_size=16,
    is_mla=False,
)

# One change per field, each to a value that stays valid.
CHANGED: dict[str, Any] = {
    "model": "tiny-llama@seed1",
    "dtype": "float16",
    "num_kv_heads": 4,
    "head_dim": 64,
    "num_layers": 31,
    "layout": KVLayout.HND,
    "block_size": 32,
    "is_mla": True,
    "fused_kv": True,
    "split_kv": True,
}


def shown(value: object) -> str:
    return repr(str(value)) if isinstance(value, str) else repr(value)


def test_changes_cover_every_field() -> None:
    assert set(CHANGED) == {f.name for f in dataclasses.fields(sec.CompatInfo)}


def test_compat_hash_is_hex_sha256_and_kinds_differ() -> None:
    h = sec.compat_hash(INFO)
    assert len(h) == 64 and int(h, 16) >= 0
    assert sec.compat_hash(INFO, include_conversion_fields=True) != h


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_compat_hash_is_sensitive_to_each_field(name: str) -> None:
    other = dataclasses.replace(INFO, **{name: CHANGED[name]})
    converted = name in ("layout", "block_size")
    assert (sec.compat_hash(other) == sec.compat_hash(INFO)) == converted
    assert sec.compat_hash(other, True) != sec.compat_hash(INFO, True)
    line = f"{name}: local {shown(getattr(INFO, name))} != remote {shown(CHANGED[name])}"
    assert sec.compat_diff(INFO, other) == ([] if converted else [line])
    assert sec.compat_diff(INFO, other, include_conversion_fields=True) == [line]


def test_compat_diff_lists_every_difference_readably() -> None:
    other = dataclasses.replace(INFO, num_kv_heads=4, dtype="float16", layout=KVLayout.HND)
    diff = sec.compat_diff(INFO, other)
    assert diff == [
        "dtype: local 'bfloat16' != remote 'float16'",
        "num_kv_heads: local 8 != remote 4",
    ]
    assert "layout: local 'NHD' != remote 'HND'" in sec.compat_diff(INFO, other, True)
    assert sec.compat_diff(INFO, INFO) == []


def test_compat_info_normalizes_and_validates() -> None:
    info = sec.CompatInfo("m", "torch.bfloat16", 8, 128, 32, "hnd", 16, False)  # type: ignore[arg-type]
    assert info.dtype == "bfloat16" and info.layout is KVLayout.HND
    assert sec.compat_hash(info) == sec.compat_hash(
        dataclasses.replace(info, dtype="bfloat16", layout=KVLayout.HND)
    )
    with pytest.raises(ConfigError, match="num_kv_heads must be an int >= 1, got 0"):
        dataclasses.replace(INFO, num_kv_heads=0)
    with pytest.raises(ConfigError, match="head_dim"):
        dataclasses.replace(INFO, head_dim=True)
    with pytest.raises(ConfigError, match="model"):
        dataclasses.replace(INFO, model="")
    with pytest.raises(ValueError, match="layout"):
        dataclasses.replace(INFO, layout="XYZ")  # type: ignore[arg-type]


def test_compat_info_round_trips_through_msgspec() -> None:
    encoded = msgspec.json.encode(INFO)
    assert msgspec.json.decode(encoded, type=sec.CompatInfo) == INFO
    bad = encoded.replace(b'"num_layers":32', b'"num_layers":0')
    with pytest.raises(msgspec.ValidationError, match="num_layers"):
        msgspec.json.decode(bad, type=sec.CompatInfo)


def test_compat_hash_is_stable_across_processes() -> None:
    code = (
        "from kvbridge.topology import KVLayout\n"
        "from kvbridge.transfer.protocol.security import CompatInfo, compat_hash\n"
        f"info = CompatInfo({INFO.model!r}, {INFO.dtype!r}, {INFO.num_kv_heads}, "
        f"{INFO.head_dim}, {INFO.num_layers}, KVLayout.{INFO.layout.name}, "
        f"{INFO.block_size}, {INFO.is_mla})\n"
        "print(compat_hash(info), compat_hash(info, True))\n"
    )
    expected = f"{sec.compat_hash(INFO)} {sec.compat_hash(INFO, True)}"
    for seed in ("0", "12345"):  # a different str hash seed in each child
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected
