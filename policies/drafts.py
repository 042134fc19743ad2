"""Draft policies for speculative decoding: where a running request's next few tokens are guessed from, at no model
cost. The engine verifies a draft in one forward and keeps the tokens the model itself would have produced, so a
policy changes how fast a request goes, never what it says.

A draft policy is found by name like the others (entry point group ``radixserve.draft_policies``)::

    class Repeat:                                   # guesses that the last token repeats
        name = "repeat"
        def propose(self, rid, tokens, k, cache): return [tokens[-1]] * k
        def release(self, rid, tokens): pass

A policy class may take one argument, ``options`` (``DraftOptions``: a draft model's path and the like).

``propose(rid, tokens, k, cache)``: ``tokens`` is the request's prompt and output so far (it only grows between
calls for one ``rid``), ``k`` the most tokens wanted, ``cache`` the radix tree's read-only view (``DraftCache``).
Returns up to ``k`` token ids (fewer, or none, when it has no good guess), or a ``DraftTree`` of up to ``k``
tokens: several guesses sharing their beginnings, checked together. ``release(rid, tokens)``: the request
ended with these tokens; per-request state goes, and what the policy learns across requests may keep them.

Built in: ``ngram`` (prompt lookup: the continuation of the last earlier occurrence of the request's last tokens,
as llama.cpp's and vLLM's n-gram drafting), ``suffix`` (SuffixDecoding's idea: the most frequent continuations of the
longest matching suffix, in this request's own tokens and in a trie over earlier requests' answers, bounded; a tree
of up to ``DraftOptions.width`` children a token), ``radix``
(the continuation of the request's whole sequence in the radix tree: a cached path it is walking again), and
``draft-model`` (model/draft_model.py: a second, smaller model's greedy tokens; SGLang's STANDALONE).
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from radixserve.policies.draft_trees import DraftTree, grow_tree, judged


@dataclass(frozen=True)
class DraftOptions:
    """What the server tells a draft policy whose constructor takes ``options`` (the ``draft-model`` policy):
    the draft model's checkpoint folder (``--speculative-draft-model-path``), its dtype and its threads."""

    model_path: str | None = None
    dtype: str = "float32"
    threads: int = 1
    width: int = 1  # the most children a draft token may have, for a policy that drafts trees (1: chains)


class DraftCache(Protocol):
    """What a draft policy may read of the radix cache."""

    def continuation(self, tokens: Sequence[int], k: int, width: int = 1) -> list[int]:
        """Up to ``k`` cached tokens that follow ``tokens`` (all of them cached): at a branch, the child that more
        requests went through -- or, with ``width`` above 1, a ``DraftTree`` with up to ``width`` children at a
        branch. Empty when ``tokens`` is not all cached or nothing follows. Changes nothing."""
        ...


class DraftPolicy(Protocol):
    """See the module's docstring."""

    name: str

    def propose(self, rid: str, tokens: Sequence[int], k: int, cache: DraftCache) -> list[int]: ...

    def release(self, rid: str, tokens: Sequence[int]) -> None: ...


class NoCache:
    """A DraftCache with nothing in it (a policy used away from a scheduler: the simulator, tests)."""

    def continuation(self, tokens: Sequence[int], k: int, width: int = 1) -> list[int]:
        return []


class NoDrafts:
    """Speculation off: never proposes."""

    name = "none"

    def propose(self, rid: str, tokens: Sequence[int], k: int, cache: DraftCache) -> list[int]:
        return []

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        pass


