"""Draft policies for speculative decoding (policies/drafts.py), the radix tree's continuation they read, and the
acceptance simulator (radixserve/lab/sim_drafts.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from radixserve.cache.radix_tree import RadixTree
from radixserve.lab.sim_drafts import compare_drafts, simulate_drafts
from radixserve.policies import available, load_draft_policy, load_eviction_policy
from radixserve.policies.draft_trees import accepted_prefix
from radixserve.policies.drafts import NGram, NoCache, Radix, Suffix, SuffixTrie


def tree_of(*seqs: list[int]) -> RadixTree:
    tree = RadixTree(load_eviction_policy("lru"), lambda slots: None)
    for seq in seqs:
        tree.insert(seq, np.arange(len(seq), dtype=np.int32))
    return tree


def test_every_built_in_draft_policy_is_registered():
    assert {"none", "ngram", "suffix", "radix"} <= set(available("draft"))
    assert load_draft_policy("none").propose("r", [1, 2, 3], 4, NoCache()) == []
    with pytest.raises(ValueError, match="draft policy"):
        load_draft_policy("no-such-policy")


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    p = NGram()
    assert p.propose("r", [1, 2, 3, 4, 5, 9, 1, 2, 3], 3, NoCache()) == [4, 5, 9]
    # the request grows: [2, 3] occurred at two places before; the latest one's continuation is taken
    assert p.propose("r", [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 2, 3], 2, NoCache()) == [7, 2]
    # the current end alone is no occurrence: nothing before matches [8, 6]
    assert p.propose("s", [5, 8, 6], 3, NoCache()) == []
    assert p.propose("t", [4, 4, 4], 2, NoCache()) == [4]  # [4, 4] ended at 2 before: one token follows it
    p.release("r", [])
    assert "r" not in p.indexes


def test_suffix_drafts_from_the_request_and_from_earlier_requests():
    p = Suffix()
    # its own tokens: the longest suffix [1, 2, 3] occurred before, followed by 4 5 9
    assert p.propose("r", [1, 2, 3, 4, 5, 9, 1, 2, 3], 3, NoCache()) == [4, 5, 9]
    p.release("r", [1, 2, 3, 4, 5, 9, 1, 2, 3, 4])
    # an earlier request's: a match of 2 tokens drafts up to FACTOR x 2 = 4
    assert p.propose("s", [20, 21, 4, 5], 8, NoCache()) == [9, 1, 2, 3]
    assert p.propose("u", [30, 31], 4, NoCache()) == []


def test_suffix_takes_the_request_own_text_over_an_earlier_request_longer_match_until_it_fails():
    """Repeating an answer the prompt quotes: an earlier request's longer match went on otherwise. The request's
    own continuation is drafted (its trie is trusted more to begin with); once the tokens that came refuse it, the
    own trie is trusted less."""
    p = Suffix()
    p.propose("old", [1], 4, NoCache())  # its answer began at the second token: all of it is kept
    p.release("old", [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 51, 52, 53])
    tokens = [70, 8, 9, 60, 61, 62, 63, 71, 3, 4, 5, 6, 7, 8, 9]  # own: [8, 9] -> 60..; shared: [3 .. 9] -> 50..
    assert p.propose("r", tokens, 8, NoCache()) == [60, 61, 62, 63]
    before = p.trust["r"]["own"].expected(4)
    assert p.propose("r", tokens + [50, 51], 8, NoCache()) == [52, 53]  # the model went on as the earlier request
    assert p.trust["r"]["own"].expected(4) < before
    p.release("r", tokens)
    assert "r" not in p.trust and "r" not in p.last


def test_suffix_follows_the_most_frequent_continuation():
    trie = SuffixTrie(depth=8)
    for seq in ([1, 2, 3], [1, 2, 3], [1, 2, 4]):
        trie.add(seq)
    assert trie.draft([9, 1, 2], k=4, max_match=4, factor=4) == (2, [3])
    for t in range(10, 30):  # after 5: twenty tokens, once each
        trie.add([5, t])
    assert trie.draft([5], k=2, max_match=4, factor=2) == (1, [10])
    assert trie.draft([5], k=2, max_match=4, factor=2, min_prob=0.1) == (1, []), "1 in 20 is no draft"
    assert trie.draft([1, 2], k=4, max_match=4, factor=4, min_prob=0.5) == (2, [3]), "2 of 3 is"


def test_a_request_own_text_drafts_the_longest_match_and_its_most_frequent_continuation():
    from radixserve.policies.drafts import OwnText

    text = OwnText()
    text.add([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 5, 8, 1, 2, 3])
    # [1, 2, 3] occurred once before (then 4): the longest match wins over the commoner [2, 3] -> 5
    assert text.draft(k=8, max_match=16, factor=2.0) == [4, 9, 2, 3, 5, 7]
    text.add([6, 2, 3])  # [6, 2, 3] never occurred; [2, 3] four times, then 4, 5, 5, 6; after 5: 7, then 8
    assert text.draft(k=3, max_match=16, factor=2.0) == [5, 8, 1], "the continuation most share; ties: the latest"
    assert OwnText().draft(4, 16, 2.0) == [] and text.draft(0, 16, 2.0) == []
    assert text.draft(k=3, max_match=16, factor=2.0, min_prob=0.5) == [5], "then 1 of 2 went on to 8: no more"
    text.add([42])
    assert text.draft(4, 16, 2.0) == [], "a token never seen before has no continuation"


def test_the_shared_trie_takes_answers_not_prompts():
    """A long prompt would cost the shared trie DEPTH steps a token at the end of every request: it takes the
    answer, after the prompt's last MAX_MATCH tokens; a request the policy never drafted for adds nothing."""
    p = Suffix()
    prompt = list(range(100, 140))
    p.propose("r", prompt + [7], 4, NoCache())  # asked first once the first output token (7) came
    p.release("r", prompt + [7, 8, 9])
    assert p.recent[-1] == tuple(prompt[-p.MAX_MATCH:] + [7, 8, 9])
    assert p.propose("s", [1, 138, 139], 4, NoCache()) == [7, 8, 9]
    assert p.propose("t", [1, 110, 111], 4, NoCache()) == [], "the prompt's start is not in the trie"
    p.release("never asked", list(range(300, 400)))
    assert len(p.recent) == 1


