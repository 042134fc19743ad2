"""Routing decisions on hand-made traces: the approximate tree (matching, splitting, bounded per worker by LRU
eviction), cache-aware affinity, the imbalance override that keeps affinity among the near-minimum-load workers,
round-robin and least-load, and policies by entry-point name."""
from __future__ import annotations

import itertools

import pytest

from radixserve.actors.router import (
    ApproxTree, CacheAware, LeastLoad, RoundRobin, RoutingConfig, Worker, available, load_routing_policy,
)


def _held(tree: ApproxTree, worker: str) -> int:
    return sum(len(n.text) for n in tree._held_by(worker))


def test_the_tree_matches_what_each_worker_was_sent():
    tree = ApproxTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")  # splits "hello world" after "hello "
    assert tree.match("hello world, again") == {"a": 11, "b": 6}
    assert tree.match("help") == {"a": 3, "b": 3}
    assert tree.match("goodbye") == {}
    assert tree.sizes == {"a": 11, "b": 11} == {w: _held(tree, w) for w in "ab"}


def test_each_workers_share_is_bounded_least_recently_sent_first():
    clock = itertools.count()
    tree = ApproxTree(clock=lambda: next(clock))
    for i in range(100):
        tree.insert(f"system prompt {i:03d}: " + "x" * 50, "a")
    tree.insert("system prompt 000: " + "x" * 50, "a")  # sent again: the most recent now
    dropped = tree.evict("a", 2000)
    assert dropped > 0 and tree.sizes["a"] <= 2000 and tree.sizes["a"] == _held(tree, "a")
    assert tree.match("system prompt 000: " + "x" * 50)["a"] == 69, "the one sent last stays"
    assert tree.match("system prompt 001: " + "x" * 50)["a"] < 69, "the oldest went first"
    assert tree.evict("a", 2000) == 0, "under the cap: nothing to do"


def test_a_worker_that_leaves_is_forgotten():
    tree = ApproxTree()
    tree.insert("shared prefix one", "a")
    tree.insert("shared prefix two", "b")
    tree.remove("a")
    assert tree.match("shared prefix one") == {"b": 14} and "a" not in tree.sizes


def _workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", load) for i, load in enumerate(loads)]


def test_cache_aware_keeps_a_prefix_group_on_one_worker_and_spreads_the_groups():
    policy, workers = CacheAware(), _workers(0, 0)
    group = {g: "You are assistant number %d. Follow these rules carefully: " % g + "rule " * 40 for g in range(4)}
    first = {g: policy.choose(group[g] + "question 0", workers).url for g in range(4)}
    assert len(set(first.values())) == 2, "new groups go to the least-loaded (then the emptier) worker"
    for q in range(1, 6):
        for g in range(4):
            assert policy.choose(group[g] + f"question {q}", workers).url == first[g], "affinity"


def test_skewed_loads_override_affinity_but_only_towards_near_minimum_workers():
    policy = CacheAware(RoutingConfig(balance_abs_threshold=64, balance_rel_threshold=1.5))
    prefix = "a long shared system prompt " * 10
    workers = _workers(0, 0, 0)
    home = policy.choose(prefix + "q0", workers)
    assert policy.choose(prefix + "q1", workers) is home
    home.load = 200  # skewed: 200 - 0 > 64 and 200 > 1.5 * 0
    moved = policy.choose(prefix + "q2", workers)
    assert moved is not home
    # among the workers near the minimum load the group's new home wins, not whichever is emptiest
    others = [w for w in workers if w is not home and w is not moved]
    moved.load, others[0].load = 3, 0
    assert policy.choose(prefix + "q3", workers) is moved
    home.load = 10  # balanced again: affinity alone decides, and the old home has the longest match
    assert policy.choose(prefix + "q4", workers) in (home, moved)


def test_a_miss_goes_to_the_least_loaded_worker():
    policy, workers = CacheAware(), _workers(5, 1, 3)
    assert policy.choose("something nobody has seen", workers).url == "http://w1"


def test_round_robin_and_least_load():
    rr, workers = RoundRobin(), _workers(0, 0, 0)
    assert [rr.choose("x", workers).url for _ in range(4)] == ["http://w0", "http://w1", "http://w2", "http://w0"]
    assert LeastLoad().choose("x", _workers(4, 2, 7)).url == "http://w1"


def test_policies_by_entry_point_name():
    assert {"round-robin", "least-load", "cache-aware"} <= set(available())
    policy = load_routing_policy("cache-aware", RoutingConfig(cache_threshold=0.5))
    assert policy.name == "cache-aware" and policy.config.cache_threshold == 0.5
    with pytest.raises(ValueError, match="unknown routing policy 'nope'; available: .*cache-aware"):
        load_routing_policy("nope")
