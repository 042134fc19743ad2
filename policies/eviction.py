"""Built-in eviction policies. Smaller key = evicted first."""
from __future__ import annotations

from radixserve.policies.base import NodeView


class LRU:
    """Least recently used: the segment untouched for longest goes first; deeper segments first on ties
    (a longer cached path keeps its shared root)."""

    name = "lru"

    def key(self, node: NodeView, now: float) -> tuple[float, int]:
        return (node.last_access, -node.depth)
