"""Radix tree over token ids: every cached prefix and the KV slots that hold it.

A node owns one token segment and the slots of exactly those tokens; children are keyed by their first token.
Locks run along the path to the root: a locked node (``lock_ref > 0``) is *protected*; an unlocked node is
*evictable*, and only unlocked leaves are actually evicted (a parent becomes a leaf once its children go).

    root ── [The cat sat] ── [ on the mat]      (leaf, lock_ref 0: evictable)
                         └── [ down]            (leaf, lock_ref 1: protected, a request is using it)
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.allocator import SLOT_DTYPE
from radixserve.cache.evictable import EvictionQueue
from radixserve.cache.invariants import require

if TYPE_CHECKING:
    from radixserve.policies.base import EvictionPolicy

EMPTY_SLOTS = np.zeros(0, dtype=SLOT_DTYPE)


@dataclass(eq=False, slots=True)
class TreeNode:
    tokens: tuple[int, ...]
    slots: np.ndarray
    parent: TreeNode | None
    depth: int  # tokens from the root to the end of this node
    created: float
    last_access: float
    hit_count: int = 0
    priority: int = 0
    lock_ref: int = 0
    heap_version: int = 0
    children: dict[int, TreeNode] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def is_evictable_leaf(self) -> bool:
        return self.parent is not None and self.lock_ref == 0 and not self.children


def _common_len(a: tuple[int, ...], b: tuple[int, ...] | list[int], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    if tuple(b[start : start + n]) == a[:n]:  # fast path: whole segment matches (C-level compare)
        return n
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixTree:
    """Prefix index of cached token sequences. No torch; slots are numpy int arrays.

    Contract:
      * ``match_prefix`` may split a node so the match ends on a node boundary; it never frees anything.
      * returned slots stay valid only while the returned node is locked.
      * ``insert`` frees (through ``free_slots``) any caller slot that duplicates a slot the tree already holds
        for the same token position, and takes ownership of the caller's slots for tokens that were new.
      * ``evict(0)`` is a no-op; ``evict(n)`` frees at least ``n`` tokens unless fewer are evictable.
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        free_slots: Callable[[np.ndarray], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.free_slots = free_slots
        now = clock()
        self.root = TreeNode(tokens=(), slots=EMPTY_SLOTS, parent=None, depth=0, created=now, last_access=now)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.version = 0  # bumped whenever the set of cached tokens changes (insert of new tokens, eviction)
        self.num_nodes = 0  # root excluded: bounds the eviction queue (it never holds more than ~2x this)
        self._queue = EvictionQueue(policy, self.evictable_leaves, clock, lambda: self.num_nodes)

    # -- policy ------------------------------------------------------------------------------------------
    @property
    def policy(self) -> EvictionPolicy:
        return self._queue.policy

    @property
    def policy_errors(self) -> list[str]:
        return list(self._queue.errors)

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Swap the eviction policy; node metadata is policy-neutral, so only the queue is re-keyed. The policy
        it replaces becomes the fallback should the new one fail (ValueError if it fails right away)."""
        self._queue.set_policy(policy)

    # -- lookups -----------------------------------------------------------------------------------------
    def match_len(self, tokens: list[int] | tuple[int, ...]) -> int:
        """Read-only: how many leading tokens are cached. Splits nothing, touches nothing."""
        return sum(n for _, n in self._path(tokens))

    def match_path(self, tokens: list[int] | tuple[int, ...]) -> list[int]:
        """Read-only: ids of the nodes the cached prefix of ``tokens`` runs through (a partial last node too)."""
        return [id(node) for node, _ in self._path(tokens)]

    def match_prefix(self, tokens: list[int] | tuple[int, ...], hit: bool = True, priority: int = 0,
                     touch: bool = True) -> tuple[np.ndarray, TreeNode]:
        """Longest cached prefix of ``tokens``: its slots and the node it ends on (root if none).

        With ``touch``, the path is used now (see ``touch``). Without it only the structure may change (a split
        so the match ends on a node boundary): what a caller that may still back out wants, so a request that is
        not admitted after all leaves no access time and no hit behind.
        """
        node, parts = self.root, []
        for node in self._walk(tokens):
            parts.append(node.slots)
        if touch:
            self.touch(node, hit, priority)
        slots = np.concatenate(parts) if parts else EMPTY_SLOTS
        return slots, node

    def touch(self, node: TreeNode, hit: bool = True, priority: int = 0) -> None:
        """``node`` and its ancestors were used now: refresh their access time, raise their priority to at least
        ``priority`` and, if ``hit``, count a hit on each (a request re-finding what it inserted itself is not a
        hit). What LRU, LFU, SLRU, GDSF and the priority policy see."""
        now = self.clock()
        while node is not self.root:
            node.last_access = now
            node.hit_count += hit
            node.priority = max(node.priority, priority)
            self._requeue(node)
            node = node.parent

    # -- mutation ----------------------------------------------------------------------------------------
    def insert(self, tokens: list[int] | tuple[int, ...], slots: np.ndarray, priority: int = 0) -> int:
        """Cache ``tokens`` with their ``slots``; returns how many leading tokens were already cached."""
        require(len(tokens) == len(slots), lambda: f"{len(tokens)} tokens but {len(slots)} slots")
        now = self.clock()
        node, pos = self.root, 0
        for node in self._walk(tokens):
            mine = slots[pos : node.depth]
            dup = mine != node.slots
            if dup.any():  # computed twice: keep the tree's copy, give ours back
                self.free_slots(mine[dup])
            node.last_access = now
            node.priority = max(node.priority, priority)
            self._requeue(node)
            pos = node.depth
        cached = pos
        if pos < len(tokens):
            leaf = TreeNode(
                tokens=tuple(tokens[pos:]),
                slots=np.asarray(slots[pos:], dtype=SLOT_DTYPE).copy(),
                parent=node,
                depth=node.depth + len(tokens) - pos,
                created=now,
                last_access=now,
                priority=priority,
            )
            node.children[leaf.tokens[0]] = leaf
            self.num_nodes += 1
            self.version += 1
            self.evictable_size += leaf.num_tokens
            self._queue.push(leaf)
        return cached

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= node.num_tokens
                self.protected_size += node.num_tokens
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``; nodes that reach lock_ref 0 become evictable."""
        while node is not self.root:
            require(node.lock_ref > 0, "unlock without a matching lock")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= node.num_tokens
                self.evictable_size += node.num_tokens
                if not node.children:
                    self._queue.push(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, policy order; returns tokens freed."""
        freed = 0
        while freed < num_tokens:
            popped = self._queue.pop()
            if popped is None:
                break
            leaf, key = popped
            self._queue.evicted(leaf, key)
            self.free_slots(leaf.slots)
            freed += leaf.num_tokens
            self.version += 1
            self.evictable_size -= leaf.num_tokens
            self.num_nodes -= 1
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            leaf.parent = None
            if parent.is_evictable_leaf:
                self._queue.push(parent)
        return freed

    # -- internals ---------------------------------------------------------------------------------------
    def _path(self, tokens: list[int] | tuple[int, ...]) -> Iterator[tuple[TreeNode, int]]:
        """(node, tokens matched in it) along the longest cached prefix of ``tokens``, root excluded; only the
        last node may be matched partially. Changes nothing."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                return
            n = _common_len(child.tokens, tokens, pos)
            partial = n < child.num_tokens  # decided before yielding: the consumer may split `child`
            yield child, n
            if partial:
                return
            pos += n
            node = child

    def _walk(self, tokens: list[int] | tuple[int, ...]) -> Iterator[TreeNode]:
        """The nodes of ``_path``, the last split where the prefix ends inside it: each yielded node is covered
        by ``tokens`` exactly (it ends at its depth)."""
        for node, n in self._path(tokens):
            yield node if n == node.num_tokens else self._split(node, n)

    def _requeue(self, node: TreeNode) -> None:
        if node.is_evictable_leaf:  # its key may depend on the metadata that just changed
            self._queue.push(node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; returns the new upper node (the lower keeps identity)."""
        parent = child.parent
        upper = TreeNode(
            tokens=child.tokens[:n],
            slots=child.slots[:n],
            parent=parent,
            depth=child.depth - child.num_tokens + n,
            created=child.created,
            last_access=child.last_access,
            hit_count=child.hit_count,
            priority=child.priority,
            lock_ref=child.lock_ref,  # every lock through child also runs through its prefix
        )
        child.tokens, child.slots = child.tokens[n:], child.slots[n:]
        child.parent = upper
        upper.children[child.tokens[0]] = child
        parent.children[upper.tokens[0]] = upper
        self.num_nodes += 1
        return upper

    def nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evictable_leaves(self) -> Iterator[TreeNode]:
        return (n for n in self.nodes() if n.is_evictable_leaf)

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def check(self) -> list[np.ndarray]:
        """Assert tree integrity; returns the slot arrays the tree owns (for pool accounting)."""
        evictable = protected = count = 0
        owned = []
        for node in self.nodes():
            count += 1
            require(node.num_tokens > 0 and len(node.slots) == node.num_tokens, "empty or ragged node")
            require(node.parent.children.get(node.tokens[0]) is node, "child keyed by the wrong token")
            require(node.depth == node.parent.depth + node.num_tokens, "wrong depth")
            require(node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock below an unlocked node")
            if node.lock_ref:
                protected += node.num_tokens
            else:
                evictable += node.num_tokens
            owned.append(node.slots)
        require((evictable, protected) == (self.evictable_size, self.protected_size), lambda: (
            f"counters drifted: evictable {self.evictable_size} vs {evictable}, "
            f"protected {self.protected_size} vs {protected}"))
        require(count == self.num_nodes, lambda: f"node count drifted: {self.num_nodes} vs {count}")
        return owned
