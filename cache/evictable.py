"""The eviction queue: unlocked leaves of the radix tree, ordered by the eviction policy, cheapest victim first.

A plain heap rebuilt over every leaf on each eviction is SGLang's known hot spot. Here entries are pushed
incrementally, whenever a node *becomes* an evictable leaf or its metadata changes, and stale entries are skipped
lazily at pop time. An entry is stale when the node was pushed again since (its ``heap_version`` moved on) or is
no longer an evictable leaf. Every push checks the heap against the tree's size: once it holds more than twice as
many entries as the tree has nodes (plus a constant), it is rebuilt from the live leaves -- amortised O(1), and
bounded even when nothing is ever evicted (a million hits on one cached prompt leave a heap of a few entries).

The policy may be third-party code: if it raises (or returns keys that do not compare), it is replaced by the
policy it replaced (LRU at worst), the error is recorded, and every key is recomputed -- never a mix of two
policies' keys in one heap.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from radixserve.policies.eviction import LRU

COMPACT_SLACK = 1024  # stale entries tolerated beyond 2x the tree's size before a rebuild

if TYPE_CHECKING:
    from radixserve.cache.radix_tree import TreeNode
    from radixserve.policies.base import EvictionPolicy


class EvictionQueue:
    def __init__(self, policy: EvictionPolicy, leaves: Callable[[], Iterable[TreeNode]],
                 clock: Callable[[], float], num_nodes: Callable[[], int]) -> None:
        self.policy = policy  # the setter looks up its on_evict hook
        self.fallback: EvictionPolicy = LRU()
        self.errors: deque[str] = deque(maxlen=100)  # the newest failures of replaced policies
        self._leaves = leaves  # every evictable leaf of the tree, for rebuilds
        self._num_nodes = num_nodes  # the tree's size: the most live entries there can be
        self._clock = clock
        self._heap: list[tuple[Any, int, int, TreeNode]] = []
        self._tiebreak = itertools.count()
        self._generation = 0  # bumped whenever a failing policy is replaced

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._on_evict = getattr(policy, "on_evict", None)  # looked up once, not per victim

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Swap the policy and re-key; ValueError (old policy kept) if the new one fails on this cache."""
        self.fallback, self.policy = self.policy, policy
        self.rebuild()
        if self.policy is not policy:
            raise ValueError(self.errors[-1])

    def push(self, node: TreeNode) -> None:
        """(Re)queue ``node`` with its current key; any older entry for it becomes stale."""
        generation = self._generation
        key = self._key(node)
        node.heap_version += 1
        try:
            heapq.heappush(self._heap, (key, next(self._tiebreak), node.heap_version, node))
        except TypeError as exc:
            self._failed(exc)
        if generation != self._generation or len(self._heap) > 2 * self._num_nodes() + COMPACT_SLACK:
            self.rebuild()

    def pop(self) -> tuple[TreeNode, Any] | None:
        """The evictable leaf with the smallest key and that key, removed from the queue; None if none."""
        while self._heap:
            try:
                key, _, version, node = heapq.heappop(self._heap)
            except TypeError as exc:
                self._failed(exc)
                self.rebuild()
                continue
            if version == node.heap_version and node.is_evictable_leaf:
                node.heap_version += 1
                return node, key
        return None

    def evicted(self, node: TreeNode, key: Any) -> None:
        hook = self._on_evict
        if hook is None:
            return
        try:
            hook(node, key, self._clock())
        except Exception as exc:
            self._failed(exc)
            self.rebuild()

    def rebuild(self) -> None:
        """Re-key every live leaf from scratch; again if the policy failed meanwhile."""
        while True:
            generation = self._generation
            entries = []
            for node in self._leaves():
                key = self._key(node)
                node.heap_version += 1
                entries.append((key, next(self._tiebreak), node.heap_version, node))
            try:
                heapq.heapify(entries)
            except TypeError as exc:
                self._failed(exc)
            if generation == self._generation:
                self._heap = entries
                return

    def _key(self, node: TreeNode) -> Any:
        try:
            return self.policy.key(node, self._clock())
        except Exception as exc:
            self._failed(exc)
            return self.policy.key(node, self._clock())

    def _failed(self, exc: Exception) -> None:
        bad = self.policy
        self.policy = self.fallback if self.fallback is not bad else LRU()
        self.fallback = LRU()
        self._generation += 1
        self.errors.append(f"eviction policy {bad.name!r} raised {type(exc).__name__}: {exc}; "
                           f"switched to {self.policy.name!r}")
