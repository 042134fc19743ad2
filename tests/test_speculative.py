"""Speculative decoding (actors/scheduler/speculate.py): a verified draft keeps exactly the tokens plain greedy
decoding gives, with every draft policy, through chunked prefill, eviction and retraction, on each decode kernel;
invariants checked after every step."""
from __future__ import annotations

import random
import time

import pytest



def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (a phrase said three times, then its start): drafts from the request's own
    tokens have something to find, and a random model's greedy output loops often enough for the rest."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(100, 5000) for _ in range(length // 4)]
        out.append((phrase * 3 + phrase[: length // 8])[:length])
    return out


def run(model, batches, max_new=24, **kw):
    """Greedy outputs and cache statistics; with speculation, every decode step drafts (the cost gate, which turns
    drafting off where it does not pay, is tested on its own)."""
    from radixserve import Engine

    engine = Engine(str(model), **{"dtype": "float32", "check_invariants": True, **kw})
    engine.scheduler.spec.gate = None
    try:
        out = []
        for batch in batches:
            rs = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": max_new, "temperature": 0})
            out += [r["output_ids"] for r in rs]
        return out, engine.cache_stats()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def workload():
    p = prompts(4, 96)
    return [p, p[:2], [p[0]]]  # a batch, then the same prompts again (the radix tree holds their continuations)


@pytest.fixture(scope="module")
def reference(tiny_models, workload):
    ids, _ = run(tiny_models["llama"], workload, decode_kernel="eager")
    return ids


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX", "RADIX"])
@pytest.mark.parametrize("kernel", ["eager", "auto"])
def test_greedy_tokens_are_the_same_with_drafts(tiny_models, workload, reference, algorithm, kernel):
    ids, stats = run(tiny_models["llama"], workload, decode_kernel=kernel, speculative_algorithm=algorithm,
                     speculative_num_draft_tokens=6)
    assert ids == reference, (algorithm, kernel)
    spec = stats["speculative"]
    assert spec["draft_policy"] == algorithm.lower() and spec["accepted"] <= spec["drafted"], spec
    assert stats["totals"]["generated_tokens"] == sum(map(len, ids))
    if algorithm != "NGRAM":  # a random model's output rarely repeats its own n-grams: ngram drafts little here
        assert spec["accepted"] > 0, spec
        assert stats["totals"]["steps"] < stats["totals"]["generated_tokens"], "no step kept more than one token"


class Oracle:
    """A draft policy that knows the plain run's outputs and gets them partly wrong: each draft is the true
    continuation with one token changed at a random place (or left right, or all garbage), so verification keeps
    every possible number of tokens, 0 to the whole draft."""

    name = "oracle"

    def __init__(self, prompts_, outputs, seed=0):
        self.truth = [(list(p), list(o)) for p, o in zip(prompts_, outputs)]
        self.rng = random.Random(seed)

    def propose(self, rid, tokens, k, cache):
        tokens = list(tokens)
        for p, o in self.truth:
            if tokens[: len(p)] == p and tokens[len(p):] == o[: len(tokens) - len(p)]:
                draft = o[len(tokens) - len(p) : len(tokens) - len(p) + k]
                kind = self.rng.random()
                if kind < 0.2:
                    return [self.rng.randrange(100, 5000) for _ in range(k)]
                if kind < 0.8 and draft:
                    draft[self.rng.randrange(len(draft))] = 7  # a token the outputs never hold
                return draft
        return []

    def release(self, rid, tokens):
        pass


@pytest.mark.parametrize("kernel", ["eager", "auto", "default"])
def test_partly_wrong_drafts_keep_exactly_the_plain_tokens(tiny_models, workload, reference, kernel):
    """(``default``: $RADIXSERVE_DECODE_KERNEL's, so `make test-matrix` runs it on each kernel: compiled too.)"""
    from radixserve import Engine

    flat = [q for batch in workload for q in batch]
    chosen = {} if kernel == "default" else {"decode_kernel": kernel}
    with Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, **chosen,
                speculative_algorithm="ngram", speculative_num_draft_tokens=5) as engine:
        engine.scheduler.spec.gate = None
        engine.scheduler.spec.policy = Oracle(flat, reference)
        ids = []
        for batch in workload:
            rs = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 24, "temperature": 0})
            ids += [r["output_ids"] for r in rs]
        spec = engine.cache_stats()["speculative"]
    assert ids == reference
    assert 0 < spec["accepted"] < spec["drafted"], spec


