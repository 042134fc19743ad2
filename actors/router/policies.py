"""Routing policies: which worker (a radixserve or SGLang-compatible server, or a --dp replica) takes a request.
Pluggable like the cache policies, through the entry-point group ``radixserve.routing_policies``:

    [project.entry-points."radixserve.routing_policies"]
    my-router = "my_package.module:MyRouting"     # called with the router's RoutingConfig

A policy has a ``name`` and ``choose(text, workers) -> Worker``; ``workers`` are the healthy ones (never empty),
each with its ``url`` and ``load`` (requests in flight there). ``forget(url)``, if the policy has it, is called
when a worker leaves.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.actors.router.tree import ApproxTree
from radixserve.plugins import load_plugin, registered

GROUP = "radixserve.routing_policies"


@dataclass
class Worker:
    url: str
    load: int = 0  # requests sent and not yet answered
    healthy: bool = True


@dataclass(frozen=True)
class RoutingConfig:
    """SGLang router's launcher defaults."""

    cache_threshold: float = 0.3  # matched share of a request's text above which affinity decides
    balance_abs_threshold: int = 64  # loads are skewed when max - min exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max exceeds this times min
    max_tree_size: int = 2**24  # characters of text the router remembers per worker


class RoutingPolicy(Protocol):
    name: str

    def choose(self, text: str, workers: list[Worker]) -> Worker: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self._turn = itertools.count()

    def choose(self, text: str, workers: list[Worker]) -> Worker:
        return workers[next(self._turn) % len(workers)]


class LeastLoad:
    name = "least-load"

    def __init__(self, config: RoutingConfig | None = None) -> None:
        pass

    def choose(self, text: str, workers: list[Worker]) -> Worker:
        return min(workers, key=lambda w: w.load)  # the first of equals: stable under a light load


class CacheAware:
    """A request goes where its text's prefix probably is cached (the approximate tree of what each worker was
    sent), when that covers more than ``cache_threshold`` of it; else to the least-loaded worker. When loads are
    skewed (``balance_*``), load decides -- but among the workers near the minimum load, affinity still does, so
    a prefix group is not scattered by a momentary imbalance."""

    name = "cache-aware"

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self.tree = ApproxTree()

    def choose(self, text: str, workers: list[Worker]) -> Worker:
        cfg = self.config
        matched = self.tree.match(text)
        loads = [w.load for w in workers]
        lo, hi = min(loads), max(loads)
        affinity = lambda w: (matched.get(w.url, 0), -w.load)  # noqa: E731
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            near = [w for w in workers if w.load <= lo + cfg.balance_abs_threshold]  # never the overloaded one
            chosen = max(near, key=affinity)
        else:
            best = max(workers, key=affinity)
            rate = matched.get(best.url, 0) / len(text) if text else 0.0
            chosen = best if rate > cfg.cache_threshold else min(
                workers, key=lambda w: (w.load, self.tree.sizes.get(w.url, 0)))
        self.tree.insert(text, chosen.url)
        self.tree.evict(chosen.url, cfg.max_tree_size)
        return chosen

    def forget(self, url: str) -> None:
        self.tree.remove(url)


def available() -> list[str]:
    return registered(GROUP)


def load_routing_policy(name: str, config: RoutingConfig | None = None) -> Any:
    """The policy registered as ``name``, built with ``config``; ValueError naming the choices if there is none."""
    return load_plugin(GROUP, name, "routing policy", config or RoutingConfig(), needs=("choose",),
                       see="radixserve.actors.router")
