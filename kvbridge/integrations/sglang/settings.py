"""How the SGLang backend is configured: environment variables, read once per scheduler.

SGLang has no per-backend options, so kvbridge reads its own from the
environment of the P and D servers (the same on every rank):

    KVBRIDGE_SECRET / KVBRIDGE_SECRET_FILE   the cluster secret (every P and D);
        unset on one host: this user's host secret, made on first use
    KVBRIDGE_INSECURE=1     no authentication (logged at every start)
    KVBRIDGE_HOST           where the transfer agents listen and are read from
        (default: SGLang's --host when it is a loopback address, else the
        address SGLang advertises for its ranks)
    KVBRIDGE_AGENT          JSON object of transfer agent settings
        (``kvbridge.transfer.agent_config.AgentConfig``), e.g. '{"lease_s": 20}'

The secret authenticates the transfer agents' handshake and the control
messages on SGLang's ZMQ sockets (``messages.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.transfer.agent_config import AgentConfig
from kvbridge.transfer.protocol.cluster_secret import cluster_secret, is_loopback

__all__ = ["SglangSettings"]

_FIX = ("set KVBRIDGE_SECRET (or KVBRIDGE_SECRET_FILE) to the same secret on every P and D "
        "server, or KVBRIDGE_INSECURE=1")


def _flag(value: str, name: str) -> bool:
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r}: expected 1/true/yes/on or 0/false/no/off")


@dataclass(frozen=True, slots=True)
class SglangSettings:
    """One scheduler's kvbridge settings (see the module docstring)."""

    host: str
    secret: bytes | None
    agent: AgentConfig

    @classmethod
    def from_env(cls, serving_host: str, rank_ip: str,
                 environ: Mapping[str, str] | None = None) -> SglangSettings:
        """Read the settings.

        Args:
            serving_host: SGLang's ``--host``.
            rank_ip: the address SGLang advertises for this rank (its ZMQ socket's).
            environ: environment to read (default ``os.environ``).

        Raises:
            ConfigError: a bad ``KVBRIDGE_AGENT``, or no usable secret (named fix).
        """
        env = os.environ if environ is None else environ
        host = env.get("KVBRIDGE_HOST") or (serving_host if is_loopback(serving_host)
                                             else rank_ip)
        raw = env.get("KVBRIDGE_AGENT", "")
        try:
            options = json.loads(raw) if raw else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"KVBRIDGE_AGENT is not JSON: {exc}") from None
        if not isinstance(options, dict):
            raise ConfigError(f"KVBRIDGE_AGENT must be a JSON object, got {raw[:80]!r}")
        # The agents listen where they are read from, unless the deployment names
        # another address to listen on (0.0.0.0 behind a NAT, ...).
        agent = AgentConfig.from_options({"listen_host": host, **options})
        insecure = _flag(env.get("KVBRIDGE_INSECURE", ""), "KVBRIDGE_INSECURE")
        secret = cluster_secret(host, secret_file=env.get("KVBRIDGE_SECRET_FILE") or None,
                                insecure=insecure, environ=env, fix=_FIX)
        return cls(host=host, secret=secret, agent=agent)