def test_bf16_deterministic_drafts_keep_the_tokens(tiny_models, workload):
    """In bf16 the verifying forward (an extend) and a plain decode step may round differently; --deterministic
    computes both the same way, so there the tokens are the same in bf16 too."""
    kw = dict(dtype="bfloat16", deterministic=True)
    plain, _ = run(tiny_models["llama"], workload, **kw)
    ids, stats = run(tiny_models["llama"], workload, speculative_algorithm="suffix", **kw)
    assert ids == plain and stats["speculative"]["accepted"] > 0


def test_exact_through_chunked_prefill_eviction_and_retraction(tiny_models):
    """A pool too small for the batch: requests are retracted mid-decode and prefixes evicted; chunked prefill of
    small chunks; drafts of up to 8 tokens (from the earlier batch's outputs) still keep every token the plain
    run gives."""
    batches = [prompts(5, 120, seed=1), prompts(5, 120, seed=1)]
    small = dict(max_total_tokens=520, chunked_prefill_size=48)
    reference, _ = run(tiny_models["llama"], batches, max_new=60, decode_kernel="eager", **small)
    ids, stats = run(tiny_models["llama"], batches, max_new=60, decode_kernel="eager",
                     speculative_algorithm="suffix", speculative_num_draft_tokens=8, **small)
    assert ids == reference
    assert stats["totals"]["retractions"] > 0 and stats["totals"]["evicted_tokens"] > 0, stats["totals"]
    assert stats["speculative"]["accepted"] > 0


def test_seeded_penalized_and_logprob_requests_do_not_speculate(tiny_models):
    """Seeded sampled and penalized requests beside a greedy one decode as before in the same steps (a seeded
    request's tokens stay those of its seed); a request that asks for logprobs gets one per token, and never a
    draft. (Unseeded sampled requests draft: tests/test_speculative_sampling.py.)"""
    from radixserve import Engine

    p = prompts(1, 96, seed=3)[0]
    greedy = {"max_new_tokens": 20, "temperature": 0}
    kw = dict(dtype="float32", check_invariants=True, decode_kernel="eager")
    with Engine(str(tiny_models["llama"]), **kw) as plain:
        want = plain.generate(input_ids=[p, p, p], sampling_params=[
            greedy, {"max_new_tokens": 20, "temperature": 0.8, "seed": 1},
            {**greedy, "frequency_penalty": 0.5}])
    with Engine(str(tiny_models["llama"]), speculative_algorithm="suffix", **kw) as engine:
        engine.scheduler.spec.gate = None
        engine.generate(input_ids=p, sampling_params=greedy)  # the suffix trie learns the greedy output
        before = engine.cache_stats()["speculative"]["drafts"]
        outs = engine.generate(input_ids=[p, p, p], sampling_params=[
            greedy, {"max_new_tokens": 20, "temperature": 0.8, "seed": 1},
            {**greedy, "frequency_penalty": 0.5}])
        stats = engine.cache_stats()["speculative"]
        with_lp = engine.generate(input_ids=p, sampling_params=greedy, return_logprob=True)
        after = engine.cache_stats()["speculative"]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in want]
    assert 0 < stats["drafts"] - before <= stats["steps"], "only the first request drafted"
    assert with_lp["output_ids"] == want[0]["output_ids"]
    assert len(with_lp["meta_info"]["output_token_logprobs"]) == 20 and after["drafts"] == stats["drafts"]


def test_a_draft_never_passes_max_new_tokens_or_a_stop_token(tiny_models, reference, workload):
    """Budgets of 1..5 tokens, and the reference's own 5th token as a stop token: drafts end where plain decoding
    ends."""
    from radixserve import Engine

    p = workload[0][0]
    full = reference[0]
    with Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, decode_kernel="eager",
                speculative_algorithm="radix", speculative_num_draft_tokens=8) as engine:
        engine.scheduler.spec.gate = None
        engine.generate(input_ids=[p], sampling_params={"max_new_tokens": 24, "temperature": 0})  # cached now
        for n in range(1, 6):
            out = engine.generate(input_ids=[p], sampling_params={"max_new_tokens": n, "temperature": 0})[0]
            assert out["output_ids"] == full[:n]
        stop = full[4]
        out = engine.generate(input_ids=[p], sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                              "stop_token_ids": [stop]})[0]
        assert out["output_ids"] == full[: full.index(stop) + 1]
        assert engine.cache_stats()["speculative"]["accepted"] > 0
        out = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 24, "temperature": 0})
        details = out["meta_info"]["completion_tokens_details"]  # OpenAI's names for what the drafts gave
        # the cached path holds the whole answer: drafts of 8, 8 and 4 tokens, all kept, each with the model's next
        assert details == {"accepted_prediction_tokens": 20, "rejected_prediction_tokens": 0}, details


