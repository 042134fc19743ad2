"""Draft trees (policies/draft_trees.py's DraftTree): one forward verifies every branch, each draft token attending to
its request's prefix and its own ancestors only (a tree mask), on every attention backend and decode kernel; the
kept path is exactly what plain decoding makes, greedy or sampled; only the kept path's K/V stays."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from radixserve.kernels import AttentionBatch, get_backend
from radixserve.policies.draft_trees import DraftTree
from radixserve.policies.drafts import OwnText, SuffixTrie

from test_speculative import prompts, run

TREE = DraftTree([5, 6, 7, 8, 9], parents=[-1, -1, 0, 1, 2])  # 5 -> 7 -> 9, 6 -> 8


def test_a_draft_tree_walks_and_checks_itself():
    assert TREE.walk([5, 7, 9, 1]) == [0, 2, 4] and TREE.walk([6, 8]) == [1, 3] and TREE.walk([4]) == []
    assert TREE.depths() == [1, 1, 2, 2, 3] and not TREE.is_chain and DraftTree([1, 2, 3]).is_chain
    assert TREE[:3] == [5, 6, 7] and TREE[:3].parents == [-1, -1, 0]
    assert TREE.problem() is None
    assert DraftTree([5, 5], parents=[-1, -1]).problem() == "two siblings have the same token"
    assert DraftTree([5, 6], parents=[-1, 1]).problem() is not None  # a parent after its child


def test_suffix_sources_branch_where_the_continuations_split():
    """Width 1 is the most frequent path (as before); width 2 also takes the runner-up where the occurrences split,
    likeliest paths first."""
    text = OwnText()
    text.add([1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3])
    # two of three occurrences of the last 3 tokens went on with 4 9 1 2 3, then one with 5, one with 4 (a tie:
    # the latest first)
    assert text.draft(8, 16, 2.0) == [4, 9, 1, 2, 3, 5]
    tree = text.draft(8, 16, 2.0, width=2)
    assert tree.problem() is None and len(tree) == 8
    assert tree.walk([4, 9, 1, 2, 3, 5]) == [0, 1, 2, 3, 4, 6] and tree.walk([4, 9, 1, 2, 3, 4]) == [0, 1, 2, 3, 4, 7]
    assert tree.walk([5, 8]) == [5], "the runner-up at the root, taken before the deeper ties"
    trie = SuffixTrie(depth=8)
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 6, 7]):
        trie.add(seq)
    assert trie.draft([0, 2, 3], 6, 4, 2.0)[1] == [4, 5]
    m, tree = trie.draft([0, 2, 3], 6, 4, 2.0, width=2)
    assert m == 2 and tree == [4, 5, 6, 7] and tree.parents == [-1, 0, -1, 2]  # likeliest path first


# -- attention under a tree mask, every backend -------------------------------------------------------------

def tree_reference(q, k_pool, v_pool, keys, scale):
    """One query row [H, D] over exactly ``keys`` (slots), in float64."""
    k, v = k_pool[keys].double(), v_pool[keys].double()
    rep = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v)


def backends():
    out = ["torch", "batch-invariant"]
    try:
        import triton  # noqa: F401  (interpreted on a CPU: conftest sets TRITON_INTERPRET=1)
        out.append("triton")
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("window", [None, 3], ids=["all", "window"])
@pytest.mark.parametrize("name", backends())
def test_tree_attention_sees_the_prefix_and_the_ancestors_only(name, window):
    """A decoding request verifying TREE after its last token, beside a causal prefill: each draft row's output is
    attention over its prefix, the last token, its ancestors and itself -- at its depth's position, so a window
    counts depths, not row order."""
    be = get_backend(name, torch.device("cpu"), deterministic=name == "batch-invariant")
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, num_slots, scale = 4, 2, 16, 64, 0.25
    prefix_lens, extend_lens = [6, 2], [1 + len(TREE), 5]
    total = sum(prefix_lens) + sum(extend_lens)
    slots = torch.randperm(num_slots - 1, generator=g)[:total] + 1
    tree = np.concatenate([[-1], np.where(np.array(TREE.parents) < 0, 0, np.array(TREE.parents) + 1)])
    batch = AttentionBatch("extend", prefix_lens, extend_lens, slots,
                           torch.cat([slots[6:12], slots[14:19]]), dtype=torch.float32, group=2,
                           windows=(window,) if window else (), tree=[tree, None])
    batch.backend_data = be.prepare(batch)
    n = sum(extend_lens)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    k_pool, v_pool = torch.randn(num_slots, kv_heads, d, generator=g), torch.randn(num_slots, kv_heads, d, generator=g)
    be.store_kv(k_pool, v_pool, batch, k, v)
    out = be.extend(q, k, v, k_pool, v_pool, batch, scale, window=window)
    seen = batch.seen(0)
    for a in range(extend_lens[0]):
        keys = torch.cat([slots[:6], slots[6:12][torch.from_numpy(seen[a])]])
        if window:
            keys = keys[-window:]
        torch.testing.assert_close(out[a].double(), tree_reference(q[a], k_pool, v_pool, keys, scale),
                                   atol=1e-5, rtol=1e-5, msg=f"{name}: draft row {a}")
    for a in range(5):  # the causal request beside it
        keys = slots[12 : 12 + 2 + a + 1]
        if window:
            keys = keys[-window:]
        torch.testing.assert_close(out[6 + a].double(), tree_reference(q[6 + a], k_pool, v_pool, keys, scale),
                                   atol=1e-5, rtol=1e-5)


# -- the engine: exact tokens through every kernel ----------------------------------------------------------

class TreeOracle:
    """Knows the plain run's outputs and hides them in trees: at each depth the true token may come after a wrong
    sibling, be missing (the path ends there), or carry wrong children of its own, so every kept length and every
    branch position occurs."""

    name = "tree-oracle"

    def __init__(self, prompts_, outputs, seed=0):
        self.truth = [(list(p), list(o)) for p, o in zip(prompts_, outputs)]
        self.rng = random.Random(seed)
        self.branched = 0

    def propose(self, rid, tokens, k, cache):
        tokens = list(tokens)
        for p, o in self.truth:
            if tokens[: len(p)] == p and tokens[len(p):] == o[: len(tokens) - len(p)]:
                return self._tree(o[len(tokens) - len(p):], k)
        return []

    def _tree(self, true, k):
        tree, at = DraftTree(), -1
        for t in true:
            if len(tree) >= k:
                break
            wrong = self.rng.choice([t + 1, t + 2, 7])
            if self.rng.random() < 0.4:  # a wrong sibling first
                tree.append(wrong)
                tree.parents.append(at)
                if self.rng.random() < 0.5 and len(tree) < k:  # with a child of its own
                    tree.append(self.rng.randrange(100, 5000))
                    tree.parents.append(len(tree) - 2)
                self.branched += 1
            if self.rng.random() < 0.1 or len(tree) >= k:  # the true token is missing: the path ends here
                break
            tree.append(t)
            tree.parents.append(at)
            at = len(tree) - 1
        return tree if tree.problem() is None else DraftTree()

    def release(self, rid, tokens):
        pass


def with_oracle(model, workload, reference, **kw):
    from radixserve import Engine

    flat = [q for batch in workload for q in batch]
    with Engine(str(model), check_invariants=True, speculative_algorithm="ngram", speculative_num_draft_tokens=8,
                **{"dtype": "float32", **kw}) as engine:
        engine.scheduler.spec.gate = None
        oracle = engine.scheduler.spec.policy = TreeOracle(flat, reference)
        ids = []
        for batch in workload:
            rs = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 24, "temperature": 0})
            ids += [r["output_ids"] for r in rs]
        native = engine.runner.native
        return ids, engine.cache_stats()["speculative"], oracle.branched, native.prefill_steps if native else 0


@pytest.fixture(scope="module")
def workload():
    p = prompts(4, 96, seed=3)
    return [p, p[:2]]


@pytest.fixture(scope="module")
def reference(tiny_models, workload):
    return run(tiny_models["llama"], workload, decode_kernel="eager")[0]


@pytest.mark.parametrize("kernel", ["eager", "auto", "deterministic", "triton", "default"])
def test_draft_trees_keep_exactly_the_plain_tokens(tiny_models, workload, reference, kernel):
    """eager: torch's attention under the tree mask; auto: the native step (each draft row's own context list);
    deterministic: the batch-invariant kernels; triton: its extend kernel's TREE path (interpreted on a CPU);
    default: $RADIXSERVE_DECODE_KERNEL's (`make test-matrix`)."""
    kw = {"eager": {"decode_kernel": "eager"}, "auto": {"decode_kernel": "auto"},
          "deterministic": {"deterministic": True}, "triton": {"attention_backend": "triton", "decode_kernel": "eager"},
          "default": {}}[kernel]
    work = workload if kernel != "triton" else [workload[1]]  # the interpreter is slow
    ids, spec, branched, native_prefills = with_oracle(tiny_models["llama"], work, reference, **kw)
    assert ids == reference[: len(ids)], kernel
    assert branched > 10 and 0 < spec["accepted"] < spec["drafted"], spec
    if kernel == "auto":
        assert native_prefills > 0, "the native step verified drafts"


