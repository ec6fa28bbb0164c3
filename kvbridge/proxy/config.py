"""The proxy's configuration: its backends and time and size limits.

``kvbridge/cli/proxy.py`` builds a :class:`ProxyConfig` from its flags
(``backend_urls`` normalises them); ``app.py`` reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.errors import ConfigError

__all__ = ["ProxyConfig", "backend_urls"]


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Backends and time limits of a proxy.

    Attributes:
        prefill_urls: Base URLs of the prefill instances (``http://host:port``).
        decode_urls: Base URLs of the decode instances.
        connect_timeout_s: Limit on opening a backend connection.
        prefill_timeout_s: Limit on a whole prefill call.
        decode_timeout_s: Limit on a non-streamed decode call, and on a streamed
            one until its first byte.
        read_timeout_s: Longest silence within a streamed decode answer.
        health_timeout_s: Limit on one backend health check.
        max_body_nbytes: Largest request body accepted.
        unhealthy_backoff_s: How long a backend that failed is skipped before
            its ``/health`` is probed again.
        first_token: send P's token to the client as the first token and ask D
            for the rest (module docstring); False: the classic flow only.
        max_choices: Most choices (``n`` times the prompts) one request may ask for.

    Raises:
        ConfigError: an empty pool, a URL that is not ``http(s)://``, or a
            limit that is not positive.
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 300.0
    read_timeout_s: float = 120.0
    health_timeout_s: float = 2.0
    max_body_nbytes: int = 16 << 20
    unhealthy_backoff_s: float = 5.0
    first_token: bool = True
    max_choices: int = 64

    def __post_init__(self) -> None:
        for pool in ("prefill_urls", "decode_urls"):
            urls = tuple(u.rstrip("/") for u in getattr(self, pool))
            if not urls:
                raise ConfigError(f"{pool} must name at least one backend")
            bad = [u for u in urls if not u.startswith(("http://", "https://"))]
            if bad:
                raise ConfigError(f"{pool}: {bad} are not http:// or https:// URLs")
            object.__setattr__(self, pool, urls)
        limits = {"connect_timeout_s": self.connect_timeout_s,
                  "prefill_timeout_s": self.prefill_timeout_s,
                  "decode_timeout_s": self.decode_timeout_s,
                  "read_timeout_s": self.read_timeout_s,
                  "health_timeout_s": self.health_timeout_s,
                  "max_body_nbytes": self.max_body_nbytes,
                  "unhealthy_backoff_s": self.unhealthy_backoff_s,
                  "max_choices": self.max_choices}
        bad_limits = {k: v for k, v in limits.items() if not v > 0}
        if bad_limits:
            raise ConfigError(f"time and size limits must be > 0, got {bad_limits}")


def backend_urls(values: Sequence[str]) -> tuple[str, ...]:
    """Normalise ``host:port`` or URL arguments to base URLs (``http://`` by default)."""
    return tuple(v if "://" in v else f"http://{v}" for v in values)