class _NGramIndex:
    """One request's n-grams (``lo``..``hi`` tokens) -> where their latest occurrence that has a next token ends."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], int] = {}
        self.seen = 0  # tokens indexed

    def update(self, tokens: Sequence[int]) -> None:
        # an n-gram ending at j gets a continuation once token j exists: index it then, so the request's current
        # suffix (no continuation yet) is found only where it occurred before
        for j in range(max(self.seen, 1), len(tokens)):
            for n in range(self.lo, min(self.hi, j) + 1):
                self.ends[tuple(tokens[j - n : j])] = j
        self.seen = len(tokens)


class NGram:
    """Prompt lookup: the tokens after the latest earlier occurrence of the request's last ``hi``..``lo`` tokens
    (the longest n that occurred). Pays where the output copies its input: editing code, quoting a document."""

    name = "ngram"
    lo, hi = 2, 4  # n-gram lengths looked up, longest first (1 token alone guesses too often wrong)

    def __init__(self) -> None:
        self.indexes: dict[str, _NGramIndex] = {}

    def propose(self, rid: str, tokens: Sequence[int], k: int, cache: DraftCache) -> list[int]:
        index = self.indexes.get(rid)
        if index is None:
            index = self.indexes[rid] = _NGramIndex(self.lo, self.hi)
        index.update(tokens)
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            end = index.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end : end + k])
        return []

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        self.indexes.pop(rid, None)


class SuffixTrie:
    """Every window of up to ``depth`` tokens of the sequences added, with how often each was seen: a bounded
    stand-in for a suffix tree (a window is all a draft of ``depth`` - match tokens needs). Nodes are
    ``[count, children]``; adding a token extends the ``depth`` windows that end there (O(depth) a token)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root: list = [0, {}]
        self.nodes = 1

    def add(self, tokens: Sequence[int], open_: list | None = None) -> list:
        """Add ``tokens`` after the windows ``open_`` (what the last call returned, to continue a sequence; None:
        a new one). Returns the windows still open (to continue it)."""
        active = open_ or []
        for t in tokens:
            grown = []
            for node in [*active, self.root]:
                child = node[1].get(t)
                if child is None:
                    child = node[1][t] = [0, {}]
                    self.nodes += 1
                child[0] += 1
                grown.append(child)
            active = grown[-(self.depth - 1):] if self.depth > 1 else []  # a window of depth tokens is complete
        return active

    def draft(self, tokens: Sequence[int], k: int, max_match: int, factor: float, min_prob: float = 0.0,
              width: int = 1) -> tuple[int, DraftTree]:
        """(match length, draft): the longest suffix of ``tokens`` (at most ``max_match``) found, and the likeliest
        paths after it (``grow_tree``: up to ``width`` children a token), at most ``factor`` x the match length
        deep and ``k`` tokens, while a path's share of the match's occurrences (each token's count over its
        parent's, multiplied) is ``min_prob`` or more. (0, []) when nothing matches."""
        for m in range(min(max_match, len(tokens), self.depth - 1), 0, -1):
            node = self.root
            for t in tokens[len(tokens) - m :]:
                node = node[1].get(t)
                if node is None:
                    break
            if node is None or not node[1]:
                continue
            depth = min(math.ceil(factor * m), self.depth - m)
            return m, grow_tree(node, _trie_children, k, depth, min_prob, width)
        return 0, DraftTree()


def _trie_children(node: list) -> list[tuple[int, float, list]]:
    kids = sorted(node[1].items(), key=lambda kv: -kv[1][0])  # stable: the first seen first on a tie
    return [(t, child[0] / node[0], child) for t, child in kids]


class OwnText:
    """One request's tokens, indexed by where each token and each pair of neighbouring tokens occurred with a next
    token: O(1) a token to add (a trie of windows costs its depth a token, which a long prompt pays at once).
    ``draft`` finds the longest suffix that occurred before, comparing backwards from the latest ``SCAN``
    occurrences of its last two tokens (or, where they never occurred, of its last one), and follows the
    continuation most of the longest matches share (ties: the latest)."""

    SCAN = 64

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.after1: defaultdict[int, list[int]] = defaultdict(list)  # token -> its positions with a next token
        self.after2: defaultdict[tuple[int, int], list[int]] = defaultdict(list)  # pair -> its second's positions

    def add(self, tokens: Sequence[int]) -> None:
        s = self.tokens
        for t in tokens:
            if s:  # the token before t now has a continuation
                self.after1[s[-1]].append(len(s) - 1)
                if len(s) > 1:
                    self.after2[(s[-2], s[-1])].append(len(s) - 1)
            s.append(t)

    def draft(self, k: int, max_match: int, factor: float, min_prob: float = 0.0, width: int = 1) -> DraftTree:
        """The continuations of the longest earlier occurrences of the end of the tokens (at most ``max_match``
        tokens of it): the likeliest paths (``grow_tree``: up to ``width`` children a token), at most ``factor`` x
        the match deep and ``k`` tokens, while the share of those occurrences that went on so is ``min_prob`` or
        more."""
        s, end = self.tokens, len(self.tokens) - 1
        if end < 1:
            return DraftTree()
        ends = self.after2.get((s[-2], s[-1])) or self.after1.get(s[-1]) or []
        matched = {}
        for j in reversed(ends[-self.SCAN:]):  # the latest first
            m = 1
            while m < max_match and m <= j and s[j - m] == s[end - m]:
                m += 1
            matched[j] = m
        if not matched:
            return DraftTree()
        best = max(matched.values())
        starts = [j + 1 for j, m in matched.items() if m == best]

        def children(at: list[int]) -> list[tuple[int, float, list[int]]]:  # the tokens that came after ``at``
            votes = Counter(s[i] for i in at if i <= end)
            return [(t, n / len(at), [i + 1 for i in at if i <= end and s[i] == t]) for t, n in votes.most_common()]

        return grow_tree(starts, children, k, math.ceil(factor * best), min_prob, width)


