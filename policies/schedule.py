"""Built-in scheduling policies: the order in which waiting requests are admitted (see base.SchedulePolicy)."""
from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Hashable

from radixserve.policies.base import R, CacheView

MAX_MATCHED = 256  # prefix matching is O(prompt) per request: the oldest this many are matched, the rest wait


def by_arrival(waiting: list[R]) -> list[R]:
    return sorted(waiting, key=lambda r: r.arrival)


class FCFS:
    """First come, first served (a retracted request keeps its arrival time, so it goes first again)."""

    name = "fcfs"
    cache_aware = False

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return by_arrival(waiting)


class LongestPrefixMatch:
    """Longest cached prefix first: requests that reuse most of the cache run while it is still there.
    Ties by arrival. Can starve a request that matches nothing while matching ones keep coming (see lpm-aging).
    Of a very long queue, the oldest MAX_MATCHED are ordered so, the rest follow by arrival."""

    name = "lpm"
    cache_aware = True

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        queue = by_arrival(waiting)
        head, tail = queue[:MAX_MATCHED], queue[MAX_MATCHED:]
        return sorted(head, key=lambda r: (-cache.match_len(r.fill_key), r.arrival)) + tail


class LPMAging:
    """LPM with a bound on waiting: a request that has waited ``max_wait_s`` goes ahead of every younger one
    (oldest first), so no request waits much longer than max_wait_s plus the time to serve those ahead of it."""

    name = "lpm-aging"
    cache_aware = True
    max_wait_s = 5.0

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        overdue = by_arrival([r for r in waiting if now - r.arrival >= self.max_wait_s])
        fresh = [r for r in waiting if now - r.arrival < self.max_wait_s]
        return overdue + LongestPrefixMatch().order(fresh, cache, now)


class DFSWeight:
    """Walk the cached-prefix tree of the waiting requests depth first, heaviest subtree (most waiting requests)
    first, deepest prefixes before the requests that stop higher up: requests sharing a prefix run back to back,
    the most shared first; requests matching nothing come last."""

    name = "dfs-weight"
    cache_aware = True

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        queue = by_arrival(waiting)
        return self._dfs(queue[:MAX_MATCHED], cache) + queue[MAX_MATCHED:]

    def _dfs(self, waiting: list[R], cache: CacheView) -> list[R]:
        root: Hashable = ()
        children: dict[Hashable, list[Hashable]] = defaultdict(list)
        ends: dict[Hashable, list[R]] = defaultdict(list)  # requests whose cached prefix ends at a node
        weight: dict[Hashable, int] = defaultdict(int)
        for req in waiting:
            parent = root
            weight[root] += 1
            for node in cache.match_path(req.fill_key):
                if node not in weight:
                    children[parent].append(node)
                weight[node] += 1
                parent = node
            ends[parent].append(req)
        out: list[R] = []
        stack: list[tuple[Hashable, bool]] = [(root, False)]
        while stack:  # iterative post-order: a node's subtrees (heaviest first), then its own requests
            node, expanded = stack.pop()
            if expanded:
                out.extend(ends[node])
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in sorted(children[node], key=lambda c: weight[c]))
        return out


class LongestOutputFirst:
    """Largest output budget (max_new_tokens) first: long generations start early, short ones fill in."""

    name = "lof"
    cache_aware = False

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return sorted(waiting, key=lambda r: (-r.max_new_tokens, r.arrival))


class Random:
    """A random order from the policy's own seeded generator: the baseline every other policy should beat."""

    name = "random"
    cache_aware = False
    seed = 0

    def __init__(self) -> None:
        self.rng = random.Random(self.seed)

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        out = by_arrival(waiting)
        self.rng.shuffle(out)
        return out


class Priority:
    """Highest request priority first, first come first served among equals."""

    name = "priority"
    cache_aware = False

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return sorted(waiting, key=lambda r: (-r.priority, r.arrival))
