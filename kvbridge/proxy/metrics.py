"""``GET /metrics`` of the P/D proxy: Prometheus text through ``prometheus_client``.

``app.py`` owns one :class:`ProxyMetrics` (a registry of its own: tests run
several proxies in one process), counted by ``recovery.py``. No engine
families: the engines' own ``/metrics`` carry those. Imports no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

__all__ = ["CONTENT_TYPE", "ProxyMetrics"]

#: ``Content-Type`` of the exposition.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class ProxyMetrics:
    """What the P/D proxy counts, with a registry of its own (``GET /metrics`` of the proxy).

    One event loop updates it: no locking. The object is its registry's collector.

    Args:
        prefix: Metric name prefix (``kvbridge`` -> ``kvbridge_proxy_...``).

    Attributes:
        num_resent: First-token continuations sent again after their D failed, by the
            role that got the copy (``decode``: another or the same D, without
            P's params; ``prefill``: a P).
        num_unfinished: First-token continuations no backend could finish (the
            client got an error after P's token).
        registry: This proxy's own ``CollectorRegistry``.
    """

    def __init__(self, prefix: str = "kvbridge") -> None:
        self.prefix = prefix
        self.num_resent: Counter[str] = Counter()
        self.num_unfinished = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def exposition(self) -> bytes:
        """The whole ``/metrics`` page, as Prometheus text (version 0.0.4)."""
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Metric]:
        """The families of one scrape (``prometheus_client`` collector protocol)."""
        resent = CounterMetricFamily(
            f"{self.prefix}_proxy_continuations_resent_total",
            "First-token continuations sent again after D failed, by the role that got "
            "them (decode: recomputing the prompt; prefill: P continues).", labels=["role"])
        for role in ("decode", "prefill"):
            resent.add_metric([role], self.num_resent[role])
        unfinished = CounterMetricFamily(
            f"{self.prefix}_proxy_continuations_unfinished_total",
            "First-token continuations no backend could finish (the client got an error).",
            value=self.num_unfinished)
        return [resent, unfinished]