def test_openai_usage_says_how_many_predicted_tokens_were_kept():
    from radixserve.actors.api.openai import Choice, usage
    from radixserve.wire.messages import Delta

    a, b, c = Choice(0), Choice(1), Choice(2)
    a.add(Delta("a", "x", [1], 5, 10, 0, drafts=[12, 9]))
    b.add(Delta("b", "y", [2], 5, 10, 0, drafts=[4, 1]))
    c.add(Delta("c", "z", [3], 5, 10, 0))  # it never drafted
    assert usage([a, b, c], 3)["completion_tokens_details"] == {"accepted_prediction_tokens": 10,
                                                                 "rejected_prediction_tokens": 6}
    assert "completion_tokens_details" not in usage([c], 1)



def test_a_live_server_switches_draft_policies_under_load(tiny_models, workload, reference):
    """POST /policies {"draft": ...} while requests stream in: every answer is still the plain greedy one; a bad
    name is a 400 naming draft; GET /policies and /cache/stats show the policy in charge."""
    import json
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from conftest import post_json
    from radixserve.server_process import ServerProcess

    s = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens", "2000",
                      "--speculative-algorithm", "suffix", "--speculative-num-draft-tokens", "6",
                      "--check-invariants")
    flat = [(q, want) for batch, got in zip(workload, [reference[:4], reference[4:6], reference[6:]])
            for q, want in zip(batch, got)]

    def ask(i: int) -> bool:
        q, want = flat[i % len(flat)]
        out = post_json(s.url + "/generate", {"input_ids": q, "sampling_params": {"max_new_tokens": 24,
                                                                                   "temperature": 0}})
        return out["output_ids"] == want

    try:
        with ThreadPoolExecutor(4) as pool:
            answers = pool.map(ask, range(28))
            for name in ("radix", "ngram", "none", "suffix", "radix"):
                assert post_json(s.url + "/policies", {"draft": name})["draft"]["current"] == name
                time.sleep(0.2)
            assert all(answers)
        req = urllib.request.Request(s.url + "/policies", data=json.dumps({"draft": "nope"}).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(err.value.read())
        assert err.value.code == 400 and body["error"]["param"] == "draft", body
        with urllib.request.urlopen(s.url + "/cache/stats", timeout=30) as resp:
            spec = json.loads(resp.read())["speculative"]
        assert spec["draft_policy"] == "radix" and spec["draft_tokens"] == 6
        time.sleep(0.6)  # the scheduler's status (what /metrics shows) goes out every 0.25 s
        with urllib.request.urlopen(s.url + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        assert 'radixserve_speculative_accepted_tokens{policy="radix"}' in metrics
        assert 'radixserve_speculative_acceptance_rate{policy="suffix"}' in metrics
    finally:
        s.stop()


def test_a_request_whose_drafts_keep_failing_backs_off(tiny_models, workload, reference):
    """Drafts that are always wrong: each rejection doubles the plain steps before the request drafts again (1, 2,
    4, ...), so 23 decode steps verify only a handful of drafts; the tokens stay the plain ones."""
    from radixserve import Engine

    class Wrong:
        name = "wrong"

        def propose(self, rid, tokens, k, cache):
            return [7] * k  # a token the outputs never hold

        def release(self, rid, tokens):
            pass

    p = workload[0][0]
    with Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, decode_kernel="eager",
                speculative_algorithm="ngram", speculative_num_draft_tokens=4) as engine:
        engine.scheduler.spec.gate = None
        engine.scheduler.spec.policy = Wrong()
        out = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 24, "temperature": 0})
        spec = engine.cache_stats()["speculative"]
    assert out["output_ids"] == reference[0]
    assert spec["accepted"] == 0 and spec["drafts"] == 5 and spec["backed_off"] == 1 + 2 + 4 + 8 + 2, spec


