"""Speculative sampling (model/sampler.py verify_tree, a chain's check): a sampled request's verified draft keeps
each token with exactly the distribution a plain step samples it from. Checked with chi-square tests, on the rule
alone (a fixed small distribution) and end to end (an Engine on a tiny model against the model's exact
probabilities)."""
from __future__ import annotations

import pytest
import torch

# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails one test in 1000 runs
# of it (every run here is seeded, so a pass is a pass on every machine)
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 8: 26.12, 26: 54.05}


def chi_square(counts: dict, probs: dict) -> tuple[float, int]:
    """Pearson's statistic over the cells with probability > 0 (a count outside them is a failure by itself) and
    its degrees of freedom."""
    n = sum(counts.values())
    outside = {c: k for c, k in counts.items() if probs.get(c, 0.0) <= 0}
    assert not outside, f"drawn with probability 0: {outside}"
    cells = [c for c, p in probs.items() if p > 0]
    stat = sum((counts.get(c, 0) - n * probs[c]) ** 2 / (n * probs[c]) for c in cells)
    return stat, len(cells) - 1


def inputs(temperature=0.9, top_p=0.95, top_k=4, min_p=0.0):
    from radixserve.model.sampler import SamplingInputs

    return SamplingInputs(torch.tensor([temperature]), torch.tensor([top_p]), torch.tensor([top_k]),
                          torch.tensor([min_p]), [None], [0], [None])


def plain_probs(logits: torch.Tensor, s) -> dict[int, float]:
    from radixserve.model.sampler import filtered_probs

    p = filtered_probs(logits[None].float(), s, torch.tensor([0]))[0]
    p = p / p.sum()
    return {i: float(v) for i, v in enumerate(p)}


@pytest.mark.parametrize("case", ["likely draft", "unlikely draft", "filtered-out draft"])
def test_the_rule_keeps_the_plain_distribution(case):
    """Logits over 8 tokens for two draft places (and a third row, after the draft); the kept first token follows
    p_0, and the second, given the first was the draft's, follows p_1. A draft token that top-k filters out is
    always refused."""
    from radixserve.model.sampler import verify_tree

    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5
    s = inputs()
    p0, p1 = plain_probs(logits[0], s), plain_probs(logits[1], s)
    order0 = sorted(p0, key=p0.get, reverse=True)
    draft = {"likely draft": [order0[0], max(p1, key=p1.get)], "unlikely draft": [order0[2], order0[3]],
             "filtered-out draft": [order0[-1], order0[0]]}[case]
    firsts, seconds, n = {}, {}, 15_000
    for _ in range(n):
        out = verify_tree(logits, draft, [-1, 0], s, 0)  # the kept path, then the token after it
        assert 1 <= len(out) <= 3 and out[: len(out) - 1] == draft[: len(out) - 1]
        firsts[out[0]] = firsts.get(out[0], 0) + 1
        if out[0] == draft[0]:
            seconds[out[1]] = seconds.get(out[1], 0) + 1
    stat, df = chi_square(firsts, p0)
    assert stat < CHI2_999[df], (stat, df, firsts, p0)
    if case == "filtered-out draft":
        assert draft[0] not in firsts and not seconds
        return
    stat, df = chi_square(seconds, p1)
    assert stat < CHI2_999[df], (stat, df, seconds, p1)
    assert abs(firsts[draft[0]] / n - p0[draft[0]]) < 0.015  # kept as often as the model would draw it


def test_a_certain_token_is_always_kept():
    """top_p so small that one token is left: a draft of it is always kept, one of anything else never."""
    from radixserve.model.sampler import verify_tree

    logits = torch.tensor([[3.0, 1.0, 0.5, 0.0]] * 2)
    s = inputs(top_p=0.01)
    assert all(verify_tree(logits, [0], [-1], s, 0) == [0, 0] for _ in range(200))  # kept, then the certain one
    assert all(verify_tree(logits, [2], [-1], s, 0) == [0] for _ in range(200))  # refused, replaced