def test_the_shared_suffix_trie_stays_bounded():
    p = Suffix()
    p.MAX_NODES = 2_000
    rng = np.random.default_rng(0)
    for i in range(40):  # random tokens: every window of every request is new (~2,700 nodes a request)
        tokens = rng.integers(0, 50_000, 100).tolist()
        p.propose(f"r{i}", tokens[:1], 4, NoCache())
        p.release(f"r{i}", tokens)
        assert p.shared.nodes <= p.MAX_NODES // 2 + 100 * p.DEPTH and p.recent_tokens <= p.MAX_NODES
    seq = list(p.recent[-1])  # the newest request is always kept
    assert p.propose("x", [1] + seq[:20], 4, NoCache()) == seq[20:24]


def test_radix_continuation_follows_the_cached_path():
    tree = tree_of([1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8])
    version = tree.version
    # the hits decide the branch: [1, 2, 3, 7] is matched twice
    for _ in range(2):
        tree.match_prefix([1, 2, 3, 7])
    assert tree.continuation([1, 2], 3) == [3, 7, 8]
    assert tree.continuation([1, 2, 3, 4], 5) == [5, 6]  # inside a node, to the leaf's end
    assert tree.continuation([1, 2, 9], 3) == []  # not all of it cached
    assert tree.continuation([], 2) == [1, 2]
    assert tree.continuation([1, 2], 0) == []
    # with width 2, the branch fewer requests took too, after the likelier path's tokens
    both = tree.continuation([1, 2], 5, width=2)
    assert both == [3, 7, 8, 4, 5] and both.parents == [-1, 0, 1, 0, 3], both.parents
    tree.check()  # raises if the tree broke
    assert tree.version == version
    assert Radix().propose("r", [1, 2, 3, 4], 1, tree) == [5]


