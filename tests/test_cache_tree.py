"""Radix tree + allocator: property tests against a naive reference, invariants after every operation."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import CacheManager, RadixTree, SlotAllocator
from radixserve.policies.eviction import LRU

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def tree_paths(tree: RadixTree) -> set[tuple[int, ...]]:
    """Every cached prefix, read off the tree by walking it."""
    out: set[tuple[int, ...]] = set()

    def walk(node, prefix):
        for child in node.children.values():
            path = prefix
            for t in child.tokens:
                path = path + (t,)
                out.add(path)
            walk(child, path)

    walk(tree.root, ())
    return out


def naive_match(cached: set[tuple[int, ...]], q: list[int]) -> int:
    n = 0
    while n < len(q) and tuple(q[: n + 1]) in cached:
        n += 1
    return n


def test_allocator_alloc_free_roundtrip():
    a = SlotAllocator(8)
    x = a.alloc(5)
    assert sorted(x.tolist()) == [1, 2, 3, 4, 5] and a.num_free == 3
    assert a.alloc(4) is None and a.num_free == 3, "a failed alloc changes nothing"
    assert len(a.alloc(0)) == 0
    a.free(x[:2])
    assert a.num_free == 5
    a.check()
    with pytest.raises(ValueError, match="at least one slot"):
        SlotAllocator(0)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]), tokens_st,
                              st.integers(0, 12)), max_size=40))
def test_tree_matches_naive_reference(ops):
    alloc = SlotAllocator(512)
    tree = RadixTree(LRU(), alloc.free, FakeClock())
    cached: set[tuple[int, ...]] = set()  # reference: every cached prefix
    slot_of: dict[tuple[int, ...], int] = {}  # reference: the slot holding the last token of each prefix
    locks: list[tuple[object, tuple[int, ...]]] = []
    for op, toks, n in ops:
        if op == "insert":
            slots = alloc.alloc(len(toks))
            assert slots is not None
            already = tree.insert(toks, slots)
            assert already == naive_match(cached, toks)
            for i in range(len(toks)):
                p = tuple(toks[: i + 1])
                if p not in cached:
                    cached.add(p)
                    slot_of[p] = int(slots[i])
        elif op == "match":
            assert tree.match_len(toks) == naive_match(cached, toks)
            slots, node = tree.match_prefix(toks)
            m = naive_match(cached, toks)
            assert slots.tolist() == [slot_of[tuple(toks[: i + 1])] for i in range(m)]
            assert node.depth == m
        elif op == "lock":
            slots, node = tree.match_prefix(toks)
            tree.lock(node)
            locks.append((node, tuple(toks[: len(slots)])))
        elif op == "unlock" and locks:
            node, _ = locks.pop(n % len(locks))
            tree.unlock(node)
        elif op == "evict":
            before = tree.evictable_size
            freed = tree.evict(n)
            assert freed >= min(n, before) or tree.evictable_size == 0
            paths = tree_paths(tree)
            assert paths <= cached, "the tree holds something never inserted"
            cached = paths
            slot_of = {p: s for p, s in slot_of.items() if p in cached}
        # invariants after every operation
        for _, path in locks:
            assert tree.match_len(path) == len(path), "a locked prefix was evicted"
        assert tree_paths(tree) == cached
        owned = tree.check()
        every = np.concatenate([alloc.free_slots(), *owned]) if owned else alloc.free_slots()
        assert len(every) == alloc.capacity == len(np.unique(every))


def test_lru_evicts_least_recently_used_leaf_first():
    alloc = SlotAllocator(64)
    tree = RadixTree(LRU(), alloc.free, FakeClock())
    for seq in ([1, 2, 3], [1, 2, 4], [5, 6]):
        tree.insert(seq, alloc.alloc(len(seq)))
    tree.match_prefix([1, 2, 3])  # [1,2,3] is now the freshest; [1,2,4] is the oldest leaf
    assert tree.evict(1) == 1
    assert tree.match_len([1, 2, 4]) == 2 and tree.match_len([5, 6]) == 2
    assert tree.evict(1) == 2  # next: [5,6] (older than [1,2,3])
    assert tree.match_len([5, 6]) == 0 and tree.match_len([1, 2, 3]) == 3
    # once its children are gone, the shared parent becomes a leaf and can go too
    assert tree.evict(10) == 3 and tree.evictable_size == 0 and alloc.num_free == 64
    assert tree.evict(0) == 0


def test_locked_nodes_are_never_evicted_and_split_keeps_locks():
    alloc = SlotAllocator(32)
    tree = RadixTree(LRU(), alloc.free, FakeClock())
    tree.insert([1, 2, 3, 4], alloc.alloc(4))
    slots, node = tree.match_prefix([1, 2, 9])  # splits [1,2,3,4] into [1,2] + [3,4]
    assert node.tokens == (1, 2) and len(slots) == 2
    tree.lock(node)
    assert (tree.protected_size, tree.evictable_size) == (2, 2)
    assert tree.evict(100) == 2 and tree.match_len([1, 2, 3]) == 2
    tree.unlock(node)
    assert tree.evict(100) == 2 and tree.total_size == 0
    tree.check()


def test_insert_frees_duplicate_slots():
    alloc = SlotAllocator(16)
    tree = RadixTree(LRU(), alloc.free, FakeClock())
    first = alloc.alloc(3)
    tree.insert([7, 8, 9], first)
    second = alloc.alloc(4)  # the same three tokens computed again by another request, plus one more
    assert tree.insert([7, 8, 9, 10], second) == 3
    assert alloc.num_free == 16 - 4, "the three duplicate slots went back to the pool"
    slots, _ = tree.match_prefix([7, 8, 9, 10])
    assert slots.tolist() == [*first.tolist(), int(second[3])]


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(tokens_st, st.integers(0, 6), st.booleans()), min_size=1, max_size=25),
       capacity=st.integers(12, 40), disable=st.booleans())
def test_manager_accounting_through_request_lifecycles(reqs, capacity, disable):
    """Open/extend/cache_prefix/close with eviction pressure; accounting holds after every call."""
    mgr = CacheManager(capacity, LRU(), disable_radix_cache=disable, clock=FakeClock())
    live = []
    for prompt, gen, chunk in reqs:
        tokens = prompt + list(range(100, 100 + gen))
        h = mgr.open(prompt, max_tokens=len(tokens))
        mgr.check([x for x, _ in live] + [h])
        assert h.kv_len <= len(prompt) - 1
        if not mgr.extend(h, len(tokens) - h.kv_len):
            mgr.close(h, tokens)  # did not fit: give back what it holds
            mgr.check([x for x, _ in live])
            continue
        mgr.check([x for x, _ in live] + [h])
        if chunk:
            mgr.cache_prefix(h, tokens)
            mgr.check([x for x, _ in live] + [h])
        live.append((h, tokens))
        if len(live) > 2:  # finish the oldest
            done, done_tokens = live.pop(0)
            mgr.close(done, done_tokens)
            mgr.check([x for x, _ in live])
    for h, tokens in live:
        mgr.close(h, tokens)
    mgr.check([])
    assert mgr.owned_by_requests == 0 and mgr.protected == 0
    assert mgr.allocator.num_free + mgr.evictable == capacity


def test_manager_reuses_prefix_and_caps_match_one_short():
    mgr = CacheManager(64, LRU(), clock=FakeClock())
    prompt = [1, 2, 3, 4, 5]
    h = mgr.open(prompt, 8)
    assert h.kv_len == 0
    assert mgr.extend(h, 5)
    mgr.close(h, prompt)
    again = mgr.open(prompt, 8)
    assert again.kv_len == 4, "one token is always left to compute"
    assert again.slots.tolist() == h.row[:4].tolist()
    longer = mgr.open(prompt + [6, 7], 8)
    assert longer.kv_len == 5
    mgr.check([again, longer])


def test_partial_match_stops_inside_the_split_node():
    """Regression: after splitting [0,0] for the query [0,1], the walk must not continue into the child [1]."""
    alloc = SlotAllocator(16)
    tree = RadixTree(LRU(), alloc.free, FakeClock())
    tree.insert([0, 0], alloc.alloc(2))
    tree.insert([0, 0, 1], alloc.alloc(3))
    slots, node = tree.match_prefix([0, 1, 0])
    assert len(slots) == 1 and node.depth == 1 and tree.match_len([0, 1, 0]) == 1
    tree.check()


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(st.tuples(tokens_st, st.integers(0, 10)), min_size=1, max_size=25))
def test_insert_from_a_locked_match_equals_insert_from_the_root(seqs):
    """What the cache manager does per request (match, lock, insert from the matched node) leaves the same tree
    and the same counts as inserting from the root, and hands back the tree's slots for the walked part."""
    trees = []
    for resume in (False, True):
        alloc = SlotAllocator(1024)
        tree = RadixTree(LRU(), alloc.free, FakeClock())
        counts = []
        for toks, cut in seqs:
            slots, node = tree.match_prefix(toks[: min(cut, len(toks))])
            tree.lock(node)
            full = np.concatenate([slots, alloc.alloc(len(toks) - len(slots))])
            if resume:
                cached, last = tree.insert_from(node, np.array(toks, dtype=np.int32), full)
                assert last.depth == len(toks)
                assert tree.slots_between(node, last).tolist() == tree.match_prefix(toks, touch=False)[0][node.depth :].tolist()
            else:
                cached = tree.insert(toks, full)
            counts.append(cached)
            tree.unlock(node)
            owned = tree.check()
            alloc.check()
            assert sum(len(o) for o in owned) + alloc.num_free == 1024
        trees.append((tree_paths(tree), counts))
    assert trees[0] == trees[1]
