"""What the dashboard shows of a scheduler's insides: the radix tree's largest and hottest subtrees, and the
running and waiting queues. Read-only, computed only when asked (the ``dashboard`` control op): O(nodes), level
by level with numpy doing the sums, no recursion (a tree can be as deep as its longest
cached sequence).

A subtree is a node and everything below it: every cached sequence that starts with that node's path. A lock
runs up to the root, so locking D protects A too.

    root ── A[12 tok, 5 hits] ── B[30 tok] ── C[8 tok]      subtree(A) = 12 + 30 + 8 + 20 = 70 tokens,
                              └─ D[20 tok, locked]          32 locked (A, D), 38 evictable; hits(A) = 5
"""
from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from radixserve.actors.scheduler.req import Req
    from radixserve.actors.scheduler.scheduler import Scheduler
    from radixserve.cache.radix_tree import RadixTree, TreeNode

PREVIEW = 16  # token ids shown of a path and of a segment
MAX_LISTED = 50  # requests listed per queue (the counts are exact)


def dashboard_view(sched: Scheduler, top: int = 10) -> dict[str, Any]:
    """The ``dashboard`` control op's body: ``tree`` (None without a radix cache) and ``queues``."""
    tree = sched.cache.tree
    return {"tree": tree_view(tree, top) if tree is not None else None, "queues": queues_view(sched)}


def tree_view(tree: RadixTree, top: int = 10) -> dict[str, Any]:
    """The ``top`` largest subtrees (by tokens; the shallower first on ties) and the ``top`` hottest (by hits,
    the larger first on ties; only those with any)."""
    nodes, parents, levels = level_order(tree)
    n = len(nodes)
    own, depth, hits, lock_ref = (np.fromiter(map(attrgetter(name), nodes), np.int64, n)
                                  for name in ("num_tokens", "depth", "hit_count", "lock_ref"))
    tokens = own.copy()
    locked = np.where(lock_ref > 0, own, 0)
    count = np.ones(n, np.int64)
    deepest = depth.copy()
    # the deepest node on each path that starts within the preview: the path's head is read from there up
    head = np.arange(n)
    starts_late = depth - own >= PREVIEW
    for lo, hi in levels[1:]:  # parents' levels first
        head[lo:hi] = np.where(starts_late[lo:hi], head[parents[lo:hi]], head[lo:hi])
    for lo, hi in reversed(levels[1:]):  # the deepest level first: each subtree is complete when added up
        up = parents[lo:hi]
        np.add.at(tokens, up, tokens[lo:hi])
        np.add.at(locked, up, locked[lo:hi])
        np.add.at(count, up, count[lo:hi])
        np.maximum.at(deepest, up, deepest[lo:hi])

    def entry(i: int) -> dict[str, Any]:
        node = nodes[i]
        return {"tokens": int(tokens[i]), "hits": node.hit_count, "locked_tokens": int(locked[i]),
                "evictable_tokens": int(tokens[i] - locked[i]), "nodes": int(count[i]), "depth": node.depth,
                "max_depth": int(deepest[i]), "segment_tokens": node.num_tokens,
                "prefix_ids": path_head(nodes[head[i]]), "segment_ids": segment_head(node)}

    largest = np.lexsort((depth, -tokens))[:top]  # C-speed sorts: fine for 100k nodes
    hot = np.flatnonzero(hits)
    hottest = hot[np.lexsort((-tokens[hot], -hits[hot]))][:top]
    return {"nodes": n, "tokens": tree.total_size, "evictable_tokens": tree.evictable_size,
            "locked_tokens": tree.protected_size, "largest": [entry(i) for i in largest],
            "hottest": [entry(i) for i in hottest]}


def level_order(tree: RadixTree) -> tuple[list[TreeNode], np.ndarray, list[tuple[int, int]]]:
    """Every node but the root, level by level (a node's parent lies in the level before it); each one's
    parent's index (-1: the root); each level's [lo, hi) range."""
    nodes = list(tree.root.children.values())
    parents = [-1] * len(nodes)
    levels = []
    lo = 0
    while lo < len(nodes):
        hi = len(nodes)
        levels.append((lo, hi))
        for i in range(lo, hi):
            children = nodes[i].children
            if children:
                nodes.extend(children.values())
                parents.extend([i] * len(children))
        lo = hi
    return nodes, np.array(parents, dtype=np.int64), levels


def segment_head(node: TreeNode) -> list[int]:
    """The first PREVIEW token ids of ``node``'s own segment."""
    return np.frombuffer(node.key, dtype=np.int32, count=min(node.num_tokens, PREVIEW)).tolist()


def path_head(node: TreeNode) -> list[int]:
    """The first PREVIEW token ids of the path from the root to ``node``. Cheap for a node that starts within
    the preview: every node holds a token, so at most PREVIEW nodes lie above it."""
    chain = []
    while node.parent is not None:
        chain.append(node)
        node = node.parent
    return [t for n in reversed(chain) for t in segment_head(n)][:PREVIEW]


def queues_view(sched: Scheduler) -> dict[str, Any]:
    """The running requests (the one mid-prefill first) and the waiting ones in arrival order, MAX_LISTED of
    each; wait_s is the time since arrival."""
    now = sched.clock()
    running = ([sched.chunked] if sched.chunked is not None else []) + sched.running
    return {"running_count": len(running), "waiting_count": len(sched.waiting),
            "running": [request_view(r, now, "prefilling" if r is sched.chunked else "decoding", sched)
                        for r in running[:MAX_LISTED]],
            "waiting": [request_view(r, now, "waiting", sched) for r in sched.waiting[:MAX_LISTED]]}


def request_view(req: Req, now: float, state: str, sched: Scheduler) -> dict[str, Any]:
    """``priority``: the client's value (None: it gave none and priority scheduling ranks it lowest)."""
    return {"rid": req.rid, "state": state, "prompt_tokens": len(req.prompt_ids),
            "cached_tokens": req.cached_tokens, "output_tokens": len(req.output_ids), "wait_s": now - req.arrival,
            "priority": sched.config.priority.client_value(req.priority)}
