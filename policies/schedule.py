"""Built-in scheduling policies: the order in which waiting requests are admitted."""
from __future__ import annotations

from radixserve.policies.base import R, CacheView


class FCFS:
    """First come, first served (retracted requests keep their original arrival, so they go first again)."""

    name = "fcfs"

    def order(self, waiting: list[R], cache: CacheView) -> list[R]:
        return sorted(waiting, key=lambda r: r.arrival)


class LongestPrefixMatch:
    """Longest cached prefix first: requests that reuse most of the cache run while it is still there.
    Ties go by arrival. Matching is O(prompt) per request, so very long queues fall back to FCFS."""

    name = "lpm"
    max_queue_for_matching = 256

    def order(self, waiting: list[R], cache: CacheView) -> list[R]:
        if len(waiting) > self.max_queue_for_matching:
            return sorted(waiting, key=lambda r: r.arrival)
        return sorted(waiting, key=lambda r: (-cache.match_len(r.fill_ids), r.arrival))
