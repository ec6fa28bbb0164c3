"""Zero-config authentication: the host secret, and which secret an instance uses.

``kvbridge/transfer/protocol/cluster_secret.py``. Without any configuration the
instances of one user on one host share a secret made on first use, private to
that user; another user's instance (here: another home directory, as another
user would have) has another secret and is refused before any KV moves (real
agents in child processes, real UCX).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.transfer.protocol.cluster_secret import (
    cluster_secret,
    host_secret,
    host_secret_dir,
    is_loopback,
)
from tests.integration.reads import issue, read, wait_read
from tests.ports import free_port_base
from tests.transfer.agent_proc import Host, Spec, logical

SECRET = "a configured secret of 32 bytes."


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_made_private_on_first_use_then_reused(tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "kvbridge"
    first = host_secret(folder)
    assert len(first) == 64 and bytes.fromhex(first.decode())  # 32 random bytes, hex
    assert mode(folder) == 0o700 and mode(folder / "secret") == 0o600
    assert host_secret(folder) == first
    assert host_secret(tmp_path / "other") != first
    assert sorted(p.name for p in folder.iterdir()) == ["secret"]  # no temporary left


def _race(folder: str, barrier: multiprocessing.synchronize.Barrier) -> str:
    barrier.wait()
    return host_secret(Path(folder)).decode()


def test_instances_starting_at_once_agree(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    num = 6
    with ctx.Manager() as manager:
        barrier = manager.Barrier(num)
        with ctx.Pool(num) as pool:
            secrets = pool.starmap(_race, [(str(tmp_path / "kvb"), barrier)] * num)
    assert len(set(secrets)) == 1
    assert sorted(p.name for p in (tmp_path / "kvb").iterdir()) == ["secret"]


def test_what_others_may_read_or_own_is_refused_naming_path_and_fix(tmp_path: Path) -> None:
    folder = tmp_path / "kvb"
    host_secret(folder)
    folder.chmod(0o755)
    with pytest.raises(ConfigError, match=rf"{folder}.*mode 755.*chmod 700"):
        host_secret(folder)
    folder.chmod(0o700)
    (folder / "secret").chmod(0o640)
    with pytest.raises(ConfigError, match=r"secret'? has mode 640.*chmod 600"):
        host_secret(folder)
    (folder / "secret").unlink()
    (tmp_path / "planted").write_text("known to someone else" * 4)
    (tmp_path / "planted").chmod(0o600)
    (folder / "secret").symlink_to(tmp_path / "planted")
    with pytest.raises(ConfigError, match="secret"):
        host_secret(folder)
    if os.geteuid() == 0:  # a directory someone else made for us
        squatted = tmp_path / "squatted"
        squatted.mkdir(mode=0o700)
        os.chown(squatted, 65534, 65534)
        with pytest.raises(ConfigError, match=r"belongs to uid 65534.*KVBRIDGE_SECRET_DIR"):
            host_secret(squatted)


def test_which_secret(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = {"HOME": str(tmp_path)}
    assert host_secret_dir(env) == tmp_path / ".cache" / "kvbridge"
    assert host_secret_dir({**env, "KVBRIDGE_SECRET_DIR": "/x"}) == Path("/x")
    # configured first, on any host
    assert cluster_secret("10.0.0.1", environ={**env, "KVBRIDGE_SECRET": SECRET}) == SECRET.encode()
    # zero config on one host: the host secret
    assert cluster_secret("127.0.0.1", environ=env) == host_secret(environ=env)
    # another host cannot know it: refuse, naming the fix
    with pytest.raises(ConfigError, match=r"'10.0.0.1' is reachable.*secret_file.*insecure"):
        cluster_secret("10.0.0.1", environ=env)
    # unless the operator says so, which is logged every time
    with caplog.at_level(logging.WARNING):
        assert cluster_secret("10.0.0.1", insecure=True, environ=env) is None
    assert "WITHOUT authentication" in caplog.text
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("10.0.0.1", "0.0.0.0", "myhost", "::"))


SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "num_blocks": 16}


def test_another_users_agent_is_refused_with_zero_config(tmp_path: Path) -> None:
    """P and a D of one user (one home) share the host secret; a D of another user
    (another home: another secret) is refused, and not one KV byte leaves P."""
    mine, theirs = str(tmp_path / "me"), str(tmp_path / "other")
    os.makedirs(mine), os.makedirs(theirs)
    p_spec = Spec("p-zc", seed=3, zero_config_home=mine, **SHAPE)
    d_spec = Spec("d-zc", seed=-1, zero_config_home=mine, **SHAPE)
    hosts = [Host(), Host(), Host()]
    try:
        server = hosts[0].add(replace(p_spec, port=free_port_base(1)))
        good = hosts[1].add(d_spec)
        rogue = hosts[2].add(replace(d_spec, engine_id="d-rogue", zero_config_home=theirs))
        before = server.call("counters").num_data_bytes_sent

        token = issue([server], "r-rogue", [2, 3], 1)
        read([rogue], [server], "r-rogue", token, [2, 3], [2, 3], 32)
        assert wait_read(rogue, "r-rogue")["failed"] == {2, 3}  # typed, reported
        assert server.call("counters").num_data_bytes_sent == before
        assert not any(layer.any() for layer in rogue.call("caches"))

        read([good], [server], "r-rogue", token, [2, 3], [5, 6], 32)  # the grant still stands
        assert wait_read(good, "r-rogue")["failed"] == set()
        got = logical(good.call("caches"), d_spec, [5, 6], 32)
        assert torch.equal(got, logical(server.call("caches"), p_spec, [2, 3], 32))
    finally:
        for host in hosts:
            host.close()
