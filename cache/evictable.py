"""The evictable-leaf queue: unlocked leaves of the radix tree, cheapest victim first.

A plain heap rebuilt over every leaf on each eviction is SGLang's known hot spot. Here entries are pushed
incrementally, whenever a node *becomes* an evictable leaf or its metadata changes, and stale entries are skipped
lazily at pop time. An entry is stale when the node was pushed again since (its ``heap_version`` moved on) or is
no longer an evictable leaf. When stale entries outnumber live ones the heap is rebuilt once (amortised O(1)).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.cache.radix_tree import TreeNode


class EvictableLeaves:
    def __init__(self, key_fn: Callable[[TreeNode], Any]) -> None:
        # key_fn(node) -> sortable; smaller is evicted first. Evaluated at push time only.
        self.key_fn = key_fn
        self._heap: list[tuple[Any, int, int, TreeNode]] = []
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        """(Re)queue ``node`` with its current key; any older entry for it becomes stale."""
        node.heap_version += 1
        heapq.heappush(self._heap, (self.key_fn(node), next(self._tiebreak), node.heap_version, node))

    def pop(self) -> TreeNode | None:
        """The evictable leaf with the smallest key, removed from the queue; None if there is none."""
        while self._heap:
            _, _, version, node = heapq.heappop(self._heap)
            if version == node.heap_version and node.is_evictable_leaf:
                node.heap_version += 1
                return node
        return None

    def maybe_compact(self, live_leaves: Callable[[], Iterable[TreeNode]], num_live_hint: int) -> None:
        """Drop stale entries once they dominate the heap (keeps memory bounded under churn)."""
        if len(self._heap) > 2 * num_live_hint + 1024:
            self.rebuild(live_leaves())

    def rebuild(self, leaves: Iterable[TreeNode]) -> None:
        """Re-key every live leaf from scratch (used after an eviction policy is swapped in)."""
        self._heap = []
        for node in leaves:
            node.heap_version += 1
            self._heap.append((self.key_fn(node), next(self._tiebreak), node.heap_version, node))
        heapq.heapify(self._heap)
