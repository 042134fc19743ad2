"""Draft trees for speculative decoding: a draft that branches (``DraftTree``: its tokens and each one's parent),
how a verifier walks it against the model's own tokens (``accepted_prefix``, ``judged``), and how a policy grows
the likeliest one from counted continuations (``grow_tree``). A chain is the tree whose parents are -1, 0, 1, ...
Draft policies (policies/drafts.py) return them; one forward verifies every branch (model/forward_batch.py).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence


def is_chain(parents: Sequence[int]) -> bool:
    """Are these a chain's parents (-1, 0, 1, ...)?"""
    return all(p == i - 1 for i, p in enumerate(parents))


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each token's depth in a tree of parent indices (parents first): 1 for a root's child (-1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


class DraftTree(list):
    """A draft that branches: its tokens (a list, as a chain's are) and each one's ``parents`` entry, the index of
    an earlier token of the draft or -1 (the request's last token). Siblings have different tokens, so the tokens
    the model makes pick one path (``walk``). A chain's parents are -1, 0, 1, ...; one forward verifies every
    path at once, each token attending to its ancestors only (a tree mask).

        tokens   [ a, b, c, d ]        last token -+-> a --> b --> d
        parents  [-1, 0,-1, 1 ]                    +-> c
    """

    def __init__(self, tokens: Sequence[int] = (), parents: Sequence[int] | None = None) -> None:
        super().__init__(tokens)
        self.parents = list(range(-1, len(self) - 1)) if parents is None else list(parents)

    def __getitem__(self, i):  # a slice keeps the tree (tokens are in parent-first order: any head is a tree)
        if isinstance(i, slice):
            if i.start not in (None, 0) or i.step not in (None, 1):
                raise IndexError("a draft tree's slice is a head: [:n]")
            return DraftTree(list.__getitem__(self, i), self.parents[i])
        return list.__getitem__(self, i)

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    def depths(self) -> list[int]:
        return tree_depths(self.parents)

    def walk(self, tokens: Sequence[int]) -> list[int]:
        """The draft tokens (indices) that ``tokens`` follow from the root: what a verifier that saw ``tokens``
        keeps."""
        path, at = [], -1
        kids = self.children()
        for t in tokens:
            nxt = kids.get(at, {}).get(t)
            if nxt is None:
                break
            path.append(nxt)
            at = nxt
        return path

    def goes_on(self, path: Sequence[int]) -> bool:
        """Does the draft go on after ``path`` (what ``walk`` returned): is a token after it still checked?"""
        return bool(self.children().get(path[-1] if path else -1))

    def children(self) -> dict[int, dict[int, int]]:
        """index (-1: the root) -> {token: the child's index}."""
        out: dict[int, dict[int, int]] = {}
        for i, (t, p) in enumerate(zip(self, self.parents)):
            out.setdefault(p, {})[t] = i
        return out

    def problem(self) -> str | None:
        """What makes this not a draft tree (None: it is one)."""
        if len(self.parents) != len(self):
            return f"{len(self)} tokens with {len(self.parents)} parents"
        if any(not isinstance(p, int) or not -1 <= p < i for i, p in enumerate(self.parents)):
            return "a parent is not an earlier token's index (or -1)"
        if sum(map(len, self.children().values())) != len(self):
            return "two siblings have the same token"
        return None


def accepted_prefix(draft: Sequence[int], model: Sequence[int]) -> int:
    """How many draft tokens the model's own greedy choices keep (``model[i]``: its token after the i-th kept
    one, i.e. in place of the next): what a greedy verifier keeps, in the engine and the simulator. A
    ``DraftTree`` keeps the path ``model`` walks."""
    return len((draft if isinstance(draft, DraftTree) else DraftTree(draft)).walk(model))


def judged(draft: Sequence[int], came: Sequence[int]) -> tuple[int, bool]:
    """A draft against the tokens that came after it (as many as are known): (its tokens kept, whether one was
    refused: the kept path stopped where the draft went on and a token came that it did not have)."""
    tree = draft if isinstance(draft, DraftTree) else DraftTree(draft)
    path = tree.walk(came)
    return len(path), len(came) > len(path) and tree.goes_on(path)


def grow_tree(root: object, children, k: int, max_depth: int, min_prob: float, width: int) -> DraftTree:
    """The draft tree of at most ``k`` tokens and ``max_depth`` levels whose paths are the likeliest: grown best
    path first from ``root``, taking up to ``width`` children a token, while a path's share of the occurrences is
    ``min_prob`` or more. ``children(state)`` lists a state's continuations as (token, share of the parent's
    occurrences, state), likeliest first; with ``width`` 1 the tree is the most frequent path (a chain)."""
    tree = DraftTree()
    frontier: list[tuple[float, int, int, int, int, object]] = []  # (-prob, order, parent, depth, token, state)
    order = 0

    def offer(parent: int, depth: int, prob: float, state: object) -> None:
        nonlocal order
        if depth > max_depth:
            return
        for token, share, child in children(state)[:width]:
            if prob * share >= min_prob:
                heapq.heappush(frontier, (-prob * share, order, parent, depth, token, child))
                order += 1

    offer(-1, 1, 1.0, root)
    while frontier and len(tree) < k:
        neg, _, parent, depth, token, state = heapq.heappop(frontier)
        tree.append(token)
        tree.parents.append(parent)
        offer(len(tree) - 1, depth + 1, -neg, state)
    return tree
