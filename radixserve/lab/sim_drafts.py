"""Draft policies in the simulator: how many tokens each would have let a verifier accept, on recorded requests.

Greedy decoding is deterministic, so a trace of (prompt, output) pairs says exactly what the model will write:
each decode step the policy proposes up to ``k`` tokens for the request's tokens so far, the verifier keeps the
longest prefix of the draft that matches the recorded output plus the one token the model computes after it (as a
plain step would), and the request moves on by that many. Requests run one after another, each finished one put
in a radix tree (the ``radix`` policy's source) and handed to the policy's ``release``.

    acceptance rate = accepted / drafted      tokens per step = output tokens / decode steps
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from radixserve.cache.radix_tree import RadixTree
from radixserve.policies import load_draft_policy, load_eviction_policy
from radixserve.policies.draft_trees import accepted_prefix
from radixserve.policies.drafts import DraftOptions


@dataclass
class DraftStats:
    policy: str
    requests: int = 0
    tokens: int = 0  # output tokens after the first (the first comes from the prefill, never drafted)
    steps: int = 0  # decode steps (verifications) those took
    drafted: int = 0
    accepted: int = 0
    proposals: int = 0  # steps that had a draft at all

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 1.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per step that had a draft."""
        return self.accepted / self.proposals if self.proposals else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step,
                "mean_accepted": self.mean_accepted}


class DraftSim:
    """One draft policy, ``k`` tokens a draft (a tree's: up to ``width`` children a token), fed recorded requests
    one at a time (``add``): the simulator's and the shadows' (a server with --speculative-algorithm and
    --shadow-policies measures every other draft policy on its live greedy requests). A draft tree keeps the path
    the recorded output walks."""

    def __init__(self, policy_name: str, k: int, width: int = 1) -> None:
        self.policy, self.k = load_draft_policy(policy_name, DraftOptions(width=width)), k
        self.tree = RadixTree(load_eviction_policy("lru"), lambda slots: None)
        self.stats = DraftStats(policy_name)

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        stats, rid = self.stats, f"sim-{self.stats.requests}"
        tokens, pos = [*prompt, *output[:1]], min(1, len(output))
        while pos < len(output):
            draft = self.policy.propose(rid, tokens, self.k, self.tree)[: self.k]
            ok = accepted_prefix(draft, output[pos:])
            step = min(ok + 1, len(output) - pos)
            stats.drafted += len(draft)
            stats.accepted += min(ok, step)
            stats.proposals += bool(draft)
            stats.steps += 1
            tokens += output[pos : pos + step]
            pos += step
        stats.tokens += max(len(output) - 1, 0)
        stats.requests += 1
        self.policy.release(rid, tokens)
        self.tree.insert(tokens, np.arange(len(tokens), dtype=np.int32))


def simulate_drafts(policy_name: str, traces: Iterable[tuple[Sequence[int], Sequence[int]]], k: int,
                    width: int = 1) -> DraftStats:
    """Run ``traces`` (prompt ids, greedy output ids) through the draft policy ``policy_name``, ``k`` tokens a draft
    (up to ``width`` children a token, for a policy that drafts trees)."""
    sim = DraftSim(policy_name, k, width)
    for prompt, output in traces:
        sim.add(prompt, output)
    return sim.stats


def compare_drafts(names: Sequence[str], traces: Sequence[tuple[Sequence[int], Sequence[int]]],
                   k: int, width: int = 1) -> list[DraftStats]:
    return [simulate_drafts(name, traces, k, width) for name in names]


def table(stats: Sequence[DraftStats], k: int) -> str:
    head = f"{'draft policy':16} {'requests':>8} {'tokens':>8} {'steps':>8} {'drafted':>8} {'accepted':>8} " \
           f"{'accept %':>8} {'tok/step':>8}   (k = {k})"
    lines = [head, "-" * len(head)]
    for s in stats:
        lines.append(f"{s.policy:16} {s.requests:>8} {s.tokens:>8} {s.steps:>8} {s.drafted:>8} {s.accepted:>8} "
                     f"{100 * s.acceptance_rate:>7.1f}% {s.tokens_per_step:>8.2f}")
    return "\n".join(lines)


def plot(stats: Sequence[DraftStats], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [s.policy for s in stats]
    a.bar(names, [s.tokens_per_step for s in stats])
    a.set(ylabel="output tokens per decode step", title="tokens per step (the most a verifier saves)")
    b.bar(names, [100 * s.acceptance_rate for s in stats])
    b.set(ylabel="% of drafted tokens accepted", title="acceptance")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
