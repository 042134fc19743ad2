"""Built-in workloads, seeded: the sharing patterns a prefix cache and a scheduler are judged on.

    shared-prefix   G groups, each with its own long prefix (a system prompt); requests of all groups interleaved
    multi-turn      G conversations; each turn repeats the whole conversation so far (answers included)
    few-shot        G tasks with their own block of examples, task popularity Zipf-skewed, plus one-off long
                    prompts ("noise") that sweep the cache: where LFU/GDSF should beat LRU
    tree-of-thought G trees of branching reasoning: each branch extends its parent's prompt and answer
    unique          nothing shared: what the cache costs when it cannot help
    mixture         all of the above, interleaved
    phase-shift     a scan over more prefixes than the cache holds, then a drifting hot prefix among one-offs:
                    the best eviction policy changes halfway (what --auto-policy is for)
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, fields

from radixserve.lab.trace import TraceRequest, validate

KINDS = ("shared-prefix", "multi-turn", "few-shot", "tree-of-thought", "unique", "mixture", "phase-shift")


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "shared-prefix"
    requests: int = 200  # about this many (multi-turn and trees round to whole conversations / trees)
    seed: int = 0
    rate: float = 0.0  # Poisson arrivals per second; 0: everything arrives at once
    groups: int = 8  # groups / conversations / tasks / trees
    prefix_tokens: int = 256  # the shared part (a system prompt, a block of examples, a root question)
    suffix_tokens: int = 32  # the part of each request nobody else has
    output_tokens: int = 16
    skew: float = 1.1  # Zipf exponent of task popularity (few-shot)
    noise: float = 0.25  # share of one-off long prompts (few-shot)
    think_time: float = 0.2  # seconds between a chat turn and the next, a tree node and its branches
    vocab_low: int = 1000
    vocab_high: int = 30000

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown workload {self.kind!r}; built in: {', '.join(KINDS)}")
        for f in ("requests", "groups", "prefix_tokens", "suffix_tokens", "output_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"workload {f} must be >= 1")


class _Gen:
    def __init__(self, spec: WorkloadSpec, tag: str) -> None:
        self.spec, self.tag = spec, tag
        self.rng = random.Random(f"{spec.seed}:{tag}")
        self.clock = 0.0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.spec.vocab_low, self.spec.vocab_high) for _ in range(n)]

    def arrival(self) -> float:
        if self.spec.rate > 0:
            self.clock += self.rng.expovariate(self.spec.rate)
        return self.clock

    def req(self, rid: str, prompt: list[int], **kw) -> TraceRequest:
        out = self.tokens(self.spec.output_tokens)
        return TraceRequest(id=f"{self.tag}-{rid}", prompt=prompt, max_tokens=len(out), output=out, tag=self.tag, **kw)


def shared_prefix(spec: WorkloadSpec, tag: str = "shared") -> list[TraceRequest]:
    g = _Gen(spec, tag)
    prefixes = [g.tokens(spec.prefix_tokens) for _ in range(spec.groups)]
    out = []
    for i in range(spec.requests):
        k = g.rng.randrange(spec.groups)
        out.append(g.req(f"g{k}-r{i}", prefixes[k] + g.tokens(spec.suffix_tokens), arrival=g.arrival()))
    return out


def multi_turn(spec: WorkloadSpec, tag: str = "chat") -> list[TraceRequest]:
    g = _Gen(spec, tag)
    system = g.tokens(spec.prefix_tokens)
    turns = max(1, spec.requests // spec.groups)
    out = []
    for c in range(spec.groups):
        history = list(system)
        prev: TraceRequest | None = None
        for t in range(turns):
            history += g.tokens(spec.suffix_tokens)  # the user's new message
            timing = {"arrival": g.arrival()} if prev is None else {"after": prev.id, "delay": spec.think_time}
            prev = g.req(f"c{c}-t{t}", list(history), **timing)
            out.append(prev)
            history += prev.output  # the answer is part of the next turn's prompt
    return out


def few_shot(spec: WorkloadSpec, tag: str = "fewshot") -> list[TraceRequest]:
    g = _Gen(spec, tag)
    blocks = [g.tokens(spec.prefix_tokens) for _ in range(spec.groups)]
    weights = [1 / (k + 1) ** spec.skew for k in range(spec.groups)]
    out = []
    for i in range(spec.requests):
        if g.rng.random() < spec.noise:  # a one-off long prompt: pure cache pressure
            out.append(g.req(f"noise-{i}", g.tokens(spec.prefix_tokens + spec.suffix_tokens), arrival=g.arrival()))
        else:
            k = g.rng.choices(range(spec.groups), weights)[0]
            out.append(g.req(f"task{k}-{i}", blocks[k] + g.tokens(spec.suffix_tokens), arrival=g.arrival()))
    return out


def tree_of_thought(spec: WorkloadSpec, tag: str = "tot", branching: int = 3) -> list[TraceRequest]:
    g = _Gen(spec, tag)
    per_tree = max(1, spec.requests // spec.groups)
    out = []
    for t in range(spec.groups):
        root = g.req(f"t{t}-n0", g.tokens(spec.prefix_tokens), arrival=g.arrival())
        out.append(root)
        frontier, n = [root], 1
        while n < per_tree and frontier:
            parent = frontier.pop(0)
            for _ in range(branching):
                if n >= per_tree:
                    break
                prompt = parent.prompt + parent.output + g.tokens(max(1, spec.suffix_tokens // 2))
                child = g.req(f"t{t}-n{n}", prompt, after=parent.id, delay=spec.think_time)
                out.append(child)
                frontier.append(child)
                n += 1
    return out


def unique(spec: WorkloadSpec, tag: str = "unique") -> list[TraceRequest]:
    g = _Gen(spec, tag)
    return [g.req(f"u{i}", g.tokens(spec.prefix_tokens + spec.suffix_tokens), arrival=g.arrival())
            for i in range(spec.requests)]


def phase_shift(spec: WorkloadSpec, tag: str = "shift", repeats: int = 4) -> list[TraceRequest]:
    """Two halves that want opposite eviction policies. First a scan: requests cycle through ``groups`` prefixes
    in order, more than the cache holds, so the prefix about to come back is always the least recently used one:
    LRU hits nothing, MRU and FILO keep a few. Then a drifting hot prefix: each new prefix is used ``repeats``
    times, every use followed by a one-off prompt of the same size. Recency is right there; MRU and FILO evict
    the hot prefix to make room for the next one-off, and what LFU counted in the first half squats."""
    g = _Gen(spec, tag)
    half = spec.requests // 2
    cycled = [g.tokens(spec.prefix_tokens) for _ in range(spec.groups)]
    out = [g.req(f"scan{i % spec.groups}-{i}", cycled[i % spec.groups] + g.tokens(spec.suffix_tokens),
                 arrival=g.arrival()) for i in range(half)]
    hot: list[int] = []
    for i in range(half, spec.requests):
        j = i - half
        if j % 2:
            prompt, rid = g.tokens(spec.prefix_tokens + spec.suffix_tokens), f"once-{i}"
        else:
            if j // 2 % repeats == 0:
                hot = g.tokens(spec.prefix_tokens)
            prompt, rid = hot + g.tokens(spec.suffix_tokens), f"hot{j // 2 // repeats}-{i}"
        out.append(g.req(rid, prompt, after=out[-1].id, delay=spec.think_time))  # one at a time
    return out


def mixture(spec: WorkloadSpec) -> list[TraceRequest]:
    parts = [shared_prefix, multi_turn, few_shot, tree_of_thought, unique]
    share = max(1, spec.requests // len(parts))
    groups = max(1, spec.groups // 2)
    out = []
    for make in parts:
        sub = WorkloadSpec(**{**{f.name: getattr(spec, f.name) for f in fields(spec)}, "kind": "mixture",
                              "requests": share, "groups": groups})
        out += make(sub)
    return sorted(out, key=lambda r: r.arrival)


GENERATORS: dict[str, Callable[[WorkloadSpec], list[TraceRequest]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "tree-of-thought": tree_of_thought,
    "unique": unique,
    "mixture": mixture,
    "phase-shift": phase_shift,
}


def build(spec: WorkloadSpec) -> list[TraceRequest]:
    return validate(GENERATORS[spec.kind](spec))
