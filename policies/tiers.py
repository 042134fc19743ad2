"""Policies of the lower KV tiers (``--enable-hierarchical-cache``): when pool pages are written below, and how long
a request waits for its pages to come back. Plugins like the eviction and schedule policies: entry points, made by
calling them with no arguments, switched live through ``POST /policies``.

Write policies (entry points ``radixserve.write_policies``) answer three questions; a page is written the first
time one of them says yes:

    class OnSecondHit:                          # keep only what was reused twice
        name = "second-hit"
        def on_insert(self, node): return False     # just computed and cached in the pool
        def on_hit(self, node): return node.hit_count >= 2   # a request found it in the pool
        def on_evict(self, node): return False      # it leaves the pool (its last chance)

Prefetch policies (``radixserve.prefetch_policies``) decide when a waiting request whose pages are still being read
may start anyway (with the pages read so far; the rest is recomputed):

    class HalfASecond:
        name = "half-second"
        def ready(self, fetch, now): return fetch.done or now - fetch.issued >= 0.5
"""
from __future__ import annotations

from typing import Protocol

from radixserve.policies.base import NodeView


class FetchView(Protocol):
    """What a prefetch policy may read of a request's read-back of pages."""

    @property
    def done(self) -> bool: ...  # every page it asked for is read (or known missing)
    @property
    def issued(self) -> float: ...  # clock time the read was asked for
    @property
    def pages(self) -> int: ...  # pages asked for


class WritePolicy(Protocol):
    name: str

    def on_insert(self, node: NodeView) -> bool: ...
    def on_hit(self, node: NodeView) -> bool: ...
    def on_evict(self, node: NodeView) -> bool: ...


class PrefetchPolicy(Protocol):
    name: str

    def ready(self, fetch: FetchView, now: float) -> bool: ...


class WriteThrough:
    """Every page is written below as soon as it is computed (SGLang's default): the most hits, the most writes."""

    name = "write_through"

    def on_insert(self, node: NodeView) -> bool:
        return True

    def on_hit(self, node: NodeView) -> bool:
        return False

    def on_evict(self, node: NodeView) -> bool:
        return False


class WriteThroughSelective:
    """Only pages reused at least ``threshold`` times are written (hot prefixes: system prompts, few-shot
    examples); one-off prompts cost no writes."""

    name = "write_through_selective"

    def __init__(self, threshold: int = 2) -> None:
        self.threshold = threshold

    def on_insert(self, node: NodeView) -> bool:
        return False

    def on_hit(self, node: NodeView) -> bool:
        return node.hit_count >= self.threshold

    def on_evict(self, node: NodeView) -> bool:
        return False


class WriteBack:
    """Pages are written when they leave the pool: nothing is written while the pool holds everything, and every
    evicted page survives below."""

    name = "write_back"

    def on_insert(self, node: NodeView) -> bool:
        return False

    def on_hit(self, node: NodeView) -> bool:
        return False

    def on_evict(self, node: NodeView) -> bool:
        return True


class BestEffort:
    """Never wait: a request starts when its turn comes, with whatever pages are back by then."""

    name = "best_effort"

    def ready(self, fetch: FetchView, now: float) -> bool:
        return True


class WaitComplete:
    """Wait until every page asked for is back (or known missing)."""

    name = "wait_complete"

    def ready(self, fetch: FetchView, now: float) -> bool:
        return fetch.done


class Timeout:
    """Wait for the pages, but no longer than ``base_s`` plus ``per_page_s`` per page asked for (a slow or stuck
    store delays a request by that much at most)."""

    name = "timeout"

    def __init__(self, base_s: float = 1.0, per_page_s: float = 0.01) -> None:
        self.base_s, self.per_page_s = base_s, per_page_s

    def ready(self, fetch: FetchView, now: float) -> bool:
        return fetch.done or now - fetch.issued >= self.base_s + self.per_page_s * fetch.pages
