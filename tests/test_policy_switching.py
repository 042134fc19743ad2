"""Policies in the scheduler: live switching, epochs, the lpm-aging bound, in-batch dedup, broken policies."""
from __future__ import annotations

import itertools
import random

from radixserve.actors.scheduler import Scheduler, SchedulerConfig
from radixserve.cache import CacheManager
from radixserve.policies import available, load_eviction_policy, load_schedule_policy
from radixserve.sampling_params import SamplingParams

from test_cache_tree import FakeClock
from test_scheduler import EOS, VOCAB, TokenPoolRunner, reference, run_all, workload

GREEDY = dict(temperature=0)


def make(capacity, schedule="fcfs", eviction="lru", clock=None, chunk=16, max_running=8):
    clock = clock or FakeClock()
    cfg = SchedulerConfig(context_length=4096, vocab_size=VOCAB, eos_ids=frozenset({EOS}),
                          max_running_requests=max_running, chunked_prefill_size=chunk, check_invariants=True)
    cache = CacheManager(capacity, load_eviction_policy(eviction), clock=clock)
    return Scheduler(cfg, cache, load_schedule_policy(schedule), clock=clock), TokenPoolRunner(capacity)


def test_switching_every_few_steps_keeps_outputs_and_accounting_exact():
    rng = random.Random(5)
    sched, runner = make(capacity=160)
    reqs = [sched.add_request(rid, p, SamplingParams(max_new_tokens=m, **GREEDY)) for rid, p, m in
            workload(rng, 30, shared=40)]
    combos = list(itertools.product(available("eviction"), available("schedule")))
    step = 0
    while sched.has_work:
        if step % 3 == 0:
            ev, sc = combos[(step // 3) % len(combos)]
            sched.policies.set(load_eviction_policy(ev), load_schedule_policy(sc))
        sched.process(runner.forward(sched.schedule()))  # check_invariants: accounting after every step
        step += 1
    for req in reqs:
        assert req.output_ids == reference(req.prompt_ids, req.max_new_tokens)
    assert len(sched.policies.epochs) > 20 and sched.stats.retractions + sched.cache.evicted_tokens > 0
    assert sum(e.requests for e in sched.policies.epochs) == 30
    stats = sched.policies.cache_stats()
    assert stats["pool"]["capacity"] == 160 and len(stats["epochs"]) == len(sched.policies.epochs)
    assert list(sched.policies.errors) == []


def starved_wait(schedule: str) -> float:
    """One request matching nothing arrives first; a matching request arrives every step until t=300."""
    clock = FakeClock()
    sched, runner = make(capacity=4000, schedule=schedule, clock=clock, max_running=1)
    if schedule == "lpm-aging":
        sched.policy.max_wait_s = 40
    hot = list(range(1, 40))
    sched.add_request("warm", hot, SamplingParams(max_new_tokens=1))
    run_all(sched, runner)
    lonely = sched.add_request("lonely", [45, 46, 47], SamplingParams(max_new_tokens=1))
    n = 0
    while sched.has_work or clock.t < 300:
        if clock.t < 300:
            n += 1
            sched.add_request(f"hot{n}", hot + [n % 40 + 1], SamplingParams(max_new_tokens=2))
        plan = sched.schedule()
        if plan is not None:
            sched.process(runner.forward(plan))
    return lonely.first_token_at - lonely.arrival


def test_lpm_aging_bounds_the_wait_that_lpm_starves():
    assert starved_wait("lpm") > 250  # served only once the matching stream stops
    assert starved_wait("lpm-aging") < 60  # max_wait_s 40 plus a few steps


def test_cache_aware_policies_compute_a_shared_new_prefix_once():
    shared = [i % 45 + 1 for i in range(64)]
    for schedule, expect_deferred in (("lpm", True), ("fcfs", True), ("lof", False)):
        sched, runner = make(capacity=4000, schedule=schedule, chunk=4096)
        reqs = [sched.add_request(f"r{i}", shared + [i + 1, i + 2], SamplingParams(max_new_tokens=2))
                for i in range(4)]
        first = sched.schedule()
        admitted = len(first.prefix_lens)
        sched.process(runner.forward(first))
        run_all(sched, runner)
        cached = sorted(r.cached_tokens for r in reqs)
        if expect_deferred:
            assert admitted == 1 and cached == [0, 64, 64, 64]
        else:
            assert admitted == 4 and cached == [0, 0, 0, 0]
        assert all(r.output_ids == reference(r.prompt_ids, 2) for r in reqs)


class RaisingOrder:
    name, cache_aware = "raising-order", False

    def order(self, waiting, cache, now):
        raise RuntimeError("boom")


class DroppingOrder:
    name, cache_aware = "dropping-order", False

    def order(self, waiting, cache, now):
        return waiting[1:]


class KeyFailsLater:
    """Works for a while, then raises: the failure lands in the middle of tree operations."""

    name = "fails-later"

    def __init__(self):
        self.calls = 0

    def key(self, node, now):
        self.calls += 1
        if self.calls > 40:
            raise ZeroDivisionError("bad key")
        return node.last_access


class MixedKeys:
    name = "mixed-keys"

    def key(self, node, now):
        return "x" if node.num_tokens % 2 else 1.0


def test_broken_policies_fall_back_and_lose_nothing():
    rng = random.Random(9)
    for bad_schedule, bad_eviction in ((RaisingOrder(), KeyFailsLater()), (DroppingOrder(), MixedKeys())):
        sched, runner = make(capacity=150, schedule="lpm", eviction="gdsf")
        reqs = [sched.add_request(rid, p, SamplingParams(max_new_tokens=m, **GREEDY)) for rid, p, m in
                workload(rng, 20, shared=30)]
        sched.process(runner.forward(sched.schedule()))
        sched.policies.set(bad_eviction, bad_schedule)
        run_all(sched, runner)
        assert all(r.output_ids == reference(r.prompt_ids, r.max_new_tokens) for r in reqs)
        assert sched.policy.name == "lpm", "back on the policy it replaced"
        assert sched.cache.eviction_policy.name in ("gdsf", "lru")
        errors = list(sched.policies.errors) + sched.cache.tree.policy_errors
        assert any(bad_schedule.name in e for e in errors) and any(bad_eviction.name in e for e in errors)
