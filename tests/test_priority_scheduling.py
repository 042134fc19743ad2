"""Priority scheduling with SGLang's semantics, through the real scheduler and the token-pool fake runner: exact
outputs and invariants (pool accounting, tree, table rows) after every step; SGLang's flags on the command line."""
from __future__ import annotations

import random

import pytest

from radixserve.actors.scheduler import Scheduler, SchedulerConfig
from radixserve.actors.scheduler.priority import LOWEST, PriorityConfig
from radixserve.cache import CacheManager
from radixserve.cli_args import from_cli, server_parser
from radixserve.policies import load_schedule_policy
from radixserve.policies.eviction import LRU
from radixserve.sampling_params import SamplingParams

from test_scheduler import EOS, VOCAB, TokenPoolRunner, reference

ON = PriorityConfig(enabled=True)


def make(priority: PriorityConfig = ON, capacity: int = 2000, max_running: int = 1, chunk: int = 16,
         policy: str = "fcfs"):
    cfg = SchedulerConfig(context_length=4096, vocab_size=VOCAB, eos_ids=frozenset({EOS}),
                          max_running_requests=max_running, chunked_prefill_size=chunk, priority=priority,
                          check_invariants=True)  # checked after every step by process()
    return Scheduler(cfg, CacheManager(capacity, LRU()), load_schedule_policy(policy)), TokenPoolRunner(capacity)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def prompt(n: int, seed: int) -> list[int]:
    return [(i * (seed + 2) + seed) % 49 + 1 for i in range(n)]


def step(sched, runner, finished: list[str]) -> None:
    for req in sched.process(runner.forward(sched.schedule())):
        if req.finished:
            finished.append(req.rid)


def drain(sched, runner, finished: list[str]) -> None:
    while sched.has_work:
        step(sched, runner, finished)
    sched.check()


def exact(reqs) -> bool:
    return all(r.output_ids == reference(r.prompt_ids, r.max_new_tokens) for r in reqs)


def sglang_scenario(priority: PriorityConfig, values: tuple[int, int, int] = (0, 10, 20), after_arrival=None,
                    policy: str = "fcfs"):
    """SGLang's test_priority_scheduling_preemption_meeting_threshold_validation: one running place; the first
    request runs, then the other two arrive. Returns the finish order (by priority), the scheduler and the three
    requests; ``after_arrival(sched, first)`` runs after the step the two arrived for."""
    sched, runner = make(priority, policy=policy)
    finished: list[str] = []
    first = sched.add_request(str(values[0]), prompt(20, 0), greedy(60), priority=values[0])
    for _ in range(5):
        step(sched, runner, finished)
    rest = [sched.add_request(str(v), prompt(20, i + 1), greedy(20), priority=v) for i, v in enumerate(values[1:])]
    step(sched, runner, finished)
    if after_arrival is not None:
        after_arrival(sched, first)
    drain(sched, runner, finished)
    return finished, sched, [first, *rest]


def test_sglangs_scenario_finishes_20_10_0_and_the_preempted_request_resumes_exactly():
    def preempted(sched, zero):
        assert zero in sched.waiting and zero.kv is None and zero.output_ids, "20 took its place at once"
        assert sched.cache.match_len(zero.fill_key) == zero.seq_len - 1, "its KV stays in the tree"

    finished, sched, (zero, ten, twenty) = sglang_scenario(ON, after_arrival=preempted)
    assert finished == ["20", "10", "0"]
    assert zero.preemptions == 1 and sched.stats.preemptions == 1, "20 outranks 0 by more than 10; 10 does not"
    assert exact([zero, ten, twenty]), "the preempted request's tokens are those it makes alone"


def test_without_priority_scheduling_the_order_is_the_policys():
    finished, sched, _ = sglang_scenario(PriorityConfig())
    assert finished == ["0", "10", "20"] and sched.stats.preemptions == 0
    finished, sched, _ = sglang_scenario(PriorityConfig(), policy="priority")
    assert finished == ["0", "20", "10"] and sched.stats.preemptions == 0, "what issue 27 saw before"


def test_a_priority_at_or_below_the_threshold_waits():
    finished, sched, _ = sglang_scenario(ON, (0, 5, 10))
    assert finished == ["0", "10", "5"] and sched.stats.preemptions == 0, "10 - 0 is not more than 10"
    finished, _, _ = sglang_scenario(PriorityConfig(enabled=True, preemption_threshold=4), (0, 5, 10))
    assert finished == ["10", "5", "0"]


def test_disable_priority_preemption_orders_but_never_preempts():
    finished, sched, _ = sglang_scenario(PriorityConfig(enabled=True, preempt=False))
    assert finished == ["0", "20", "10"] and sched.stats.preemptions == 0


def test_low_values_first_and_requests_without_a_priority():
    low = PriorityConfig(enabled=True, low_values_first=True)
    assert (low.rank(-5), low.rank(20), low.rank(None)) == (5, -20, LOWEST)
    assert (ON.rank(None), PriorityConfig().rank(None), PriorityConfig(default=3).rank(None)) == (LOWEST, 0, 3)
    assert low.describe(low.rank(7)) == "7" and "none" in ON.describe(LOWEST)
    finished, _, _ = sglang_scenario(low, (20, 10, 0))
    assert finished == ["0", "10", "20"], "20 runs first; 0 is the most important and preempts it"


