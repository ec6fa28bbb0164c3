"""``kvbridge serve --transfer-option NAME=VALUE``: the agent knobs the fault tests turn.

Unit tests (no processes): flags reach ``ConnectorSettings.agent``; bad names and
values are refused with the offending text; an "or off" knob accepts 0 but
nothing negative.
"""

from __future__ import annotations

import argparse

import pytest

from kvbridge.cli.main import main
from kvbridge.cli.serve import add_serve_parser, build_engine_config, parse_agent_options
from kvbridge.errors import ConfigError
from kvbridge.transfer.agent_config import AgentConfig


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_options_reach_the_connector_settings() -> None:
    config = build_engine_config(serve_args(
        "--role", "prefill", "--transfer-port", "7000",
        "--transfer-option", "chunk_timeout_s=2.5", "--transfer-option", " chunk_nbytes = 65536 ",
        "--transfer-option", "local_copy_min_nbytes=4096"))
    assert config.connector is not None and config.connector.agent is not None
    agent = config.connector.agent
    assert (agent.chunk_timeout_s, agent.local_copy_min_nbytes) == (2.5, 4096)
    assert agent.chunk_nbytes == 65536
    assert isinstance(agent.chunk_nbytes, int)
    assert agent.heartbeat_s == AgentConfig().heartbeat_s  # the rest stays default
    plain = build_engine_config(serve_args("--role", "prefill", "--transfer-port", "7000"))
    assert plain.connector is not None and plain.connector.agent is None


@pytest.mark.parametrize("item, message", [
    ("chunk_timeout_s", "NAME=VALUE"),
    ("no_such_knob=1", "no_such_knob"),
    ("chunk_nbytes=1.5", "not an integer"),
    ("heartbeat_s=soon", "not a number"),
    ("heartbeat_s=0", "heartbeat_s must be finite and > 0"),
    ("read_timeout_s=inf", "read_timeout_s must be finite"),
    ("local_copy_min_nbytes=-1", "local_copy_min_nbytes must be >= 0"),
    ("test_chunk_delay_s=0.2", "test_chunk_delay_s"),  # no test knob in production
])
def test_bad_options_are_refused(item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_agent_options([item])


def test_options_need_the_connector(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="--transfer-port"):
        build_engine_config(serve_args("--transfer-option", "heartbeat_s=1"))
    assert main(["serve", "--transfer-port", "7000", "--transfer-option", "bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_an_or_off_knob_takes_zero_and_other_knobs_do_not() -> None:
    assert AgentConfig(local_copy_min_nbytes=0).local_copy_min_nbytes == 0
    with pytest.raises(ConfigError, match="lease_s must be finite and > 0"):
        AgentConfig(lease_s=0.0)  # zero stays invalid for every other knob
    with pytest.raises(ConfigError, match="window_chunks"):
        AgentConfig(window_chunks=True)  # a bool is no count
