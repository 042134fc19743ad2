"""The two policy contracts. A policy is a small object found by name (see registry); it may keep state of its
own and must tolerate being swapped in or out between any two scheduler steps."""
from __future__ import annotations

from collections.abc import Sequence
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
    def num_tokens(self) -> int: ...  # tokens in this segment (the slots eviction would free)
    @property
    def depth(self) -> int: ...  # tokens from the root to the end of this segment
    @property
    def priority(self) -> int: ...  # highest priority of the requests that used it


class EvictionPolicy(Protocol):
    """Orders evictable leaves: the leaf with the *smallest* key is evicted first.

    ``key`` is evaluated when a node becomes an evictable leaf and again whenever its metadata changes (a hit, a
    new insert through it); it is not re-evaluated as time passes, so it must depend only on the node and on the
    ``now`` it is given. It must not mutate the node. A policy may also define ``on_evict(node, now)``, called
    just before a victim is freed (e.g. to advance an aging clock).
    """

    name: str

    def key(self, node: NodeView, now: float) -> Any: ...


class WaitingRequest(Protocol):
    """What a schedule policy may read of a waiting request."""

    @property
    def rid(self) -> str: ...
    @property
    def arrival(self) -> float: ...  # clock time the request entered the waiting queue the first time
    @property
    def fill_ids(self) -> list[int]: ...  # every token whose KV the request needs (prompt + output so far)


class CacheView(Protocol):
    """Read-only access to the prefix cache."""

    def match_len(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` are cached now (0 when the radix cache is disabled). Touches nothing."""
        ...


R = TypeVar("R", bound=WaitingRequest)


class SchedulePolicy(Protocol):
    """Orders the waiting queue; the scheduler admits requests in the returned order while they fit.

    ``order`` returns a permutation of ``waiting`` (same objects, none added or dropped) and must not mutate the
    requests or the cache. It is called once per scheduling step in which something waits.
    """

    name: str

    def order(self, waiting: list[R], cache: CacheView) -> list[R]: ...
