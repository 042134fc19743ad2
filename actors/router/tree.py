"""The router's approximate view of each worker's prefix cache: one radix tree over request text (characters,
so the router needs no tokenizer) whose nodes record which workers were sent that text and when. A worker's part
of the tree is prefix-closed (a node it holds, it holds every ancestor of), so matching walks the text once and
reads, for every worker, how many leading characters it probably has cached. Each worker's share is kept under a
size in characters, its least recently sent leaves dropped first (its real cache evicts too)."""
from __future__ import annotations

import heapq
import itertools
import time


class _Node:
    __slots__ = ("text", "children", "parent", "tenants")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}  # first character -> child
        self.parent = parent
        self.tenants: dict[str, float] = {}  # worker -> when text through this node was last sent to it


class ApproxTree:
    def __init__(self, clock=time.monotonic) -> None:
        self.root = _Node("", None)
        self.sizes: dict[str, int] = {}  # worker -> characters of the tree it holds
        self._clock = clock

    def match(self, text: str) -> dict[str, int]:
        """worker -> how many leading characters of ``text`` it holds (workers holding none are absent)."""
        matched: dict[str, int] = {}
        node, at = self.root, 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                break
            n = _common(child.text, text, at)
            for worker in child.tenants:
                matched[worker] = at + n
            if n < len(child.text):
                break
            node, at = child, at + n
        return matched

    def insert(self, text: str, worker: str) -> None:
        """``text`` was sent to ``worker``: it holds every character of it now."""
        now = self._clock()
        self.sizes.setdefault(worker, 0)
        node, at = self.root, 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                child = node.children[text[at]] = _Node(text[at:], node)
            else:
                n = _common(child.text, text, at)
                if n < len(child.text):
                    child = self._split(child, n)
            if worker not in child.tenants:
                self.sizes[worker] += len(child.text)
            child.tenants[worker] = now
            node, at = child, at + len(child.text)

    @staticmethod
    def _split(node: _Node, n: int) -> _Node:
        """Cut ``node`` after ``n`` characters; returns the new upper part (same tenants, same times)."""
        upper = _Node(node.text[:n], node.parent)
        upper.tenants = dict(node.tenants)
        upper.parent.children[upper.text[0]] = upper
        node.text, node.parent = node.text[n:], upper
        upper.children[node.text[0]] = node
        return upper

    def evict(self, worker: str, max_size: int) -> int:
        """Drop ``worker``'s least recently sent leaves until it holds at most ``max_size`` characters; returns
        the characters dropped. Called when a worker's share passes its cap, it evicts down to 90% of it, so the
        scan for its leaves runs once per 10% of growth, not once per request."""
        if self.sizes.get(worker, 0) <= max_size:
            return 0
        target, dropped = int(max_size * 0.9), 0
        order = itertools.count()
        leaves = [(n.tenants[worker], next(order), n) for n in self._held_by(worker) if self._is_leaf(n, worker)]
        heapq.heapify(leaves)
        while leaves and self.sizes[worker] > target:
            _, _, node = heapq.heappop(leaves)
            del node.tenants[worker]
            self.sizes[worker] -= len(node.text)
            dropped += len(node.text)
            parent = node.parent
            if not node.tenants and not node.children:
                del parent.children[node.text[0]]
            if parent is not self.root and self._is_leaf(parent, worker):
                heapq.heappush(leaves, (parent.tenants[worker], next(order), parent))
        return dropped

    def remove(self, worker: str) -> None:
        """Forget ``worker`` entirely (it left the pool of workers)."""
        for node in list(self._held_by(worker)):
            del node.tenants[worker]
        self._prune(self.root)
        self.sizes.pop(worker, None)

    def _held_by(self, worker: str):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if worker in node.tenants:
                yield node
                stack.extend(node.children.values())

    @staticmethod
    def _is_leaf(node: _Node, worker: str) -> bool:
        return worker in node.tenants and not any(worker in c.tenants for c in node.children.values())

    def _prune(self, node: _Node) -> None:
        """Drop every subtree no worker holds (iteratively: a long conversation makes a deep tree)."""
        stack = [node]
        while stack:
            parent = stack.pop()
            for key, child in list(parent.children.items()):
                if not child.tenants:  # prefix-closed: nobody holds anything below it either
                    del parent.children[key]
                else:
                    stack.append(child)


def _common(segment: str, text: str, at: int) -> int:
    """Length of the common prefix of ``segment`` and ``text[at:]``: string comparisons in C, halving the length
    (no loop over characters in Python)."""
    n = min(len(segment), len(text) - at)
    if text.startswith(segment[:n], at):
        return n
    lo, hi = 0, n  # segment[:lo] matches, segment[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(segment[:mid], at):
            lo = mid
        else:
            hi = mid
    return lo