def test_the_cost_model_says_what_acceptance_a_draft_needs_per_batch_size():
    from radixserve.actors.scheduler.speculate import CostModel, bucket

    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    m = CostModel(explore=4)
    assert not m.allows(1), "a batch size's first decode step is plain: it is measured"
    m.timed(1, 0.010, 0)  # a plain step: 10 ms a token
    assert m.draft_cost(1) == 0.0, "until drafts are measured too, every request drafts"
    assert m.allows(1)
    m.timed(1, 0.014, 8)  # 8 draft tokens added 4 ms: 0.5 ms each, 5% of a plain token
    assert m.draft_cost(1) == pytest.approx(0.05)
    m.timed(8, 0.016, 0)  # batch 8: 2 ms a token ...
    assert m.draft_cost(8) == pytest.approx(0.0005 * 8 / 0.016), "measuring: batch 1's seconds a draft token"
    m.timed(8, 0.016 + 0.064, 64)  # ... and 1 ms a draft token: a draft token must be kept half the time
    assert m.draft_cost(8) == pytest.approx(0.5) and m.draft_cost(5) == pytest.approx(5 * 0.001 / 0.016)
    assert [m.allows(1) for _ in range(8)] == [True, False, True, True, True, False, True, True], \
        "every 4th decode step plain, to keep the plain figure current"
    assert m.info()["8"]["acceptance_needed"] == pytest.approx(0.5) and set(m.info()) == {"1", "8"}
    m.timed(1, 0.010 + 8 * 0.1, 8)  # one very slow checking step: at most a doubling's worth of a move
    assert m.draft_cost(1) == pytest.approx(0.7 * 0.05 + 0.3 * 0.1)
    rechecks = []
    for m.steps in range(8):
        rechecks.append(m.recheck())
    assert rechecks == [False, False, True, False] * 2, "one step in 4 (explore) rechecks a cost said too dear"


def test_a_draft_is_as_long_as_pays_at_its_acceptance():
    """The draft length that makes the most tokens per second: longer the more often a request's draft tokens are
    kept, none where a kept token is rarer than a draft token is dear."""
    from radixserve.actors.scheduler.speculate import Drafting, draft_length

    assert draft_length(1.0, 0.3, 8) == 8, "every token kept: the longest draft"
    assert draft_length(0.2, 0.3, 8) == 0, "a token kept less often than it costs: no draft"
    # a = 0.9, a draft token 0.3 plain tokens: k = 5 gives (1 + .9 + .81 + .729 + .656 + .59) / 2.5 = 1.87 a step
    assert draft_length(0.9, 0.3, 8) == 5 and draft_length(0.6, 0.3, 8) == 1
    assert draft_length(0.9, 0.0, 8) == 8, "free verification: as long as the policy offers"
    # k = 1 would make (1 + .33) / 1.3 = 1.023 tokens a plain step's time: within the estimates' error, so no draft
    assert draft_length(0.33, 0.3, 8) == 0 and draft_length(0.4, 0.3, 8) == 1
    r = Drafting()
    assert r.acceptance(0.5) == 0.5, "before its first draft: the policy's acceptance"
    r.count(3, True)  # 3 kept, then one refused; one draft's worth of the prior mixed in
    assert r.acceptance(0.5) == pytest.approx((3 + 0.5) / (3 + 1 + 1))
    for _ in range(20):
        r.count(8, False)  # kept whole, again and again: the refusal fades
    assert r.acceptance(0.5) > 0.97


