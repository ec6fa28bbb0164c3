"""``kv_connector_extra_config`` parsing (no vLLM process needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.settings import (
    SYNC_LOAD_MAX_BYTES,
    VllmSettings,
    for_data_parallel_rank,
    for_failure_policy,
    parse_settings,
)


def test_zero_config_is_one_host_with_free_ports() -> None:
    for raw in (None, {}):
        settings = parse_settings(raw)
        assert settings == VllmSettings()
        assert (settings.host, settings.base_port, settings.secret_file) == ("127.0.0.1", 0, None)
    assert parse_settings({}).agent_config().lease_s == 30.0


def test_multi_host_settings(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123\n")
    secret.chmod(0o600)
    settings = parse_settings({"host": "10.0.0.1", "base_port": 5600, "lease_s": 12,
                               "secret_file": str(secret), "agent": {"read_timeout_s": 9}})
    assert settings.secret() == b"0123456789abcdef0123"
    config = settings.agent_config()
    assert (config.lease_s, config.read_timeout_s) == (12.0, 9.0)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ([1], "JSON object"),
        ({"hostt": "x"}, "hostt"),
        ({"base_port": 70000}, "base_port"),
        ({"base_port": 80}, "base_port"),
        ({"lease_s": 0}, "lease_s"),
        ({"idle_wait_s": 5}, "idle_wait_s"),
        ({"sync_load_max_bytes": -1}, "sync_load_max_bytes"),
        ({"sync_load_max_bytes": 1.5}, "sync_load_max_bytes"),
        ({"host_buffer": "yes"}, "host_buffer"),
        ({"agent": {"no_such_option": 1}}, "no_such_option"),
        ({"agent": {"read_timeout_s": -1}}, "read_timeout_s"),
    ],
)
def test_bad_settings_name_the_field(raw: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_settings(raw)


def test_unreadable_secret_file_is_a_config_error(tmp_path: Path) -> None:
    settings = parse_settings({"secret_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="missing"):
        settings.secret()


def test_settings_and_kvbridge_import_without_vllm() -> None:
    import subprocess
    import sys

    code = ("import sys, kvbridge, kvbridge.integrations.vllm.settings, "
            "kvbridge.integrations.vllm.facts; assert 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_data_parallel_ranks_never_share_a_fixed_port() -> None:
    settings = parse_settings({"base_port": 5600})
    # TP 2: DP rank 0 on 5600-5601, rank 1 on 5602-5603, rank 2 on 5604-5605
    assert [for_data_parallel_rank(settings, rank, 2).base_port for rank in range(3)] == [
        5600, 5602, 5604]
    free = parse_settings({})
    assert for_data_parallel_rank(free, 3, 2).base_port == 0  # free ports: nothing to move
    with pytest.raises(ConfigError, match="data-parallel rank 4 would listen on ports 65538"):
        for_data_parallel_rank(parse_settings({"base_port": 65530}), 4, 2)


def test_a_reachable_host_needs_a_secret_or_insecure(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
    monkeypatch.setenv("KVBRIDGE_SECRET_DIR", str(tmp_path / "kvb"))
    with pytest.raises(ConfigError, match=r"'10.0.0.1' is reachable.*secret_file.*insecure"):
        parse_settings({"host": "10.0.0.1"})
    insecure = parse_settings({"host": "10.0.0.1", "insecure": True,
                               "listen_host": "0.0.0.0"})
    assert insecure.secret() is None
    assert insecure.agent_config().listen_host == "0.0.0.0"
    # zero config on one host: authenticated by this user's host secret, bound to host
    local = parse_settings({})
    assert local.secret() == (tmp_path / "kvb" / "secret").read_bytes().strip()
    assert local.agent_config().listen_host == "127.0.0.1"


def test_holds_and_synchronous_loads_are_bounded_by_default() -> None:
    settings = parse_settings({})
    assert settings.max_held_share == 0.5 and settings.sync_load_deadline_s < 1
    # synchronous loads by default only where a late one is recomputed, not failed
    recompute = for_failure_policy(settings, "recompute")
    assert recompute.sync_load_max_bytes == SYNC_LOAD_MAX_BYTES
    assert for_failure_policy(settings, "fail").sync_load_max_bytes == 0
    chosen = parse_settings({"sync_load_max_bytes": 1 << 20})
    assert for_failure_policy(chosen, "fail").sync_load_max_bytes == 1 << 20
    # nothing larger than a synchronous load is copied on vLLM's forward thread
    assert recompute.agent_config().inline_copy_max_nbytes == SYNC_LOAD_MAX_BYTES
    assert for_failure_policy(settings, "fail").agent_config().inline_copy_max_nbytes == 0
    for bad in ({"max_held_share": 0}, {"max_held_share": 1.5}, {"sync_load_deadline_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            parse_settings(bad)
