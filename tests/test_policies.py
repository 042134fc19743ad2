"""Every built-in policy on hand-made trees and queues where the right order is known."""
from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field

import pytest

from radixserve.cache import RadixTree, SlotAllocator
from radixserve.policies import available, load_eviction_policy, load_schedule_policy
from radixserve.policies.eviction import GDSF

from test_cache_tree import FakeClock

A, B, C = [1, 2, 3], [4, 5], [6, 7, 8, 9]


def three_leaves(policy_name: str) -> RadixTree:
    """A (t=1, priority 0), B (t=2, priority 5), C (t=3, priority 1); then A hit twice (t=4,5), B once (t=6).
    So last access C < A < B, created A < B < C, hits C 0 < B 1 < A 2, depth B 2 < A 3 < C 4."""
    alloc = SlotAllocator(64)
    tree = RadixTree(load_eviction_policy(policy_name), alloc.free, FakeClock())
    for seq, prio in ((A, 0), (B, 5), (C, 1)):
        tree.insert(seq, alloc.alloc(len(seq)), priority=prio)
    tree.match_prefix(A)
    tree.match_prefix(A)
    tree.match_prefix(B)
    return tree


def eviction_order(tree: RadixTree) -> list[str]:
    names = {tuple(A): "A", tuple(B): "B", tuple(C): "C"}
    out = []
    while tree.evictable_size:
        before = {n: tree.match_len(list(s)) for s, n in names.items()}
        tree.evict(1)
        out += [n for s, n in names.items() if before[n] and not tree.match_len(list(s))]
    return out


@pytest.mark.parametrize("policy,expected", [
    ("lru", "CAB"),  # least recently used first
    ("mru", "BAC"),
    ("fifo", "ABC"),  # first cached first
    ("filo", "CBA"),
    ("lfu", "CBA"),  # fewest hits first
    ("slru", "CBA"),  # probation (C, B: < 2 hits) by recency, then protected A
    ("priority", "ACB"),  # priority 0, 1, 5
    ("gdsf", "CBA"),  # value (hits+1) * (1 + mid/2048): C 1.0, B 2.0, A 3.0
])
def test_eviction_order(policy, expected):
    assert "".join(eviction_order(three_leaves(policy))) == expected


def test_every_registered_builtin_is_tested():
    assert set(available("eviction")) >= {"lru", "mru", "fifo", "filo", "lfu", "slru", "priority", "gdsf"}
    assert set(available("schedule")) >= {"fcfs", "lpm", "lpm-aging", "dfs-weight", "lof", "random", "priority"}


def test_gdsf_values_long_prefixes_and_ages_out_stale_ones():
    alloc = SlotAllocator(4096)
    tree = RadixTree(GDSF(), alloc.free, FakeClock())
    short, deep = list(range(10)), list(range(100, 1100))
    tree.insert(short, alloc.alloc(len(short)))
    tree.insert(deep, alloc.alloc(len(deep)))  # same hits, but far deeper: costlier to rebuild
    tree.evict(1)
    assert tree.match_len(short) == 0 and tree.match_len(deep) == len(deep)
    # the clock rose to the victim's value: a newcomer starts above the stale entries of the past
    assert tree.policy.clock > 0


@dataclass
class FakeReq:
    rid: str
    arrival: float
    fill_ids: list[int]
    max_new_tokens: int = 16
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)

    @property
    def fill_key(self) -> array:
        return array("i", self.fill_ids)


def cache_with(*seqs: list[int]) -> RadixTree:
    alloc = SlotAllocator(1024)
    tree = RadixTree(load_eviction_policy("lru"), alloc.free, FakeClock())
    for s in seqs:
        tree.insert(s, alloc.alloc(len(s)))
    return tree


P1, P2 = list(range(100, 140)), list(range(200, 220))
QUEUE = [
    FakeReq("cold", 0.0, [7, 8, 9], max_new_tokens=5, priority=1),
    FakeReq("p2", 1.0, P2 + [1], max_new_tokens=50),
    FakeReq("p1-a", 2.0, P1 + [1], max_new_tokens=10, priority=3),
    FakeReq("p1-b", 3.0, P1 + [2], max_new_tokens=20),
    FakeReq("p1-c", 4.0, P1[:30] + [3], max_new_tokens=30),
]


def order(name: str, now: float = 10.0, cache=None) -> list[str]:
    policy = load_schedule_policy(name)
    return [r.rid for r in policy.order(list(QUEUE), cache or cache_with(P1, P2), now)]


def test_fcfs():
    assert order("fcfs") == ["cold", "p2", "p1-a", "p1-b", "p1-c"]


def test_lpm():
    assert order("lpm") == ["p1-a", "p1-b", "p1-c", "p2", "cold"]  # 40, 40, 30, 20, 0 cached tokens


def test_lpm_aging_puts_overdue_requests_first():
    assert order("lpm-aging", now=4.5) == ["p1-a", "p1-b", "p1-c", "p2", "cold"]  # nobody waited 5 s yet
    assert order("lpm-aging", now=5.5) == ["cold", "p1-a", "p1-b", "p1-c", "p2"]  # cold waited 5.5 s
    assert order("lpm-aging", now=6.5) == ["cold", "p2", "p1-a", "p1-b", "p1-c"]  # overdue: oldest first


def test_dfs_weight_groups_shared_prefixes_heaviest_first():
    # P1 holds three requests (deepest two first: their prefix ends deeper), then P2, then the unmatched one
    assert order("dfs-weight") == ["p1-a", "p1-b", "p1-c", "p2", "cold"]


def test_lof_and_priority():
    assert order("lof") == ["p2", "p1-c", "p1-b", "p1-a", "cold"]
    assert order("priority") == ["p1-a", "cold", "p2", "p1-b", "p1-c"]


def test_random_is_a_seeded_permutation():
    a, b = order("random"), order("random")
    assert a == b and sorted(a) == sorted(r.rid for r in QUEUE)
    policy = load_schedule_policy("random")
    runs = {tuple(r.rid for r in policy.order(list(QUEUE), cache_with(), 0)) for _ in range(10)}
    assert len(runs) > 1, "the generator advances between calls"


def test_every_schedule_policy_returns_a_permutation_of_a_random_queue():
    rng = random.Random(3)
    queue = [FakeReq(f"r{i}", rng.random() * 10, [rng.randrange(5) for _ in range(rng.randrange(1, 20))],
                     rng.randrange(1, 99), rng.randrange(3)) for i in range(60)]
    cache = cache_with(*[r.fill_ids[: len(r.fill_ids) // 2] for r in queue[::3] if len(r.fill_ids) > 1])
    for name in available("schedule"):
        out = load_schedule_policy(name).order(list(queue), cache, 5.0)
        assert sorted(map(id, out)) == sorted(map(id, queue)), name