def test_a_draft_not_verified_is_judged_by_the_tokens_that_follow():
    """A request that does not draft still has its policy's draft watched: judged once the tokens that came settle
    it (a wrong token, or every token right), not before; and it drafts again once its watched drafts would pay."""
    from radixserve.actors.scheduler.speculate import Drafting, draft_length
    from radixserve.policies.draft_trees import DraftTree

    r = Drafting()
    for _ in range(3):
        r.count(0, True)  # rejected outright, three times
    assert draft_length(r.acceptance(0.5), 0.3, 8) == 0
    tokens = [1, 2, 3]
    r.watch, r.watch_at = DraftTree([4, 5, 6]), len(tokens)
    assert not r.judge(tokens + [4, 5]), "right so far: it waits for the third token"
    assert r.judge(tokens + [4, 5, 6]) and r.watch is None, "all three right: judged"
    r.watch, r.watch_at = DraftTree([7, 8, 9]), 6
    assert r.judge([1, 2, 3, 4, 5, 6, 7, 0]), "a wrong second token settles it"
    r.watch, r.watch_at = DraftTree([4, 9, 5], parents=[-1, -1, 0]), len(tokens)  # 4 then 5, or 9 alone
    assert not r.judge(tokens + [4]), "on the branch that goes on: it waits"
    assert r.judge(tokens + [9]) and r.watch is None, "the other branch, whole: judged"
    for _ in range(6):
        r.watch, r.watch_at = DraftTree([1, 2, 3, 4]), 0
        r.judge([1, 2, 3, 4])
    assert draft_length(r.acceptance(0.5), 0.3, 8) > 0, "its drafts would now pay: it drafts again"


def at_fixed_cost(model, cost, policy, prompts, max_new, recheck=False):
    """Greedy outputs and speculative statistics with ``policy`` drafting and a cost model where a draft token
    costs ``cost`` plain tokens at every batch size (``recheck``: every step is a recheck step)."""
    from radixserve import Engine
    from radixserve.actors.scheduler.speculate import CostModel

    class Fixed(CostModel):
        def allows(self, batch):
            return True

        def draft_cost(self, batch):
            return cost

        def recheck(self):
            return recheck

        def timed(self, batch, seconds, drafted):
            pass

    with Engine(str(model), dtype="float32", check_invariants=True, decode_kernel="eager",
                speculative_algorithm="ngram") as engine:
        engine.scheduler.spec.gate = Fixed()
        engine.scheduler.spec.policy = policy
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new, "temperature": 0})
        return outs, engine.cache_stats()["speculative"]


def test_a_request_whose_drafts_do_not_pay_stops_drafting_and_another_goes_on(tiny_models, workload, reference):
    """A cost model where a draft token costs 0.9 plain tokens: a request whose drafts are right keeps drafting;
    one whose drafts keep 1 token of 8 (not rejected outright, so this is not the back-off) drafts once, then
    decodes plainly, its drafts only watched. The tokens are the plain ones."""
    good, poor = workload[0][0], workload[0][1]
    truth = {tuple(good): reference[0], tuple(poor): reference[1]}

    class Policy:
        name = "fixed"

        def propose(self, rid, tokens, k, cache):
            for prompt, out in truth.items():
                if tuple(tokens[: len(prompt)]) == prompt:
                    done = len(tokens) - len(prompt)
                    draft = out[done : done + k]
                    return draft if prompt == tuple(good) else draft[:1] + [7] * (len(draft) - 1)
            return []

        def release(self, rid, tokens):
            pass

    outs, spec = at_fixed_cost(tiny_models["llama"], 0.9, Policy(), [good, poor], 24)
    assert [o["output_ids"] for o in outs] == reference[:2]
    assert outs[1]["meta_info"]["completion_tokens_details"] == {"accepted_prediction_tokens": 1,
                                                                  "rejected_prediction_tokens": 7}
    assert outs[0]["meta_info"]["completion_tokens_details"]["rejected_prediction_tokens"] == 0
    assert spec["not_worth"] > 0 and spec["watched"] > 0 and spec["backed_off"] == 0, spec


def test_where_a_draft_token_costs_a_plain_token_the_policy_is_not_asked(tiny_models, workload, reference):
    """At a batch size where verifying a draft token costs as much as a plain step's token (large batches on a
    CPU), no acceptance could pay: the step is plain and the policy is not even asked (its work would be waste),
    but on the cost model's recheck steps (one in 32: one-token drafts, to measure the cost again)."""
    class Counted:
        name = "counted"
        asked = 0

        def propose(self, rid, tokens, k, cache):
            Counted.asked += 1
            assert k == 1, "a recheck drafts one token"
            return [7] * k

        def release(self, rid, tokens):
            pass

    outs, spec = at_fixed_cost(tiny_models["llama"], 1.0, Counted(), workload[0][:2], 12)
    assert [o["output_ids"] for o in outs] == [r[:12] for r in reference[:2]]
    assert Counted.asked == 0 and spec["drafts"] == 0 and spec["not_worth"] == 0, spec
    outs, spec = at_fixed_cost(tiny_models["llama"], 1.0, Counted(), workload[0][:2], 24, recheck=True)
    assert [o["output_ids"] for o in outs] == reference[:2]
    # each request's one-token draft is verified once and refused; after that its drafts are only watched
    assert spec["drafts"] == 2 and spec["drafted"] == 2 and spec["watched"] > 0, spec


