"""The SGLang backend's settings from the environment (``integrations/sglang/settings.py``).

Each test passes its own environment to ``SglangSettings.from_env``, with
``KVBRIDGE_SECRET_DIR`` pointing at a temporary directory, so the host secret
of the user running the tests is never read or made.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.integrations.sglang.settings import SglangSettings
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.protocol.cluster_secret import SECRET_DIR_ENV

RANK_IP = "10.0.0.7"
SECRET = "a configured secret of 32 bytes."


@pytest.fixture
def secret_dir(tmp_path: Path) -> Path:
    return tmp_path / "kvbridge"


def env_of(secret_dir: Path, **variables: str) -> dict[str, str]:
    return {SECRET_DIR_ENV: str(secret_dir), **variables}


@pytest.mark.parametrize("serving_host", ["127.0.0.1", "localhost", "::1"])
def test_a_loopback_server_uses_the_host_secret(secret_dir: Path, serving_host: str) -> None:
    settings = SglangSettings.from_env(serving_host, RANK_IP, env_of(secret_dir))
    assert settings.host == serving_host and settings.agent.listen_host == serving_host
    assert settings.secret is not None and len(settings.secret) >= 32
    assert (secret_dir / "secret").read_bytes().strip() == settings.secret
    again = SglangSettings.from_env(serving_host, RANK_IP, env_of(secret_dir))
    assert again.secret == settings.secret  # every P and D rank of this user on this host
    assert settings.agent == AgentConfig(listen_host=serving_host)


@pytest.mark.parametrize("serving_host", ["0.0.0.0", "10.0.0.1", "node-3"])
def test_a_reachable_server_without_a_secret_is_refused(secret_dir: Path,
                                                        serving_host: str) -> None:
    for extra in ({}, {"KVBRIDGE_INSECURE": "0"}, {"KVBRIDGE_INSECURE": "false"},
                  {"KVBRIDGE_INSECURE": ""}):
        with pytest.raises(ConfigError, match=f"'{RANK_IP}'.*KVBRIDGE_SECRET.*KVBRIDGE_INSECURE"):
            SglangSettings.from_env(serving_host, RANK_IP, env_of(secret_dir, **extra))
    assert not secret_dir.exists()  # no host secret was made for a refused start


def test_a_configured_secret_is_used(secret_dir: Path, tmp_path: Path) -> None:
    settings = SglangSettings.from_env("0.0.0.0", RANK_IP,
                                       env_of(secret_dir, KVBRIDGE_SECRET=SECRET))
    assert (settings.host, settings.secret) == (RANK_IP, SECRET.encode())
    assert settings.agent.listen_host == RANK_IP
    local = SglangSettings.from_env("127.0.0.1", RANK_IP,
                                    env_of(secret_dir, KVBRIDGE_SECRET=SECRET))
    assert local.secret == SECRET.encode()  # configured beats the host secret
    assert not secret_dir.exists()

    path = tmp_path / "secret-file"
    path.write_bytes(b"a secret from a file, 32 bytes..\n")
    path.chmod(0o600)
    from_file = SglangSettings.from_env("0.0.0.0", RANK_IP, env_of(
        secret_dir, KVBRIDGE_SECRET_FILE=str(path), KVBRIDGE_SECRET=SECRET))
    assert from_file.secret == b"a secret from a file, 32 bytes.."  # the file wins
    with pytest.raises(ConfigError, match="KVBRIDGE_SECRET is set but empty"):
        SglangSettings.from_env("127.0.0.1", RANK_IP, env_of(secret_dir, KVBRIDGE_SECRET=""))
    with pytest.raises(ConfigError, match="cannot read cluster secret file"):
        SglangSettings.from_env("0.0.0.0", RANK_IP, env_of(
            secret_dir, KVBRIDGE_SECRET_FILE=str(tmp_path / "missing")))


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_insecure_runs_without_a_secret(secret_dir: Path, value: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        settings = SglangSettings.from_env("0.0.0.0", RANK_IP,
                                           env_of(secret_dir, KVBRIDGE_INSECURE=value))
    assert settings.secret is None and settings.host == RANK_IP
    assert "WITHOUT authentication" in caplog.text
    configured = SglangSettings.from_env("0.0.0.0", RANK_IP, env_of(
        secret_dir, KVBRIDGE_INSECURE=value, KVBRIDGE_SECRET=SECRET))
    assert configured.secret == SECRET.encode()  # a configured secret is still used


def test_kvbridge_host_overrides_both_addresses(secret_dir: Path) -> None:
    settings = SglangSettings.from_env("127.0.0.1", RANK_IP, env_of(
        secret_dir, KVBRIDGE_HOST="10.9.9.9", KVBRIDGE_SECRET=SECRET))
    assert settings.host == settings.agent.listen_host == "10.9.9.9"
    with pytest.raises(ConfigError, match="'10.9.9.9'.*KVBRIDGE_SECRET"):
        SglangSettings.from_env("127.0.0.1", RANK_IP, env_of(secret_dir,
                                                             KVBRIDGE_HOST="10.9.9.9"))
    local = SglangSettings.from_env("0.0.0.0", RANK_IP, env_of(secret_dir,
                                                              KVBRIDGE_HOST="127.0.0.2"))
    assert local.host == "127.0.0.2" and local.secret is not None  # the host secret


def test_kvbridge_agent_sets_agent_options(secret_dir: Path) -> None:
    settings = SglangSettings.from_env("127.0.0.1", RANK_IP, env_of(
        secret_dir, KVBRIDGE_AGENT='{"lease_s": 20, "read_timeout_s": 60.5}'))
    assert settings.agent == AgentConfig(lease_s=20.0, read_timeout_s=60.5,
                                         listen_host="127.0.0.1")
    for empty in ("", "{}"):
        plain = SglangSettings.from_env("127.0.0.1", RANK_IP,
                                        env_of(secret_dir, KVBRIDGE_AGENT=empty))
        assert plain.agent == AgentConfig()


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ("{lease_s: 20}", "KVBRIDGE_AGENT is not JSON"),
        ('{"lease_s": 20', "KVBRIDGE_AGENT is not JSON"),
        ("[1, 2]", "KVBRIDGE_AGENT must be a JSON object, got '\\[1, 2\\]'"),
        ("20", "KVBRIDGE_AGENT must be a JSON object"),
        ('"lease_s"', "KVBRIDGE_AGENT must be a JSON object"),
        ("null", "KVBRIDGE_AGENT must be a JSON object"),
        ('{"lease": 20}', "unknown AgentConfig field.*'lease'"),
        ('{"lease_s": 0}', "lease_s"),
        ('{"lease_s": "20"}', "lease_s.*'20' is not a number"),
        ('{"window_chunks": 1000}', "window_chunks"),
    ],
)
def test_bad_kvbridge_agent_is_refused(secret_dir: Path, raw: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        SglangSettings.from_env("127.0.0.1", RANK_IP, env_of(secret_dir, KVBRIDGE_AGENT=raw))


@pytest.mark.parametrize(("value", "insecure"), [
    ("On", True), (" TRUE ", True), ("0", False), ("False", False), ("off", False), ("", False),
])
def test_insecure_flag_words(secret_dir: Path, value: str, insecure: bool) -> None:
    env = env_of(secret_dir, KVBRIDGE_INSECURE=value)
    if insecure:
        assert SglangSettings.from_env("0.0.0.0", RANK_IP, env).secret is None
    else:  # not insecure: a reachable server with no secret is refused
        with pytest.raises(ConfigError, match="KVBRIDGE_SECRET"):
            SglangSettings.from_env("0.0.0.0", RANK_IP, env)


@pytest.mark.parametrize("value", ["maybe", "2", "insecure"])
def test_an_unclear_insecure_flag_is_refused(secret_dir: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="KVBRIDGE_INSECURE"):
        SglangSettings.from_env("127.0.0.1", RANK_IP, env_of(secret_dir,
                                                             KVBRIDGE_INSECURE=value))


def test_the_deployment_may_name_where_agents_listen(secret_dir: Path) -> None:
    """Behind a NAT the agents listen on 0.0.0.0 and are read from the advertised host."""
    settings = SglangSettings.from_env("0.0.0.0", RANK_IP, env_of(
        secret_dir, KVBRIDGE_SECRET=SECRET, KVBRIDGE_AGENT='{"listen_host": "0.0.0.0"}'))
    assert settings.host == RANK_IP and settings.agent.listen_host == "0.0.0.0"
