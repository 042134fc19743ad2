"""Overlap: the next decode step planned while one computes (Scheduler.schedule_ahead), its input tokens filled in
by the runner from the step before (ForwardPlan.filled). Driven as the scheduler actor drives it, with
test_scheduler's fake runner, whose next token is a hash of the whole sequence read back through the plan's slots:
a slot the two steps in flight get wrong changes the output. The scheduler checks its invariants after every step.
"""
from __future__ import annotations

import random
from collections import deque

import pytest
from radixserve.actors.scheduler import FinishReason, Scheduler, SchedulerConfig
from radixserve.cache import CacheManager
from radixserve.policies.eviction import LRU
from radixserve.policies.schedule import FCFS
from radixserve.sampling_params import SamplingParams
from radixserve.wire.plans import ForwardPlan, ForwardResult
from test_scheduler import EOS, VOCAB, TokenPoolRunner, reference, workload


class FollowingRunner(TokenPoolRunner):
    """The fake runner as the real one runs a plan: its input tokens filled in from the step before, a failed
    step (``fail_at``) leaving none to fill in from."""

    def __init__(self, capacity: int, fail_at: int | None = None) -> None:
        super().__init__(capacity)
        self.sampled = None
        self.fail_at = fail_at

    def forward(self, plan: ForwardPlan) -> ForwardResult:
        try:
            if plan.step == self.fail_at:
                raise RuntimeError("the step broke")
            result = super().forward(plan.filled(self.sampled))
        except RuntimeError as exc:
            result = ForwardResult(plan.step, error=str(exc))
        self.sampled = (plan.step, result.next_ids) if result.error is None else None
        return result


def make(capacity=2000, chunk=16, overlap=True):
    cfg = SchedulerConfig(context_length=4096, vocab_size=VOCAB, eos_ids=frozenset({EOS}), max_running_requests=8,
                          chunked_prefill_size=chunk, overlap=overlap, check_invariants=True)
    return Scheduler(cfg, CacheManager(capacity, LRU()), FCFS())


def drive(sched, runner, between=None, max_steps=100_000):
    """The scheduler actor's loop: a plan, the one ahead of it, and on each result the next one ahead (or, with
    nothing in flight, a fresh plan). ``between(step)`` runs after each result is taken in and the next plans
    sent (an abort, ...).
    Returns how many plans the runner computed."""
    pending: deque[ForwardPlan] = deque()

    def launch():
        plan = sched.schedule() if sched.has_work else None
        if plan is not None:
            pending.append(plan)
            ahead()

    def ahead():
        if (plan := sched.schedule_ahead()) is not None:
            pending.append(plan)

    launch()
    steps = 0
    while pending:
        plan = pending.popleft()
        sched.process(runner.forward(plan))
        if sched.inflight_step is not None:
            ahead()
        elif not pending:
            launch()
        if between is not None:
            between(plan.step)
        steps += 1
        assert steps < max_steps
    assert not sched.has_work
    sched.check()
    return steps


def clean(sched):
    assert not sched.live and sched.cache.owned_by_requests == 0 and sched.cache.protected == 0
    assert sched.inflight_step is None and sched.ahead_step is None


@pytest.mark.parametrize("capacity", [120, 2000])
@pytest.mark.parametrize("chunk", [0, 7])
def test_outputs_exact_with_steps_planned_ahead(capacity, chunk):
    rng = random.Random(capacity + chunk)
    sched = make(capacity=capacity, chunk=chunk)
    reqs = [sched.add_request(rid, p, SamplingParams(max_new_tokens=m, temperature=0))
            for rid, p, m in workload(rng, 24, shared=40)]
    drive(sched, FollowingRunner(capacity))
    for req in reqs:
        assert req.output_ids == reference(req.prompt_ids, req.max_new_tokens), req.rid
        assert req.finish_reason == FinishReason("length")
    assert sched.stats.ahead_steps > 0
    if capacity == 120:  # too small for the batch: retraction ran between the steps planned ahead
        assert sched.stats.retractions > 0
    clean(sched)