class Suffix:
    """SuffixDecoding's drafting: the longest suffix of the request's tokens found in its own tokens (its prompt
    and output so far, ``OwnText``) or in a trie of earlier requests' answers (each with the end of its prompt
    before it), then the most frequent continuations, deeper the longer the match, while at least ``MIN_PROB`` of
    the match's occurrences went on so (SuffixDecoding's minimum token probability): a tree of the likeliest paths
    with up to ``width`` children a token (``grow_tree``; 1: the most frequent path alone). Of the two drafts, the
    one with more tokens expected to be kept on its longest path: each source's drafts for this request are judged
    by the tokens that followed them (``_Trust``), so a request that answers with its own prompt's text (a quoted
    document, an edited file, an earlier answer repeated) stops taking the drafts of earlier requests that once went
    on alike. Bounded: past
    ``MAX_NODES`` the shared trie is rebuilt from the latest finished requests, newest first, up to half that.
    A request's prompt goes into no trie: a trie costs ``DEPTH`` steps a token, which a long prompt would cost
    every stream at once; a request the policy never drafted for adds nothing (where its answer starts is not
    known)."""

    name = "suffix"
    DEPTH = 32  # window: the longest match plus draft the shared trie can give
    MAX_MATCH = 16
    FACTOR = 2.0  # draft up to this many tokens per matched token (SuffixDecoding's alpha)
    MIN_PROB = 0.1  # a draft stops where fewer than this share of the match's occurrences went on so
    MAX_NODES = 200_000  # the shared trie's bound (~60 MB of Python lists and dicts)

    def __init__(self, options: DraftOptions | None = None) -> None:
        self.width = options.width if options is not None else 1  # children a draft token may have (1: chains)
        self.own: dict[str, tuple[OwnText, int]] = {}  # rid -> (its tokens, where its first draft was asked)
        self.trust: dict[str, dict[str, _Trust]] = {}  # rid -> source ("own", "shared") -> how its drafts fared
        self.last: dict[str, tuple[str, list[int], int]] = {}  # rid -> (source, draft, tokens then) of its last
        self.shared = SuffixTrie(self.DEPTH)
        self.recent: deque[tuple[int, ...]] = deque()  # finished requests' answers, oldest first, to rebuild from
        self.recent_tokens = 0

    def propose(self, rid: str, tokens: Sequence[int], k: int, cache: DraftCache) -> DraftTree:
        text, start = self.own.get(rid) or (OwnText(), len(tokens))
        self.own[rid] = (text, start)
        text.add(tokens[len(text.tokens):])
        trust = self.trust.setdefault(rid, {"own": _Trust(OWN_PRIOR), "shared": _Trust(SHARED_PRIOR)})
        if rid in self.last:
            source, draft, then = self.last.pop(rid)
            trust[source].judge(draft, tokens[then:])
        drafts = {"own": text.draft(k, self.MAX_MATCH, self.FACTOR, self.MIN_PROB, self.width),
                  "shared": self.shared.draft(tokens, k, self.MAX_MATCH, self.FACTOR, self.MIN_PROB, self.width)[1]}
        source = max(drafts, key=lambda s: trust[s].expected(max(drafts[s].depths(), default=0)))  # ties: own
        if drafts[source]:
            self.last[rid] = (source, drafts[source], len(tokens))
        return drafts[source]

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        own = self.own.pop(rid, None)
        self.trust.pop(rid, None)
        self.last.pop(rid, None)
        if own is None:
            return
        # the answer, after the prompt's last MAX_MATCH tokens (tokens were asked for first at the first output)
        seq = tuple(tokens[max(own[1] - 1 - self.MAX_MATCH, 0):])
        self.shared.add(seq)
        self.recent.append(seq)
        self.recent_tokens += len(seq)
        while self.recent_tokens > self.MAX_NODES and len(self.recent) > 1:  # a token makes a node at least
            self.recent_tokens -= len(self.recent.popleft())
        if self.shared.nodes > self.MAX_NODES:
            self._rebuild()

    def _rebuild(self) -> None:
        trie, kept = SuffixTrie(self.DEPTH), deque()
        for seq in reversed(self.recent):
            if trie.nodes > self.MAX_NODES // 2:
                break
            trie.add(seq)
            kept.appendleft(seq)
        self.shared, self.recent, self.recent_tokens = trie, kept, sum(map(len, kept))


OWN_PRIOR = (2.0, 1.0)  # (kept, refused) a trie's drafts start with: the request's own text is the likelier copy
SHARED_PRIOR = (1.0, 1.0)


class _Trust:
    """How one trie's drafts fared for one request: its draft tokens kept and refused, after ``prior``."""

    def __init__(self, prior: tuple[float, float]) -> None:
        self.kept, self.refused = prior

    def judge(self, draft: Sequence[int], came: Sequence[int]) -> None:
        """``came``: the tokens the request made after ``draft`` was proposed (as many as are known)."""
        kept, refused = judged(draft, came)
        self.kept += kept
        self.refused += refused

    def expected(self, length: int) -> float:
        """The draft tokens of a draft of ``length`` expected to be kept: a + a^2 + .. + a^length."""
        a = self.kept / (self.kept + self.refused)
        return sum(a ** i for i in range(1, length + 1))


class Radix:
    """The radix tree's continuation of the request's whole sequence: when a request walks a path the cache
    holds (the same prompt and, so far, the same output as an earlier request: a retry, a replayed agent step,
    n > 1 greedy), the cached tokens after it are the draft; where earlier requests went on differently, a tree of
    up to ``width`` of their continuations a token, the ones more requests took first."""

    name = "radix"

    def __init__(self, options: DraftOptions | None = None) -> None:
        self.width = options.width if options is not None else 1

    def propose(self, rid: str, tokens: Sequence[int], k: int, cache: DraftCache) -> list[int]:
        return cache.continuation(tokens, k, self.width)

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        pass