def test_the_simulator_counts_what_a_greedy_verifier_would_accept():
    prompt = list(range(100, 140))
    output = prompt[10:30] + [7, 8, 9]  # the output copies the prompt, then writes something new
    none = simulate_drafts("none", [(prompt, output)], 4)
    assert (none.steps, none.tokens, none.drafted, none.tokens_per_step) == (len(output) - 1, len(output) - 1, 0, 1)
    ngram = simulate_drafts("ngram", [(prompt, output)], 4)
    assert ngram.tokens == len(output) - 1 and ngram.steps < none.steps / 2
    assert ngram.accepted <= ngram.drafted and ngram.tokens <= ngram.steps + ngram.accepted
    # radix: the same request again walks its cached path, every draft accepted
    again = simulate_drafts("radix", [(prompt, output), (prompt, output)], 4)
    assert again.acceptance_rate > 0.9
    rows = {s.policy: s.as_dict() for s in compare_drafts(["none", "ngram", "suffix", "radix"],
                                                          [(prompt, output)] * 3, 6)}
    assert rows["suffix"]["tokens_per_step"] > 2 and rows["none"]["tokens_per_step"] == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.lists(st.integers(0, 5), min_size=1, max_size=40),
       st.sampled_from(["ngram", "suffix", "radix"]), st.integers(1, 8))
def test_drafts_never_change_the_output(prompt, output, name, k):
    """Whatever a policy proposes, the simulated verifier moves through exactly the recorded output: the tokens a
    request ends with are its prompt and output, and a step never accepts more than it drafted."""
    seen = []
    policy = load_draft_policy(name)

    class Spy:
        name = policy.name

        def propose(self, rid, tokens, k_, cache):
            seen.append(list(tokens))
            draft = policy.propose(rid, tokens, k_, cache)
            assert len(draft) <= k_
            return draft

        def release(self, rid, tokens):
            assert list(tokens) == prompt + output
            policy.release(rid, tokens)

    import radixserve.lab.sim_drafts as sim

    real = sim.load_draft_policy
    sim.load_draft_policy = lambda n, options=None: Spy()
    try:
        stats = simulate_drafts(name, [(prompt, output), (prompt, output)], k)
    finally:
        sim.load_draft_policy = real
    assert all(t == (prompt + output)[: len(t)] for t in seen)
    assert stats.accepted <= stats.drafted and stats.tokens == 2 * (len(output) - 1)


def test_accepted_prefix():
    assert accepted_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert accepted_prefix([], [1]) == 0
    assert accepted_prefix([1, 2], [1]) == 1
    assert accepted_prefix([5], [6]) == 0


def test_the_compare_cli_measures_draft_policies_on_a_trace(tmp_path):
    """radixserve compare --draft-policies: a trace whose outputs copy their prompts; the table, compare.json and
    drafts.png; a typo is named; a workload without outputs says what is missing."""
    import json
    import subprocess
    import sys

    from radixserve.lab import trace as trace_io
    from radixserve.lab.trace import TraceRequest

    rng = np.random.default_rng(1)
    reqs = []
    for i in range(6):
        prompt = rng.integers(100, 5000, 60).tolist()
        reqs.append(TraceRequest(id=f"r{i}", prompt=prompt, max_tokens=30, output=prompt[10:40]))
    trace_io.save(reqs, tmp_path / "t.jsonl")
    out = tmp_path / "out"
    run = lambda *a: subprocess.run([sys.executable, "-m", "radixserve", "compare", *a], capture_output=True,
                                    text=True, timeout=300)
    proc = run("--trace", str(tmp_path / "t.jsonl"), "--draft-policies", "none,ngram,suffix,radix",
               "--draft-tokens", "6", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = {d["policy"]: d for d in json.loads((out / "compare.json").read_text())["drafts"]}
    assert rows["none"]["tokens_per_step"] == 1 and rows["ngram"]["tokens_per_step"] > 3, rows
    assert "tok/step" in proc.stdout and (out / "drafts.png").stat().st_size > 1000
    typo = run("--trace", str(tmp_path / "t.jsonl"), "--draft-policies", "ngarm")
    assert typo.returncode != 0 and "unknown draft policy 'ngarm'" in typo.stderr
    trace_io.save([TraceRequest(id="q", prompt=[1, 2, 3], max_tokens=4)], tmp_path / "bare.jsonl")
    bare = run("--trace", str(tmp_path / "bare.jsonl"), "--draft-policies", "ngram", "--out", str(out))
    assert bare.returncode != 0 and "carries an output" in bare.stderr, bare.stderr
