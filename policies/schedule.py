"""Built-in scheduling policies: the order in which waiting requests are admitted (see base.SchedulePolicy)."""
from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

from radixserve.policies.base import R, CacheView

MAX_MATCHED = 256  # prefix matching is O(prompt) per request: the oldest this many are matched, the rest wait


def by_arrival(waiting: list[R]) -> list[R]:
    return sorted(waiting, key=lambda r: r.arrival)


def uncached(req: R, cache: CacheView) -> int:
    """Tokens ``req`` would compute if admitted now: what the cache does not hold (at least one, always computed)."""
    return max(1, len(req.fill_ids) - cache.match_len(req.fill_key))


def oldest_matched(waiting: list[R], key: Callable[[R], Any]) -> list[R]:
    """The oldest MAX_MATCHED of ``waiting`` sorted by ``key`` (a key that matches the cache), the rest after
    them by arrival."""
    queue = by_arrival(waiting)
    return sorted(queue[:MAX_MATCHED], key=key) + queue[MAX_MATCHED:]


class FCFS:
    """First come, first served (a retracted request keeps its arrival time, so it goes first again). Cache-aware
    in one way only: of arrivals that share a prefix nobody has cached (a system prompt's first requests), the
    first computes it and the others wait one step to reuse it, rather than each computing it in the same step."""

    name = "fcfs"
    cache_aware = True

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return by_arrival(waiting)


class LongestPrefixMatch:
    """Longest cached prefix first: requests that reuse most of the cache run while it is still there.
    Ties by arrival. Can starve a request that matches nothing while matching ones keep coming (see lpm-aging).
    Of a very long queue, the oldest MAX_MATCHED are ordered so, the rest follow by arrival."""

    name = "lpm"
    cache_aware = True

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return oldest_matched(waiting, lambda r: (-cache.match_len(r.fill_key), r.arrival))


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


def by_priority(waiting: list[R]) -> list[R]:
    return sorted(waiting, key=lambda r: (-r.priority, r.arrival))


class Priority:
    """Highest request priority first, first come first served among equals."""

    name = "priority"
    cache_aware = False

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return by_priority(waiting)


class PriorityPreempt:
    """``priority``, and an arrival that does not fit the KV pool takes the room of running requests of strictly
    lower priority: the scheduler retracts them (lowest priority first, then fewest generated tokens; their KV
    stays cached, they rejoin the queue where they arrived and resume with the same output). A request is
    retracted so at most ``max_preemptions`` times; after that preemption never takes it out again, so it cannot
    keep a request from finishing (in the queue it waits behind higher priorities, as with ``priority``). It
    frees KV room only, not places under --max-running-requests (then the arrival waits, as with ``priority``)."""

    name = "priority-preempt"
    cache_aware = False
    preempt = True
    max_preemptions = 2

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return by_priority(waiting)


class ShortestExtend:
    """Fewest uncached tokens first (what it needs computed minus the cached prefix: the cheapest prefill first),
    ties by arrival.
    Of a very long queue, the oldest MAX_MATCHED are ordered so, the rest follow by arrival. No bound on waiting:
    a long uncached prompt can wait while shorter ones keep coming (see sjf-aging)."""

    name = "shortest-extend"
    cache_aware = True

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return oldest_matched(waiting, lambda r: (uncached(r, cache), r.arrival))


class SJFAging:
    """Shortest job first, with aging. A job's size is the tokens it costs: its uncached tokens (see
    shortest-extend) plus its output budget ``max_new_tokens``. Waiting earns credit: the effective size is
    ``size - aging_tokens_per_s * wait``, smallest first, ties by arrival.

    Every request's credit grows at the same rate, so the order is that of ``size / aging_tokens_per_s +
    arrival``. The bound: a request of size S (at most its prompt plus its budget) goes ahead of every request
    that arrived more than (S - 1) / aging_tokens_per_s seconds after it (a size is at least 1), so only the
    requests that arrived before that moment can delay it: at the default, 4 s of arrivals for a 4000-token
    job. Of a very long queue, the oldest MAX_MATCHED are ordered so, the rest follow by arrival."""

    name = "sjf-aging"
    cache_aware = True
    aging_tokens_per_s = 1000.0

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]:
        return oldest_matched(waiting, lambda r: (self.effective_size(r, cache, now), r.arrival))

    def effective_size(self, req: R, cache: CacheView, now: float) -> float:
        size = uncached(req, cache) + req.max_new_tokens
        return size - self.aging_tokens_per_s * (now - req.arrival)
