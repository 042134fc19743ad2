"""Radix tree over token ids: every cached prefix and the KV slots that hold it.

A node owns one token segment and the slots of exactly those tokens; children are keyed by their first token.
Locks run along the path to the root: a locked node (``lock_ref > 0``) is *protected*; an unlocked node is
*evictable*, and only unlocked leaves are actually evicted (a parent becomes a leaf once its children go).

    root ── [The cat sat] ── [ on the mat]      (leaf, lock_ref 0: evictable)
                         └── [ down]            (leaf, lock_ref 1: protected, a request is using it)

Token runs are kept as bytes (int32, native order) and compared as bytes: a node's whole segment against the
request's run is one memcmp, not a loop over Python ints; the request's tokens are packed once per call. Children
are keyed by their first token's four bytes. A request that holds a locked node inserts from that node on
(``insert_from``), so the prefix it matched is walked once per request, not once for the match and again for each
insert.
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.allocator import SLOT_DTYPE
from radixserve.cache.evictable import EvictionQueue
from radixserve.cache.invariants import require
from radixserve.policies.draft_trees import DraftTree, grow_tree

if TYPE_CHECKING:
    from radixserve.policies.base import EvictionPolicy

EMPTY_SLOTS = np.zeros(0, dtype=SLOT_DTYPE)
TOKEN = 4  # bytes per token id in a key (int32)
Tokens = list[int] | tuple[int, ...] | np.ndarray | array


def pack(tokens: Tokens) -> bytes:
    """Token ids as a key: int32 bytes, native order. An ``array('i')`` (what the scheduler keeps per request) or
    an int32 numpy array is one memcpy; a list costs ~20 ns a token to convert."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens.tobytes()
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int32, copy=False).tobytes()
    return array("i", tokens).tobytes()


@dataclass(eq=False, slots=True)
class TreeNode:
    key: bytes  # this segment's token ids, packed (``pack``)
    num_tokens: int  # = len(key) // TOKEN: kept, since policies and every walk read it
    slots: np.ndarray
    parent: TreeNode | None
    depth: int  # tokens from the root to the end of this node
    created: float
    last_access: float
    hit_count: int = 0
    priority: int = 0
    lock_ref: int = 0
    heap_version: int = 0
    children: dict[bytes, TreeNode] = field(default_factory=dict)  # by first token (packed)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(np.frombuffer(self.key, dtype=np.int32).tolist())

    @property
    def is_evictable_leaf(self) -> bool:
        return self.parent is not None and self.lock_ref == 0 and not self.children


def _next_tokens(at: tuple[TreeNode, int]) -> list[tuple[int, float, tuple[TreeNode, int]]]:
    """What follows ``at`` (a node and how many of its tokens are behind): its next token, or at its end each
    child's first token with its share of the children's hits (most, then the most recent, first)."""
    node, used = at
    if used < node.num_tokens and node.parent is not None:
        return [(int(np.frombuffer(node.key, dtype=np.int32, count=1, offset=used * TOKEN)[0]), 1.0, (node, used + 1))]
    kids = sorted(node.children.values(), key=lambda c: (c.hit_count, c.last_access), reverse=True)
    total = sum(c.hit_count + 1 for c in kids)
    return [(int(np.frombuffer(c.key, dtype=np.int32, count=1)[0]), (c.hit_count + 1) / total, (c, 1)) for c in kids]


