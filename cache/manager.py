"""Cache manager: the slot allocator and the radix tree behind the few operations the scheduler needs.

Each running request holds a ``KVHandle``: a row with the slot of every token whose KV is in the pool.

    row:  [0 ............ tree_len) [tree_len ............ kv_len) [kv_len ...... capacity)
           slots the tree owns        slots this request owns         not yet allocated
           (locked through `node`)    (inserted or freed on close)

Pool accounting, checked by ``check``: free + evictable + protected + owned-by-requests == capacity.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from radixserve.cache.allocator import SLOT_DTYPE, SlotAllocator
from radixserve.cache.invariants import require
from radixserve.cache.radix_tree import RadixTree, TreeNode
from radixserve.cache.tiers import LowerTiers
from radixserve.policies.base import EvictionPolicy


@dataclass(eq=False, slots=True)
class KVHandle:
    row: np.ndarray  # sized for the most tokens the request can ever hold
    kv_len: int = 0
    tree_len: int = 0
    node: TreeNode | None = None  # deepest locked node; None when nothing is locked
    priority: int = 0  # the request's, passed on to the tree nodes it uses
    synced: int = 0  # leading row entries the runner holds as they are here (everything after is sent again)

    def __post_init__(self) -> None:
        if not 0 <= self.tree_len <= self.kv_len <= len(self.row):
            require(False, "a KV handle's lengths are out of order")

    def rewrite(self, start: int, slots: np.ndarray) -> None:
        """Row positions start.. now hold ``slots``; where that changes an entry the runner holds, it is resent."""
        old = self.row[start : start + len(slots)]
        changed = np.flatnonzero(old != slots)
        if len(changed):
            self.synced = min(self.synced, start + int(changed[0]))
        old[:] = slots

    @property
    def slots(self) -> np.ndarray:
        return self.row[: self.kv_len]


class CacheManager:
    def __init__(
        self,
        capacity: int,
        eviction_policy: EvictionPolicy,
        disable_radix_cache: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.allocator = SlotAllocator(capacity)
        self.tree: RadixTree | None = (
            None if disable_radix_cache else RadixTree(eviction_policy, self.allocator.free, clock)
        )
        self._eviction_policy = eviction_policy  # kept for when there is no tree
        self.tiers: LowerTiers | None = None  # --enable-hierarchical-cache (attach_tiers)
        self.owned_by_requests = 0
        self.evicted_tokens = 0

    def attach_tiers(self, tiers: LowerTiers) -> None:
        """Pages below the pool: what the tree caches and evicts is offered to ``tiers``' write policy."""
        if self.tree is None:
            raise ValueError("--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache")
        self.tiers = tiers
        self.tree.on_evict = tiers.evicting

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def evictable(self) -> int:
        return self.tree.evictable_size if self.tree else 0

    @property
    def protected(self) -> int:
        return self.tree.protected_size if self.tree else 0

    @property
    def version(self) -> int:
        """Changes whenever what is cached changes (so a prefix match may give another answer)."""
        return self.tree.version if self.tree else 0

    @property
    def available(self) -> int:
        """Slots a request could get right now: free plus evictable."""
        return self.allocator.num_free + self.evictable

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return self.tree.policy if self.tree else self._eviction_policy

    def set_eviction_policy(self, policy: EvictionPolicy) -> None:
        """Swap the policy between steps (ValueError, old one kept, if it fails on the current cache)."""
        if self.tree:
            self.tree.set_policy(policy)
        self._eviction_policy = policy

    # -- CacheView ---------------------------------------------------------------------------------------
    def match_len(self, tokens: Sequence[int]) -> int:
        return self.tree.match_len(tokens) if self.tree else 0

    def match_path(self, tokens: Sequence[int]) -> list[int]:
        return self.tree.match_path(tokens) if self.tree else []

    # -- request lifecycle -------------------------------------------------------------------------------
    def open(self, tokens: Sequence[int], max_tokens: int, priority: int = 0, limit: int | None = None) -> KVHandle:
        """Start a request's row: reuse (and lock) the longest cached prefix of ``tokens``. Nothing counts as
        used until ``admit``: a request that does not fit after all is closed again and leaves no hit behind.

        The match is capped at len-1 so at least one token is computed: its logits give the next token.
        ``limit`` caps it further (positions whose logits are wanted must be computed).
        """
        handle = KVHandle(row=np.zeros(max_tokens, dtype=SLOT_DTYPE), priority=priority)
        cap = len(tokens) - 1 if limit is None else min(limit, len(tokens) - 1)
        if self.tree and cap > 0:
            slots, node = self.tree.match_prefix(tokens[:cap], touch=False)
            n = len(slots)
            handle.row[:n] = slots
            handle.kv_len = handle.tree_len = n
            self._relock(handle, node)
        return handle

    def admit(self, handle: KVHandle, tokens: Sequence[int] = ()) -> None:
        """The request ``open`` matched ``tokens`` for is admitted: its cached prefix counts as a hit now (once)."""
        if self.tree and handle.node is not None:
            self.tree.touch(handle.node, hit=True, priority=handle.priority)
            if self.tiers is not None and handle.tree_len:
                self.tiers.hit(handle.node, tokens, handle.row[: handle.tree_len])

    def extend(self, handle: KVHandle, n: int) -> bool:
        """Allocate slots for the next ``n`` tokens, evicting if needed. False (nothing changed) if no room."""
        slots = self.alloc(n)
        if slots is None:
            return False
        handle.row[handle.kv_len : handle.kv_len + n] = slots
        handle.kv_len += n
        self.owned_by_requests += n
        return True

    def alloc(self, n: int) -> np.ndarray | None:
        short = n - self.allocator.num_free
        if short > 0 and self.tree:
            self.evicted_tokens += self.tree.evict(short)
        return self.allocator.alloc(n)

    def cache_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        """Mid-request (e.g. between prefill chunks): hand the computed KV to the tree so others can reuse it,
        and keep it locked for this request. ``tokens`` are the request's tokens (at least kv_len of them)."""
        if not self.tree or handle.kv_len == handle.tree_len:
            return
        kv = handle.kv_len
        # where another request cached the same tokens first, ours were freed and the row takes the tree's
        start = handle.node or self.tree.root
        _, node = self.tree.insert_from(start, tokens[:kv], handle.row[:kv], handle.priority)
        handle.rewrite(handle.tree_len, self.tree.slots_between(start, node))
        if self.tiers is not None:
            self.tiers.inserted(node, tokens, handle.row[:kv], handle.tree_len, kv)
        self.owned_by_requests -= kv - handle.tree_len
        handle.tree_len = kv
        self._relock(handle, node)

    def truncate(self, handle: KVHandle, kv_len: int) -> None:
        """Give back the slots of tokens ``kv_len`` and later, which were allocated but never computed (a step that
        failed or whose request was aborted while it ran): only computed KV may reach the tree.

            row:  [0 .. tree_len) [tree_len .. kv_len) [kv_len .. old kv_len)
                   tree's          still the request's  freed now
        """
        require(handle.tree_len <= kv_len <= handle.kv_len, "truncating into the tree's part of a row")
        self.allocator.free(handle.row[kv_len : handle.kv_len])
        self.owned_by_requests -= handle.kv_len - kv_len
        handle.kv_len = kv_len
        handle.synced = min(handle.synced, kv_len)

    def keep(self, handle: KVHandle, start: int, path: Sequence[int]) -> None:
        """A verified draft tree's kept path: row positions ``start + path[0]``, ``start + path[1]``, ... move to
        ``start``, ``start + 1``, ...; the others of ``start .. kv_len`` follow them (for ``truncate`` to give
        back). A chain's path (0, 1, ...) changes nothing."""
        if list(path) == list(range(len(path))):
            return
        require(handle.tree_len <= start and start + len(path) <= handle.kv_len, "a kept path outside the draft")
        own = handle.row[start : handle.kv_len]
        rest = np.ones(len(own), dtype=bool)
        rest[list(path)] = False
        handle.rewrite(start, np.concatenate([own[list(path)], own[rest]]))

    def close(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        """The request leaves the pool (finished, retracted or aborted): its computed KV goes to the tree as
        evictable (the next turn of a chat, or the retried request, may reuse it), or is freed without a tree."""
        own = handle.kv_len - handle.tree_len
        if self.tree:
            kv = handle.kv_len
            run = tokens if len(tokens) == kv else tokens[:kv]  # the usual case (finished) needs no copy
            start = handle.node or self.tree.root
            _, node = self.tree.insert_from(start, run, handle.row[:kv], handle.priority)
            if self.tiers is not None and kv > handle.tree_len:  # the tree's slots (ours that duplicated them are free)
                handle.rewrite(handle.tree_len, self.tree.slots_between(start, node))
                self.tiers.inserted(node, run, handle.row[:kv], handle.tree_len, kv)
        else:
            self.allocator.free(handle.row[handle.tree_len : handle.kv_len])
        self.owned_by_requests -= own
        self._relock(handle, None)
        handle.kv_len = handle.tree_len = 0

    def _relock(self, handle: KVHandle, node: TreeNode | None) -> None:
        # Lock the new node before unlocking the old one, so shared ancestors never look evictable in between.
        if self.tree and node is not None:
            self.tree.lock(node)
        if self.tree and handle.node is not None:
            self.tree.unlock(handle.node)
        handle.node = node

    def flush(self) -> int:
        """Evict everything evictable (locked prefixes of running requests stay), writing nothing below. Returns
        tokens freed."""
        if not self.tree:
            return 0
        spill, self.tree.on_evict = self.tree.on_evict, None
        try:
            return self.tree.evict(self.tree.evictable_size)
        finally:
            self.tree.on_evict = spill

    # -- invariants --------------------------------------------------------------------------------------
    def check(self, handles: Iterable[KVHandle]) -> None:
        """Pool accounting (InvariantError if broken): every slot is in exactly one of free / tree / a request's
        own part."""
        self.allocator.check()
        tree_parts = self.tree.check() if self.tree else []
        handles = list(handles)
        own_parts = [h.row[h.tree_len : h.kv_len] for h in handles]
        owned = sum(len(p) for p in own_parts)
        require(owned == self.owned_by_requests,
                lambda: f"request-owned count drifted: {self.owned_by_requests} vs {owned}")
        every = np.concatenate([self.allocator.free_slots(), *tree_parts, *own_parts])
        require(len(every) == self.capacity, lambda: (
            f"pool accounting broken: free {self.allocator.num_free} + evictable {self.evictable} + protected "
            f"{self.protected} + owned {owned} = {len(every)} != capacity {self.capacity}"))
        require(len(np.unique(every)) == self.capacity, "a slot is owned twice")
        tree_slots = np.concatenate(tree_parts) if tree_parts else np.zeros(0, dtype=SLOT_DTYPE)
        for h in handles:
            require(np.isin(h.row[: h.tree_len], tree_slots).all(), "a request's cached prefix is not in the tree")
        if self.tree:  # every lock is held by a live request: lock_ref == number of handles locking through it
            expected: dict[int, int] = {}
            for h in handles:
                node = h.node
                require(node is None or node.depth == h.tree_len, "a request's lock ends elsewhere than its prefix")
                while node is not None and node is not self.tree.root:
                    expected[id(node)] = expected.get(id(node), 0) + 1
                    node = node.parent
            for node in self.tree.nodes():
                require(node.lock_ref == expected.get(id(node), 0), "a lock is held by no running request (leak)")