def test_overlap_off_plans_nothing_ahead():
    sched = make(overlap=False)
    req = sched.add_request("a", [3, 4, 5], SamplingParams(max_new_tokens=20, temperature=0))
    drive(sched, FollowingRunner(2000))
    assert req.output_ids == reference([3, 4, 5], 20) and sched.stats.ahead_steps == 0


def first_stop(prompt: list[int], n: int) -> tuple[int, list[int]]:
    """A token the reference output reaches halfway, and the output up to and with its first appearance."""
    out = reference(prompt, n)
    stop = out[n // 2]
    return stop, out[: out.index(stop) + 1]


def test_a_stop_token_ends_a_request_whose_next_step_was_planned():
    """The step after the one that samples the stop token is already computing: it computes a token nobody takes,
    and its slot goes back; the others in the batch go on, exact."""
    rng = random.Random(5)
    sched = make()
    expected = {}
    for i in range(6):
        prompt = [rng.randrange(1, VOCAB) for _ in range(12)]
        if i % 2:
            stop, out = first_stop(prompt, 30)
            sched.add_request(f"s{i}", prompt, SamplingParams(max_new_tokens=30, temperature=0,
                                                              stop_token_ids=[stop]))
        else:
            out = reference(prompt, 30)
            sched.add_request(f"s{i}", prompt, SamplingParams(max_new_tokens=30, temperature=0))
        expected[f"s{i}"] = out
    reqs = dict(sched.live)
    drive(sched, FollowingRunner(2000))
    for rid, req in reqs.items():
        assert req.output_ids == expected[rid], rid
    assert {reqs[r].finish_reason.type for r in reqs} == {"stop", "length"}
    assert sched.stats.ahead_steps > 0
    clean(sched)


def test_an_abort_between_the_two_steps_in_flight():
    """A request ended from outside (a stop string, the client gone) while two of its steps are in flight: both
    steps' slots go back; the rest go on, exact, and the pool ends clean."""
    sched = make()
    prompts = {f"a{i}": [i + 1, 2 * i + 3, 7] for i in range(4)}
    reqs = {rid: sched.add_request(rid, p, SamplingParams(max_new_tokens=25, temperature=0))
            for rid, p in prompts.items()}
    seen = []

    def between(step):
        if len(reqs["a1"].output_ids) == 6 and not reqs["a1"].finished:
            assert sched.ahead_step is not None, "two of a1's steps should be in flight"
            seen.append(step)
            sched.finish("a1", FinishReason("abort"))

    drive(sched, FollowingRunner(2000), between)
    assert reqs["a1"].output_ids == reference(prompts["a1"], 6)
    for rid in ("a0", "a2", "a3"):
        assert reqs[rid].output_ids == reference(prompts[rid], 25), rid
    assert seen
    clean(sched)


def test_a_failed_step_fails_the_step_planned_after_it():
    """The runner's step breaks while the next one is already planned: that one has no tokens to take and breaks
    too; every request in them fails alone, their slots go back, and the next requests run exact."""
    sched = make()
    runner = FollowingRunner(2000)
    reqs = [sched.add_request(f"f{i}", [i + 2, 9, 4], SamplingParams(max_new_tokens=20, temperature=0))
            for i in range(3)]
    runner.fail_at = 5  # a decode step: the prefill was step 1
    drive(sched, runner)
    assert all(r.finish_reason.type == "abort" for r in reqs)
    assert len(sched.take_failures()) == 3
    clean(sched)
    runner.fail_at = None
    after = sched.add_request("g", [5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0))
    drive(sched, runner)
    assert after.output_ids == reference([5, 6, 7], 12)
    clean(sched)


def test_seeded_sampling_counts_the_token_in_flight():
    """A step planned ahead samples each request's next output position (its output a token longer than the
    scheduler knows when it plans)."""
    sched = make()
    req = sched.add_request("s", [1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0))
    indices = []
    runner = FollowingRunner(2000)
    forward = runner.forward

    def spy(plan):
        if plan.mode == "decode":
            indices.append((plan.follows is not None, int(plan.sampling.output_index[0])))
        return forward(plan)

    runner.forward = spy
    drive(sched, runner)
    assert req.output_ids == reference([1, 2, 3], 10)
    assert [i for _, i in indices] == list(range(1, 10))  # one decode step per output index after the first
    assert any(ahead for ahead, _ in indices)


def test_no_step_ahead_while_requests_wait():
    """A request waiting to be admitted gets the next plan: nothing is planned ahead of it."""
    sched = make()
    a = sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=30, temperature=0))
    added = []

    def between(step):
        if step == 4 and not added:
            added.append(sched.add_request("b", [4, 5, 6], SamplingParams(max_new_tokens=5, temperature=0)))
        elif added and not added[0].output_ids:
            assert sched.ahead_step is None, "a step was planned ahead of a waiting request"

    drive(sched, FollowingRunner(2000), between)
    assert a.output_ids == reference([1, 2, 3], 30)
    assert added[0].output_ids == reference([4, 5, 6], 5)
    clean(sched)


def greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_a_server_plans_ahead_and_answers_as_hf(tiny_models, hf_models, tiny_server, smollm2_path):
    """Concurrent greedy requests of different lengths, one ended by a stop token and one by a stop string (the
    tokenizer's FinishReq reaching the scheduler while steps are in flight), on the tiny fp32 Llama with overlap (the
    default) and with --disable-overlap-schedule: the tokens HF's greedy decoding gives, a seeded sampled request
    the same tokens on both, and /cache/stats counts the steps planned ahead."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from radixserve.server_process import ServerProcess
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["The capital of France", "Once upon a time", "Bees make honey by", "1, 2, 3,", "Hello"]
    prompts = [tok(t).input_ids for t in texts]
    lengths = [24, 9, 17, 30, 12]
    expected = [greedy(hf_models["llama"], p, n) for p, n in zip(prompts, lengths)]
    stop = expected[3][11]  # request 3 ends at the first appearance of its 12th token
    bodies = [{"input_ids": p, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
              for p, n in zip(prompts, lengths)]
    bodies[3]["sampling_params"]["stop_token_ids"] = [stop]
    expected[3] = expected[3][: expected[3].index(stop) + 1]
    stop_text = tok.decode(expected[1][4:6])  # request 1 ends at a stop string (its text cut there)
    bodies[1]["sampling_params"]["stop"] = [stop_text]
    # a seeded sampled request: its noise follows its seed and output position, whatever step computes it
    bodies.append({"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 20, "temperature": 1.5,
                                                                "seed": 7, "ignore_eos": True}})

    def ask(url):
        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(lambda b: httpx.post(url + "/generate", json=b, timeout=120).json(), bodies))

    off = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                        "1200", "--check-invariants", "--disable-overlap-schedule")
    try:
        seeded = []
        for url, planned_ahead in ((tiny_server.url, True), (off.url, False)):
            before = httpx.get(url + "/cache/stats").json()["totals"]["ahead_steps"]
            got = ask(url)
            seeded.append(got[-1]["output_ids"])
            for i in (0, 2, 3, 4):
                assert got[i]["output_ids"] == expected[i], (url, i)
            assert stop_text not in got[1]["text"] and got[1]["meta_info"]["finish_reason"]["type"] == "stop"
            assert tok.decode(expected[1]).startswith(got[1]["text"])
            ahead = httpx.get(url + "/cache/stats").json()["totals"]["ahead_steps"] - before
            assert (ahead > 0) == planned_ahead, ahead
            assert httpx.get(url + "/cache/stats").json()["pool"]["owned_by_requests"] == 0
        assert seeded[0] == seeded[1] and len(seeded[0]) == 20
    finally:
        off.stop()


def test_a_step_that_cannot_be_planned_ahead_is_planned_from_the_result(monkeypatch):
    """A bug in planning a step ahead: the slots it took go back and the step is planned as without overlap."""
    import radixserve.actors.scheduler.scheduler as core

    build = core.build_plan

    def broken(*args, follows=None, **kwargs):
        if follows is not None:
            raise ValueError("a bug")
        return build(*args, **kwargs)

    monkeypatch.setattr(core, "build_plan", broken)
    sched = make()
    req = sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=15, temperature=0))
    drive(sched, FollowingRunner(2000))
    assert req.output_ids == reference([1, 2, 3], 15) and sched.stats.ahead_steps == 0
    clean(sched)
