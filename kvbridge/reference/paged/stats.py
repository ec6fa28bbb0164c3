"""Prefix-cache statistics and a hit-rate window over recent requests.

``KVCacheManager`` fills a ``PrefixCacheStats`` while the scheduler looks up
cached prefixes and hands it out (and starts a new one) through
``make_prefix_cache_stats()``. A metrics logger feeds those records into
``PrefixCacheHitWindow`` to report the hit rate of roughly the last N requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``make_prefix_cache_stats()``.

    Attributes:
        requests: Requests that looked up the cache.
        queries: Tokens those requests asked for (their whole length).
        hits: Tokens found in the cache.
        reset: The prefix cache was reset during the interval; older history
            no longer describes the cache.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's lookup.

        Args:
            num_queried_tokens: Tokens the request asked for.
            num_hit_tokens: Tokens found in the cache (<= num_queried_tokens).

        Raises:
            ValueError: negative counts or more hits than queried tokens.
        """
        if num_queried_tokens < 0 or not 0 <= num_hit_tokens <= num_queried_tokens:
            raise ValueError(
                f"invalid prefix-cache lookup: {num_hit_tokens} hit tokens out of "
                f"{num_queried_tokens} queried"
            )
        self.requests += 1
        self.queries += num_queried_tokens
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens in this record, 0.0 when nothing was queried."""
        return self.hits / self.queries if self.queries else 0.0


class PrefixCacheHitWindow:
    """Hit rate over (about) the most recent ``max_recent_requests`` requests.

    Records are kept whole: the oldest records are dropped while the window holds
    more than ``max_recent_requests`` requests, but the newest record always stays
    (so one huge record may exceed the limit on its own). A record with
    ``reset=True`` clears the window first, since hits measured against the old
    cache contents no longer say anything about the new one.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        """Create an empty window.

        Args:
            max_recent_requests: Number of recent requests the rate covers.

        Raises:
            ValueError: ``max_recent_requests`` < 1.
        """
        if max_recent_requests < 1:
            raise ValueError(f"max_recent_requests must be >= 1, got {max_recent_requests}")
        self.max_recent_requests = max_recent_requests
        # (requests, queries, hits) per observed record, oldest first.
        self._records: deque[tuple[int, int, int]] = deque()
        self._num_requests = 0
        self._num_queries = 0
        self._num_hits = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        """Add one interval's stats (typically one scheduler step).

        Args:
            stats: A record returned by ``KVCacheManager.make_prefix_cache_stats``.
        """
        if stats.reset:
            self.clear()
        if stats.requests == 0:
            return
        self._records.append((stats.requests, stats.queries, stats.hits))
        self._num_requests += stats.requests
        self._num_queries += stats.queries
        self._num_hits += stats.hits
        while len(self._records) > 1 and self._num_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self._records.popleft()
            self._num_requests -= old_requests
            self._num_queries -= old_queries
            self._num_hits -= old_hits

    def clear(self) -> None:
        """Forget every observed record."""
        self._records.clear()
        self._num_requests = self._num_queries = self._num_hits = 0

    @property
    def num_requests(self) -> int:
        """Requests currently covered by the window."""
        return self._num_requests

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens over the window, 0.0 when empty."""
        return self._num_hits / self._num_queries if self._num_queries else 0.0