def test_open_chat_on_a_random_model_is_not_slowed_by_drafts_that_never_pay(tiny_models):
    """Random prompts, a policy that always drafts (and is always wrong): the back-off and the gate leave at most
    a few verifying steps per request."""
    from radixserve import Engine

    class Wrong:
        name = "wrong"

        def propose(self, rid, tokens, k, cache):
            return [7] * k

        def release(self, rid, tokens):
            pass

    rng = random.Random(5)
    batch = [[rng.randrange(100, 5000) for _ in range(40)] for _ in range(4)]
    with Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, decode_kernel="eager",
                speculative_algorithm="ngram") as engine:
        engine.scheduler.spec.policy = Wrong()
        engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 64, "temperature": 0})
        spec = engine.cache_stats()["speculative"]
    assert spec["steps"] <= 20 and spec["accepted"] == 0, spec


@pytest.mark.parametrize("kernel", ["eager", "auto"])
def test_a_draft_model_drafts_and_the_tokens_stay_the_plain_ones(tiny_models, workload, reference, kernel):
    """STANDALONE: the served model itself as its own draft model agrees with itself (almost every draft token is
    kept); a different random model of the same vocabulary mostly disagrees. Either way the tokens are the plain
    greedy ones, and a request's draft-model cache follows its kept tokens (rejected ones are cropped)."""
    same, same_stats = run(tiny_models["llama"], workload, decode_kernel=kernel, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=str(tiny_models["llama"]), speculative_num_draft_tokens=4)
    other, other_stats = run(tiny_models["llama"], workload, decode_kernel=kernel,
                             speculative_algorithm="standalone",
                             speculative_draft_model_path=str(tiny_models["qwen2"]))
    assert same == reference and other == reference
    s, o = same_stats["speculative"], other_stats["speculative"]
    assert s["draft_policy"] == "draft-model" and s["acceptance_rate"] > 0.9, s
    assert s["drafts"] >= 2 * len(reference), "a request drafts again after its first draft (its cache cropped)"
    assert o["drafts"] >= 2 * len(reference) and o["acceptance_rate"] < s["acceptance_rate"], o  # after rejections
    assert same_stats["totals"]["steps"] < same_stats["totals"]["generated_tokens"] / 2


def test_a_draft_model_server_switches_policies_and_back(tiny_models, workload, reference):
    """Live switches to and from the draft model keep the plain tokens; without a draft model path, switching to
    it is refused by name."""
    from radixserve import Engine

    flat = [q for batch in workload for q in batch]
    kw = dict(dtype="float32", check_invariants=True, decode_kernel="eager")
    with Engine(str(tiny_models["llama"]), speculative_algorithm="ngram",
                speculative_draft_model_path=str(tiny_models["llama"]), **kw) as engine:
        engine.scheduler.spec.gate = None
        ids = []
        for i, name in enumerate(["draft-model", "suffix", "draft-model"]):
            engine.set_policies(draft=name)
            ids += [r["output_ids"] for r in engine.generate(
                input_ids=workload[i], sampling_params={"max_new_tokens": 24, "temperature": 0})]
        assert engine.cache_stats()["speculative"]["draft_policy"] == "draft-model"
    assert ids == reference and len(flat) == len(ids)
    with Engine(str(tiny_models["llama"]), speculative_algorithm="ngram", **kw) as engine:
        with pytest.raises(ValueError, match="speculative-draft-model-path"):
            engine.set_policies(draft="draft-model")


@pytest.mark.parametrize("flags, message", [
    ({"speculative_algorithm": "STANDALONE"}, "give its checkpoint folder as --speculative-draft-model-path"),
    ({"speculative_draft_model_path": "/tmp"}, "add --speculative-algorithm STANDALONE"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/nonexistent"}, "no config.json"),
    ({"speculative_algorithm": "EAGLE3"}, "draft heads is not built yet"),
    ({"speculative_num_draft_tokens": 0, "speculative_algorithm": "ngram"}, "must be in 1..64"),
])
def test_speculative_flags_are_checked_at_start(flags, message):
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="x", **flags)
