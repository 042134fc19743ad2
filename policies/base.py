"""The two policy contracts. A policy is a small object found by name (see registry), made by calling its entry
point with no arguments. It may keep state of its own and must tolerate being swapped in or out between any two
scheduler steps: the tree's node metadata and the requests are policy-neutral, nothing is lost in a swap.

Write one in a few lines::

    class Oldest:                                   # eviction: the segment cached first goes first
        name = "oldest"
        def key(self, node, now): return node.created

    class ShortestFirst:                            # scheduling: short prompts first
        name = "shortest"
        cache_aware = False
        def order(self, waiting, cache, now): return sorted(waiting, key=lambda r: len(r.fill_ids))
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol, TypeVar


class NodeView(Protocol):
    """Read-only, policy-neutral metadata of one radix-tree node (one cached token segment)."""

    @property
    def last_access(self) -> float: ...  # clock time of the last match or insert through this node
    @property
    def created(self) -> float: ...  # clock time the segment was first cached
    @property
    def hit_count(self) -> int: ...  # how many requests matched through this node
    @property
    def num_tokens(self) -> int: ...  # tokens in this segment (the slots evicting it frees)
    @property
    def depth(self) -> int: ...  # tokens from the root to the end of this segment
    @property
    def priority(self) -> int: ...  # highest priority of the requests that used it


class EvictionPolicy(Protocol):
    """Orders evictable leaves: the leaf with the *smallest* key is evicted first.

    ``key`` is evaluated when a node becomes an evictable leaf and again whenever its metadata changes (a hit, an
    insert through it); it is not re-evaluated as time passes, so it may depend only on the node, the ``now`` it
    is given and the policy's own state at that moment. Keys of one policy must compare with each other (numbers
    or tuples of numbers). It must not mutate the node. Optional: ``on_evict(node, key, now)``, called just before a
    victim is freed with the key it was chosen by (GDSF advances its clock there). If ``key`` or ``on_evict`` raises, the cache falls back to
    the previous policy (LRU at worst) and reports the error; the cache stays consistent.
    """

    name: str

    def key(self, node: NodeView, now: float) -> Any: ...


class WaitingRequest(Protocol):
    """What a schedule policy may read of a waiting request."""

    @property
    def rid(self) -> str: ...
    @property
    def arrival(self) -> float: ...  # clock time the request first entered the queue (kept across retraction)
    @property
    def fill_ids(self) -> list[int]: ...  # every token whose KV it needs (prompt + output so far)
    @property
    def fill_key(self) -> Sequence[int]: ...  # the same tokens packed (array('i')): cache lookups take it as is
    @property
    def max_new_tokens(self) -> int: ...  # its output budget
    @property
    def priority(self) -> int: ...  # larger = more important (the request's own, default 0)


class CacheView(Protocol):
    """Read-only access to the prefix cache. Touches nothing (no hits counted, no access times changed)."""

    def match_len(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` are cached now (0 when the radix cache is disabled)."""
        ...

    def match_path(self, tokens: Sequence[int]) -> list[Hashable]:
        """Opaque ids of the tree nodes the cached prefix of ``tokens`` runs through, root first (stable while
        the tree is unchanged; two requests sharing a node share that prefix)."""
        ...


R = TypeVar("R", bound=WaitingRequest)


class SchedulePolicy(Protocol):
    """Orders the waiting queue; the scheduler admits requests in the returned order while they fit.

    ``order`` returns a permutation of ``waiting`` (the same objects, none added or dropped) and must not mutate
    the requests or the cache. It is called once per prefill step in which something waits, with the scheduler's
    clock ``now``. ``cache_aware``: True makes the scheduler also defer a request whose *uncached* prefix is
    shared with one already admitted in the same step, so that the prefix is computed once and then reused. If
    ``order`` raises or returns something else than a permutation, the scheduler falls back to the previous
    policy (FCFS at worst) and reports the error.

    Optional: ``preempt: bool`` (absent = False). True: when the first request of the order does not fit the KV
    pool, the scheduler retracts running requests of strictly lower priority (lowest first, then fewest
    generated tokens) until it fits or none is left; a retracted request keeps its output so far and its
    arrival, and its KV goes to the cache. ``max_preemptions: int`` (absent = 2) bounds how often one request
    may be retracted so; after that it is never a victim again, so it finishes.
    """

    name: str
    cache_aware: bool

    def order(self, waiting: list[R], cache: CacheView, now: float) -> list[R]: ...