class Table:
    """A draft policy that proposes, after the prompt and one sampled token, a fixed two-token continuation per
    first token (the model's argmax path): drafts that are kept sometimes and refused sometimes."""

    name = "table"

    def __init__(self, prompt, table):
        self.prompt, self.table = list(prompt), table

    def propose(self, rid, tokens, k, cache):
        tokens = list(tokens)
        if len(tokens) == len(self.prompt) + 1 and tokens[: len(self.prompt)] == self.prompt:
            return self.table.get(tokens[-1], [])[:k]
        return []

    def release(self, rid, tokens):
        pass


def test_sampled_requests_keep_the_models_distribution_end_to_end(tiny_models, hf_models):
    """600 sampled requests (temperature 1, top-k 3) of 4 tokens on a tiny model, each drafting tokens 2 and 3
    after its first: the frequencies of the first three tokens against the model's exact probabilities (27
    cells), and the same requests drafted some tokens and had some refused."""
    from radixserve import Engine

    hf = hf_models["llama"]
    prompt = list(range(200, 232))
    k = 3

    @torch.no_grad()
    def top(tokens):  # the model's next-token distribution under top-k 3, temperature 1
        logits = hf(torch.tensor([tokens])).logits[0, -1].float()
        p = torch.softmax(logits, -1)
        vals, ids = p.topk(k)
        return dict(zip(ids.tolist(), (vals / vals.sum()).tolist()))

    exact, table = {}, {}
    first = top(prompt)
    for t1, q1 in first.items():
        second = top(prompt + [t1])
        g2 = max(second, key=second.get)
        third = top(prompt + [t1, g2])
        table[t1] = [g2, max(third, key=third.get)]
        for t2, q2 in second.items():
            for t3, q3 in top(prompt + [t1, t2]).items():
                exact[(t1, t2, t3)] = q1 * q2 * q3

    n = 600
    torch.manual_seed(1)
    with Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, decode_kernel="eager",
                speculative_algorithm="ngram", speculative_num_draft_tokens=2, max_running_requests=n) as engine:
        engine.scheduler.spec.gate = None
        engine.scheduler.spec.policy = Table(prompt, table)
        outs = engine.generate(input_ids=[prompt] * n, sampling_params={
            "max_new_tokens": 4, "temperature": 1.0, "top_k": k, "ignore_eos": True})
        spec = engine.cache_stats()["speculative"]
    counts = {}
    for o in outs:
        key = tuple(o["output_ids"][:3])
        counts[key] = counts.get(key, 0) + 1
    stat, df = chi_square(counts, exact)
    assert stat < CHI2_999[df], (stat, df)
    assert 0 < spec["accepted"] < spec["drafted"], spec
    assert spec["drafts"] >= n // 2, spec  # most requests drafted (a request backs off after a refused draft)
    usage = [o["meta_info"].get("completion_tokens_details") for o in outs]
    assert any(u and u["accepted_prediction_tokens"] > 0 for u in usage)


class Always:
    """A draft policy that always proposes something."""

    name = "always"

    def propose(self, rid, tokens, k, cache):
        return [500] * k

    def release(self, rid, tokens):
        pass


def test_a_server_with_a_random_seed_drafts_for_greedy_requests_only(tiny_models):
    """--random-seed makes unseeded sampling reproducible; whether a step drafted depends on timing (the cost
    gate), so there a sampled request never drafts, and the same sampled tokens come back on a second server."""
    from radixserve import Engine

    prompt = list(range(300, 340))
    sampled = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    runs = []
    for _ in range(2):
        with Engine(str(tiny_models["llama"]), dtype="float32", decode_kernel="eager", random_seed=5,
                    speculative_algorithm="ngram") as engine:
            engine.scheduler.spec.gate = None
            engine.scheduler.spec.policy = Always()
            runs.append([o["output_ids"] for o in engine.generate(input_ids=[prompt] * 3, sampling_params=sampled)])
            assert engine.cache_stats()["speculative"]["drafts"] == 0
            engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0})
            assert engine.cache_stats()["speculative"]["drafts"] > 0
    assert runs[0] == runs[1]
