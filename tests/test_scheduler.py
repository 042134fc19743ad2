"""Scheduler core with a fake runner that keeps *token ids* in its KV pool.

The fake model's next token is a hash of the whole sequence it reads back from the pool through the plan's
slots, so any slot the scheduler gets wrong (a stale, freed, or overwritten slot) changes the output."""
from __future__ import annotations

import random

import numpy as np
import pytest
from radixserve.actors.scheduler import FinishReason, Scheduler, SchedulerConfig
from radixserve.cache import CacheManager
from radixserve.model.slot_table import SlotTable
from radixserve.policies.eviction import LRU
from radixserve.policies.schedule import FCFS, LongestOutputFirst, LongestPrefixMatch
from radixserve.wire.plans import ForwardPlan, ForwardResult

from radixserve.sampling_params import SamplingParams

VOCAB = 50
EOS = 0


def next_token(seq: list[int]) -> int:
    h = 1469598103
    for t in seq:
        h = (h * 1099511 + t + 7) % 2_147_483_647
    return 1 + h % (VOCAB - 1)  # never EOS: lengths are driven by max_new_tokens


class TokenPoolRunner:
    def __init__(self, capacity: int) -> None:
        self.pool = np.full(capacity + 1, -1, dtype=np.int64)
        self.table = SlotTable()  # the rows of slot indices, kept from plan to plan as the real runner keeps them

    def forward(self, plan: ForwardPlan) -> ForwardResult:
        ids, pre, ext = plan.input_ids, plan.prefix_lens, plan.extend_lens
        slots, sample = self.table.apply(plan), plan.sample
        out, t, s = [], 0, 0
        for i in range(len(pre)):
            row = slots[s : s + pre[i] + ext[i]]
            self.pool[row[pre[i]:]] = ids[t : t + ext[i]]  # write the new tokens' "KV"
            seq = self.pool[row].tolist()  # read the whole sequence back through the slots
            assert -1 not in seq, "read a slot that was never written"
            out.append(next_token(seq) if sample[i] else -1)
            t += ext[i]
            s += pre[i] + ext[i]
        return ForwardResult(plan.step, [t for t, s in zip(out, sample) if s])


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def make(capacity=512, chunk=16, max_running=8, policy=None, disable=False):
    cfg = SchedulerConfig(context_length=4096, vocab_size=VOCAB, eos_ids=frozenset({EOS}),
                          max_running_requests=max_running, chunked_prefill_size=chunk, check_invariants=True)
    sched = Scheduler(cfg, CacheManager(capacity, LRU(), disable_radix_cache=disable), policy or FCFS())
    return sched, TokenPoolRunner(capacity)


def run_all(sched, runner, max_steps=100_000):
    steps = 0
    while sched.has_work:
        plan = sched.schedule()
        assert plan is not None, "work left but nothing scheduled (deadlock)"
        sched.process(runner.forward(plan))
        steps += 1
        assert steps < max_steps
    sched.check()
    return steps


def workload(rng: random.Random, n: int, shared: int):
    system = [rng.randrange(1, VOCAB) for _ in range(shared)]
    out = []
    for i in range(n):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        out.append((f"r{i}", (system if i % 3 else []) + tail, rng.randrange(1, 40)))
    return out


@pytest.mark.parametrize("chunk", [0, 7, 64])
@pytest.mark.parametrize("capacity", [120, 2000])
@pytest.mark.parametrize("disable", [False, True])
def test_outputs_exact_under_chunking_eviction_and_retraction(chunk, capacity, disable):
    rng = random.Random(chunk * 31 + capacity)
    sched, runner = make(capacity=capacity, chunk=chunk, disable=disable)
    reqs = [sched.add_request(rid, p, SamplingParams(max_new_tokens=m, temperature=0)) for rid, p, m in
            workload(rng, 24, shared=40)]
    run_all(sched, runner)
    for req in reqs:
        assert req.output_ids == reference(req.prompt_ids, req.max_new_tokens), req.rid
        assert req.finish_reason == FinishReason("length")
    cache = sched.cache
    assert cache.owned_by_requests == 0 and cache.protected == 0
    if capacity == 120:  # the pool is far too small for the batch: both mechanisms must have run
        assert sched.stats.retractions > 0
        assert disable or cache.evicted_tokens > 0
    if not disable and capacity == 2000:
        assert sched.stats.cached_tokens > 0, "the shared system prompt was never reused"


