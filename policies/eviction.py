"""Built-in eviction policies. Smaller key = evicted first (see base.EvictionPolicy)."""
from __future__ import annotations

import math

from radixserve.policies.base import NodeView


class LRU:
    """Least recently used first; deeper segments first on ties (the shared root of a path stays longest)."""

    name = "lru"

    def key(self, node: NodeView, now: float) -> tuple[float, int]:
        return (node.last_access, -node.depth)


class MRU:
    """Most recently used first: right for one-shot scans, where what was just used will not come back."""

    name = "mru"

    def key(self, node: NodeView, now: float) -> tuple[float, int]:
        return (-node.last_access, -node.depth)


class FIFO:
    """Oldest cached segment first, however often it is used."""

    name = "fifo"

    def key(self, node: NodeView, now: float) -> tuple[float, int]:
        return (node.created, -node.depth)


class FILO:
    """Newest cached segment first: the long-lived ones (e.g. a system prompt cached early) stay."""

    name = "filo"

    def key(self, node: NodeView, now: float) -> tuple[float, int]:
        return (-node.created, -node.depth)


class LFU:
    """Least frequently hit first, least recently used among equals."""

    name = "lfu"

    def key(self, node: NodeView, now: float) -> tuple[int, float]:
        return (node.hit_count, node.last_access)


class SLRU:
    """Segmented LRU: segments hit at most once (probation) go before segments hit again (protected); LRU
    within each. One-off prompts cannot flush out the prefixes that keep coming back."""

    name = "slru"
    protect_after_hits = 2

    def key(self, node: NodeView, now: float) -> tuple[int, float]:
        return (int(node.hit_count >= self.protect_after_hits), node.last_access)


class Priority:
    """Lowest request priority first (a node carries the highest priority of the requests that used it);
    LRU among equals."""

    name = "priority"

    def key(self, node: NodeView, now: float) -> tuple[int, float]:
        return (node.priority, node.last_access)


class GDSF:
    """Greedy-Dual-Size-Frequency, cost-aware: H = L + frequency * cost / size.

    size = the slots evicting the segment frees; cost = the compute to rebuild it, where a token at position p
    costs 1 + p / ATTENTION_SCALE (its MLP plus attention over the p tokens before it). So H grows with how often
    a segment is hit *and* how deep it sits: a long, often-hit prefix is worth more than a short one. L is the
    policy's clock: it becomes the H of each victim, so entries that stop being hit age out.
    """

    name = "gdsf"
    attention_scale = 2048.0

    def __init__(self) -> None:
        self.clock = 0.0

    def value(self, node: NodeView) -> float:
        mid = node.depth - node.num_tokens / 2  # mean position of the segment's tokens
        return (node.hit_count + 1) * (1.0 + mid / self.attention_scale)

    def key(self, node: NodeView, now: float) -> float:
        return self.clock + self.value(node)

    def on_evict(self, node: NodeView, key: float, now: float) -> None:
        self.clock = max(self.clock, key)


class HitDensity:
    """Size-aware with decay: the segment whose hits per cached token are lowest goes first, where hits halve
    every ``half_life_s`` seconds without use. A short, often-hit prefix (a system prompt) outlives a long one
    used once; a once-hot segment nobody uses any more decays and goes.

    density(t) = (hit_count + 1) * 2 ** (-(t - last_access) / half_life_s) / num_tokens   (+1: the insert)

    A key is computed once (when the node becomes an evictable leaf or its metadata changes) and compared with
    keys computed at other times, so it must not depend on ``now``. In log space the decay term splits:
    log2 density(t) = log2((hits + 1) / num_tokens) + last_access / half_life_s - t / half_life_s, and the last
    term is the same for every node at any one t. So the key drops it: comparing keys is comparing densities at
    any common moment, whenever each key was computed. The node keeps only a count of its hits, so they decay
    as if all had happened at its last access.
    """

    name = "hit-density"
    half_life_s = 60.0

    def key(self, node: NodeView, now: float) -> float:
        return math.log2((node.hit_count + 1) / max(node.num_tokens, 1)) + node.last_access / self.half_life_s