def _common_len(key: bytes, data: bytes, start: int, end: int) -> int:
    """Tokens in the common prefix of ``key`` and ``data[start:end]`` (byte offsets; both packed)."""
    size = len(key)
    n = size if size <= end - start else end - start
    if data[start : start + n] == (key if n == size else key[:n]):  # the usual case: one memcmp
        return n // TOKEN
    a = np.frombuffer(key, dtype=np.int32, count=n // TOKEN)
    b = np.frombuffer(data, dtype=np.int32, count=n // TOKEN, offset=start)
    return int(np.argmax(a != b))


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
        self.root = TreeNode(key=b"", num_tokens=0, slots=EMPTY_SLOTS, parent=None, depth=0, created=now, last_access=now)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.version = 0  # bumped whenever the set of cached tokens changes (insert of new tokens, eviction)
        self.num_nodes = 0  # root excluded: bounds the eviction queue (it never holds more than ~2x this)
        self.on_evict: Callable[[TreeNode], None] | None = None  # sees each victim before its slots are freed
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
    def match_len(self, tokens: Tokens) -> int:
        """Read-only: how many leading tokens are cached. Splits nothing, touches nothing."""
        return sum(n for _, n in self._path(pack(tokens)))

    def match_path(self, tokens: Tokens) -> list[int]:
        """Read-only: ids of the nodes the cached prefix of ``tokens`` runs through (a partial last node too)."""
        return [id(node) for node, _ in self._path(pack(tokens))]

    def continuation(self, tokens: Tokens, k: int, width: int = 1) -> DraftTree:
        """Read-only: up to ``k`` cached tokens after ``tokens`` when all of them are cached (a draft for
        speculative decoding, policies/drafts.py); at a branch, the child more requests matched through (the more
        recent on a tie), and with ``width`` above 1 a tree: up to ``width`` children at a branch, each with its
        share of the hits, the likeliest paths first (``grow_tree``). Empty otherwise."""
        path = self._path(pack(tokens))
        if k <= 0 or sum(n for _, n in path) != len(tokens):
            return DraftTree()
        node, used = path[-1] if path else (self.root, 0)
        return grow_tree((node, used), _next_tokens, k, k, 0.0, width)

    def match_prefix(self, tokens: Tokens, hit: bool = True, priority: int = 0,
                     touch: bool = True) -> tuple[np.ndarray, TreeNode]:
        """Longest cached prefix of ``tokens``: its slots and the node it ends on (root if none).

        With ``touch``, the path is used now (see ``touch``). Without it only the structure may change (a split
        so the match ends on a node boundary): what a caller that may still back out wants, so a request that is
        not admitted after all leaves no access time and no hit behind.
        """
        node, parts = self.root, []
        for node in self._walk(pack(tokens)):
            parts.append(node.slots)
        if touch:
            self.touch(node, hit, priority)
        slots = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else EMPTY_SLOTS
        return slots, node

    def touch(self, node: TreeNode, hit: bool = True, priority: int = 0) -> None:
        """``node`` and its ancestors were used now: refresh their access time, raise their priority to at least
        ``priority`` and, if ``hit``, count a hit on each (a request re-finding what it inserted itself is not a
        hit). What LRU, LFU, SLRU, GDSF and the priority policy see."""
        now = self.clock()
        while node is not self.root:
            node.last_access = now
            node.hit_count += hit
            if priority > node.priority:
                node.priority = priority
            if node.lock_ref == 0 and not node.children:  # an evictable leaf: its key may have changed
                self._queue.push(node)
            node = node.parent

    # -- mutation ----------------------------------------------------------------------------------------
    def insert(self, tokens: Tokens, slots: np.ndarray, priority: int = 0) -> int:
        """Cache ``tokens`` with their ``slots``; returns how many leading tokens were already cached."""
        cached, _ = self.insert_from(self.root, tokens, slots, priority)
        return cached

    def insert_from(self, start: TreeNode, tokens: Tokens, slots: np.ndarray,
                    priority: int = 0) -> tuple[int, TreeNode]:
        """``insert`` for a caller that holds ``start`` locked, a node on the path of ``tokens`` (what a match of
        them returned): the walk starts there, and positions before ``start.depth`` are taken as the tree's own.
        Returns (tokens already cached, the node that now ends at ``len(tokens)``); ``slots_between(start, node)``
        gives the tree's slots for the positions in between (the caller's where they were new, the tree's where
        the caller's duplicated them).

            tokens:  [0 ........ start.depth) [start.depth ..... cached) [cached ...... len)
                      tree's, locked by caller  walked: dups freed        new leaf: caller's slots
        """
        n = len(tokens)
        if n != len(slots) or not (start is self.root or start.lock_ref > 0):  # the hot path: no closures
            require(n == len(slots), lambda: f"{n} tokens but {len(slots)} slots")
            require(False, "insert_from needs a locked start node")
        now = self.clock()
        self._refresh(start, now, priority)  # the matched prefix is used now, as every node walked below
        base = start.depth
        data = pack(tokens)[base * TOKEN :]  # the walk runs below start
        node, pos = start, base
        for node in self._walk(data, start):
            mine = slots[pos : node.depth]
            dup = mine != node.slots
            if dup.any():  # computed twice: keep the tree's copy, give ours back
                self.free_slots(mine[dup])
            node.last_access = now
            if priority > node.priority:
                node.priority = priority
            if node.lock_ref == 0 and not node.children:  # an evictable leaf: its key may have changed
                self._queue.push(node)
            pos = node.depth
        cached = pos
        if pos < n:
            new = n - pos
            leaf = TreeNode(data[(pos - base) * TOKEN :], new, np.array(slots[pos:], dtype=SLOT_DTYPE), node,
                            node.depth + new, now, now, 0, priority)
            node.children[leaf.key[:TOKEN]] = leaf
            self.num_nodes += 1
            self.version += 1
            self.evictable_size += leaf.num_tokens
            self._queue.push(leaf)
            node = leaf
        return cached, node

    @staticmethod
    def slots_between(start: TreeNode, node: TreeNode) -> np.ndarray:
        """The slots of the positions ``start.depth .. node.depth``; ``start`` is ``node`` or an ancestor of it."""
        parts = []
        while node is not start:
            parts.append(node.slots)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else EMPTY_SLOTS

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
            if self.on_evict is not None:
                self.on_evict(leaf)
            self.free_slots(leaf.slots)
            freed += leaf.num_tokens
            self.version += 1
            self.evictable_size -= leaf.num_tokens
            self.num_nodes -= 1
            parent = leaf.parent
            del parent.children[leaf.key[:TOKEN]]
            leaf.parent = None
            if parent.is_evictable_leaf:
                self._queue.push(parent)
        return freed

    # -- internals ---------------------------------------------------------------------------------------
    def _path(self, data: bytes, start: TreeNode | None = None) -> list[tuple[TreeNode, int]]:
        """(node, tokens matched in it) along the longest cached prefix of the packed tokens ``data``, below
        ``start`` (default: the root); ``data`` holds the tokens from ``start``'s depth on. Only the last node may
        be matched partially. Changes nothing. (A list, not a generator: a walk is a few nodes, and yields cost
        more.)"""
        node = start or self.root
        pos, end, out = 0, len(data), []
        children = node.children
        while pos < end:
            child = children.get(data[pos : pos + TOKEN])
            if child is None:
                break
            n = _common_len(child.key, data, pos, end)
            out.append((child, n))
            if n < child.num_tokens:
                break
            pos += n * TOKEN
            children = child.children
        return out

    def _walk(self, data: bytes, start: TreeNode | None = None) -> list[TreeNode]:
        """The nodes of ``_path``, the last split where the prefix ends inside it: each node is covered by the
        tokens exactly (it ends at its depth)."""
        path = self._path(data, start)
        if path and path[-1][1] < path[-1][0].num_tokens:
            path[-1] = (self._split(*path[-1]), 0)
        return [node for node, _ in path]

    def _refresh(self, node: TreeNode, now: float, priority: int) -> None:
        """``node`` and its ancestors were used now (an insert through them): access time and priority."""
        while node is not self.root:
            node.last_access = now
            if priority > node.priority:
                node.priority = priority
            if node.lock_ref == 0 and not node.children:  # an evictable leaf: its key may have changed
                self._queue.push(node)
            node = node.parent

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; returns the new upper node (the lower keeps identity and depth, so a
        caller holding it keeps a valid node)."""
        parent = child.parent
        cut = n * TOKEN
        upper = TreeNode(
            key=child.key[:cut],
            num_tokens=n,
            slots=child.slots[:n],
            parent=parent,
            depth=child.depth - child.num_tokens + n,
            created=child.created,
            last_access=child.last_access,
            hit_count=child.hit_count,
            priority=child.priority,
            lock_ref=child.lock_ref,  # every lock through child also runs through its prefix
        )
        child.key, child.slots, child.num_tokens = child.key[cut:], child.slots[n:], child.num_tokens - n
        child.parent = upper
        upper.children[child.key[:TOKEN]] = child
        parent.children[upper.key[:TOKEN]] = upper
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
            require(node.num_tokens > 0 and len(node.slots) == node.num_tokens == len(node.key) // TOKEN,
                    "empty or ragged node")
            require(node.parent.children.get(node.key[:TOKEN]) is node, "child keyed by the wrong token")
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