def test_second_pass_reuses_cache_and_reports_cached_tokens():
    sched, runner = make(capacity=4000)
    prompt = list(range(1, 41))
    first = sched.add_request("a", prompt, SamplingParams(max_new_tokens=5, temperature=0))
    run_all(sched, runner)
    assert first.cached_tokens == 0
    # next chat turn: previous prompt + answer + new user tokens
    turn2 = prompt + first.output_ids + [3, 4, 5]
    second = sched.add_request("b", turn2, SamplingParams(max_new_tokens=5, temperature=0))
    run_all(sched, runner)
    assert second.cached_tokens == len(prompt) + len(first.output_ids) - 1  # the last answer token had no KV
    assert second.output_ids == reference(turn2, 5)


def test_finish_mid_generation_releases_everything():
    sched, runner = make(capacity=300)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=50))
    b = sched.add_request("b", [1, 2, 4], SamplingParams(max_new_tokens=50))
    for _ in range(5):
        sched.process(runner.forward(sched.schedule()))
    assert sched.finish("a", FinishReason("abort", message="client went away")) is not None
    sched.check()
    assert sched.finish("nope", FinishReason("abort")) is None
    run_all(sched, runner)
    assert b.output_ids == reference([1, 2, 4], 50)
    assert sched.cache.protected == 0 and sched.cache.owned_by_requests == 0


def test_lpm_admits_longest_cached_prefix_first():
    sched, runner = make(capacity=4000, max_running=1, policy=LongestPrefixMatch())
    warm = list(range(1, 30))
    sched.add_request("warm", warm, SamplingParams(max_new_tokens=1))
    run_all(sched, runner)
    sched.add_request("cold", [40, 41, 42], SamplingParams(max_new_tokens=1))
    sched.add_request("hot", warm[:20] + [45], SamplingParams(max_new_tokens=1))
    plan = sched.schedule()
    assert plan.prefix_lens.tolist() == [20], "the request with the cached prefix goes first"


def test_validation_errors_are_clear():
    sched, _ = make(capacity=100)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sched.add_request("x", [1, VOCAB], SamplingParams())
    with pytest.raises(ValueError, match=r"the prompt has 150 tokens; the KV pool holds only 100"):
        sched.add_request("x", [1] * 150, SamplingParams())
    with pytest.raises(ValueError, match=r"lower max_new_tokens to at most 90"):
        sched.add_request("x", [1] * 10, SamplingParams(max_new_tokens=95))
    assert sched.add_request("x", [1] * 10, SamplingParams()).max_new_tokens == 90  # default clipped to the room
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("x", [1], SamplingParams())
    assert not sched.waiting[1:], "failed requests were not queued"


def test_a_decode_plan_carries_one_slot_per_request_whatever_the_context():
    """The runner keeps each request's row of slot indices: a decode step sends one new slot per request, not the
    whole rows (so the plan's size and the scheduler's work per step grow with the batch, not the context)."""
    sched, runner = make(capacity=4000, chunk=64)
    for i in range(4):
        sched.add_request(f"long{i}", [1 + (i * 13 + j) % (VOCAB - 1) for j in range(300)],
                          SamplingParams(max_new_tokens=6, temperature=0))
    sizes = []
    while sched.has_work:
        plan = sched.schedule()
        if plan.mode == "decode":
            sizes.append((plan.batch_size, len(plan.new_slots)))
        sched.process(runner.forward(plan))
    assert sizes and all(n == b for b, n in sizes), sizes


def test_a_row_the_cache_rewrites_is_sent_again():
    """Two requests compute the same prefix in one step; the second one's row then points at the first one's
    slots (its own duplicates are freed): the runner must hear about the rewrite, or it would read freed slots.
    TokenPoolRunner reads every token back through the rows it keeps, so a stale row changes the output. (A
    policy that does not defer the second one: FCFS would let the first compute the prefix alone.)"""
    sched, runner = make(capacity=400, chunk=0, policy=LongestOutputFirst())
    prompt = [1 + j % (VOCAB - 2) for j in range(59)]
    a = sched.add_request("a", prompt + [VOCAB - 1], SamplingParams(max_new_tokens=8, temperature=0))
    b = sched.add_request("b", prompt + [VOCAB - 2], SamplingParams(max_new_tokens=8, temperature=0))
    resent = 0
    while sched.has_work:
        plan = sched.schedule()
        if plan.mode == "decode":  # more than one new slot for a request: part of its row was sent again
            resent += len(plan.new_slots) - plan.batch_size
        sched.process(runner.forward(plan))
    sched.check()
    assert resent >= len(prompt) - 1, "the rewritten row was not sent again"
    assert a.output_ids == reference(a.prompt_ids, 8) and b.output_ids == reference(b.prompt_ids, 8)