def test_priority_orders_first_and_the_schedule_policy_orders_within_a_priority():
    """lpm would take the cached prefix first; priority comes before it, lpm decides between equals. A policy
    switched at runtime keeps the same layering (priority is the scheduler's, not the policy's)."""
    for policy, switch in (("lpm", None), ("fcfs", "lpm")):
        sched, runner = make(policy=policy, capacity=4000)
        done: list[str] = []
        shared = prompt(40, 7)
        sched.add_request("warm", shared, greedy(1))
        drain(sched, runner, done)
        if switch:
            sched.policies.switch(schedule=switch)
        blocker = sched.add_request("blocker", prompt(10, 3), greedy(30), priority=9)
        step(sched, runner, done)
        sched.add_request("cold-low", prompt(30, 5), greedy(2), priority=0)
        sched.add_request("cold-high", prompt(30, 6), greedy(2), priority=1)
        sched.add_request("cached-high", shared + [9], greedy(2), priority=1)
        sched.add_request("cached-low", shared + [8], greedy(2), priority=0)
        drain(sched, runner, done)
        assert done[1:] == ["blocker", "cached-high", "cold-high", "cached-low", "cold-low"], (policy, switch)
        assert blocker.preemptions == 0


def test_a_full_queue_drops_its_least_important_request_not_a_more_important_arrival():
    """SGLang's test_priority_scheduling_existing_requests_abortion_validation and _incoming_request_rejection:
    one running place, three queued; a more important arrival drops the least important queued request (the
    newest among equals), a less important one is refused."""
    sched, runner = make(PriorityConfig(enabled=True, max_queued=3))
    done: list[str] = []
    running = sched.add_request("p1", prompt(10, 0), greedy(40), priority=1)
    step(sched, runner, done)
    queued = [sched.add_request(f"p{p}", prompt(10, p), greedy(3), priority=p) for p in (2, 3, 4)]
    assert not sched.failures
    arrivals = [sched.add_request(f"p{p}", prompt(10, p), greedy(3), priority=p) for p in (5, 6, 7)]
    dropped = sched.take_failures()
    assert [e.rid for e in dropped] == ["p2", "p3", "p4"] and all(q.finished for q in queued)
    assert {(e.status, e.code) for e in dropped} == {(503, "dropped_for_priority")}
    assert "priority 2" in dropped[0].message and "--max-queued-requests 3" in dropped[0].message
    late = sched.add_request("p0", prompt(10, 9), greedy(3), priority=0)
    (refused,) = sched.take_failures()
    assert (refused.rid, refused.status, refused.code) == ("p0", 429, "queue_full") and late.finished
    sched.check()
    drain(sched, runner, done)
    assert done == ["p1", "p7", "p6", "p5"] and exact([running, *arrivals])
    assert sched.cache.owned_by_requests == 0


def test_the_queue_limit_counts_neither_free_places_nor_preempted_requests():
    sched, runner = make(PriorityConfig(enabled=True, max_queued=1), max_running=3)
    for i in range(4):  # three start at the next step: only the fourth waits
        sched.add_request(f"r{i}", prompt(10, i), greedy(5), priority=0)
    assert not sched.failures
    sched.add_request("r4", prompt(10, 4), greedy(5), priority=0)
    assert [e.rid for e in sched.take_failures()] == ["r4"]


def test_kv_preemption_and_retraction_in_a_small_pool_keep_outputs_exact():
    """Many requests of mixed priorities arriving over time in a pool far too small, several running places:
    preemption for places and for KV, out-of-room retraction and eviction all run; invariants after every step."""
    rng = random.Random(11)
    sched, runner = make(PriorityConfig(enabled=True, preemption_threshold=0), capacity=160, max_running=4)
    pending = [(f"r{i}", prompt(rng.randrange(5, 60), i), rng.randrange(1, 40), rng.choice([0, 5, 10]))
               for i in range(30)]
    reqs, done = [], []
    while pending or sched.has_work:
        if pending and (not sched.has_work or rng.random() < 0.3):
            rid, p, n, prio = pending.pop(0)
            reqs.append(sched.add_request(rid, p, greedy(n), priority=prio))
        step(sched, runner, done)
    sched.check()
    assert sched.stats.preemptions > 0 and sched.stats.retractions > 0 and sched.cache.evicted_tokens > 0
    assert all(r.preemptions == 0 for r in reqs if r.priority == 10), "nothing outranks 10"
    assert exact(reqs) and sorted(done) == sorted(r.rid for r in reqs)


def test_sglangs_flags_parse():
    args = from_cli(server_parser().parse_args([
        "--enable-priority-scheduling", "--schedule-low-priority-values-first",
        "--priority-scheduling-preemption-threshold", "3", "--default-priority-value", "7",
        "--max-queued-requests", "5", "--disable-priority-preemption"]))
    assert args.enable_priority_scheduling and args.schedule_low_priority_values_first
    assert (args.priority_scheduling_preemption_threshold, args.default_priority_value) == (3, 7)
    assert args.disable_priority_preemption and args.max_queued_requests == 5
    plain = from_cli(server_parser().parse_args([]))
    assert not plain.enable_priority_scheduling and plain.priority_scheduling_preemption_threshold == 10


@pytest.mark.parametrize("argv, words", [
    (["--schedule-low-priority-values-first"], "--enable-priority-scheduling"),
    (["--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "-1"], ">= 0"),
])
def test_flags_that_cannot_work_are_refused(argv, words):
    with pytest.raises(ValueError, match=words):
        from_cli(server_parser().parse_args(argv))