def test_draft_trees_through_chunked_prefill_eviction_and_retraction(tiny_models):
    """suffix drafting trees (width 3) in a pool too small for the batch: the tokens stay the plain run's."""
    batches = [prompts(5, 120, seed=1), prompts(5, 120, seed=1)]
    small = dict(max_total_tokens=520, chunked_prefill_size=48)
    plain, _ = run(tiny_models["llama"], batches, max_new=60, decode_kernel="eager", **small)
    ids, stats = run(tiny_models["llama"], batches, max_new=60, decode_kernel="eager", speculative_algorithm="suffix",
                     speculative_num_draft_tokens=8, speculative_draft_width=3, **small)
    assert ids == plain
    assert stats["totals"]["retractions"] > 0 and stats["speculative"]["accepted"] > 0, stats


# -- sampled: the distribution is the model's -----------------------------------------------------------------

def test_a_sampled_tree_check_keeps_the_models_distribution():
    """verify_tree on fixed logits, many times: the first token is distributed as p after the last token (whether
    it is a draft child, the first, the second, or none of them), and the token after child 2 as p after 2."""
    from radixserve.model.sampler import SamplingInputs, verify_tree

    torch.manual_seed(0)
    vocab, n = 6, 20000
    tokens, parents = [2, 0, 1, 3], [-1, -1, 0, 0]  # root: 2 then 0; after 2: 1 then 3
    logits = torch.randn(1 + len(tokens), vocab) * 1.5
    s = SamplingInputs(torch.tensor([0.8]), torch.tensor([1.0]), torch.tensor([vocab]), torch.tensor([0.0]),
                       [None], [0], [None])
    firsts, seconds = Counter(), Counter()
    for _ in range(n):
        out = verify_tree(logits, tokens, parents, s, 0)
        firsts[out[0]] += 1
        if out[0] == 2:
            seconds[out[1]] += 1
    for counts, row in ((firsts, 0), (seconds, 1)):  # row 1: after draft token 0 (the 2)
        p = torch.softmax(logits[row] / 0.8, -1).double()
        total = sum(counts.values())
        chi2 = sum((counts[t] - total * float(p[t])) ** 2 / (total * float(p[t])) for t in range(vocab))
        assert chi2 < 20.5, (row, chi2, counts, p)  # chi-square, 5 degrees of freedom: p = 0.001


def test_the_simulator_keeps_the_branch_the_recorded_output_takes():
    """The simulator (`radixserve compare --draft-policies`, the shadows) walks a draft tree with the recorded
    output: a tree whose second branch is right keeps a token each step, its first branch alone (a chain) none."""
    from radixserve.lab.sim_drafts import DraftSim

    prompt, output = [1, 2, 3], [40, 41, 42, 43, 44, 45]

    class Forked:
        name = "forked"

        def __init__(self, width):
            self.width = width

        def propose(self, rid, tokens, k, cache):
            right = output[len(tokens) - len(prompt)]
            return DraftTree([7, right][: self.width], parents=[-1, -1][: self.width])

        def release(self, rid, tokens):
            pass

    kept = {}
    for width in (1, 2):
        sim = DraftSim("ngram", 8)
        sim.policy = Forked(width)
        sim.add(prompt, output)
        kept[width] = (sim.stats.accepted, sim.stats.steps)
    assert kept == {1: (0, 5), 2: (3, 3)}, kept  # 5 tokens after the first: 2 + 2 + 1 (the last one drafted)
