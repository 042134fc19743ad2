"""sjf-aging, shortest-extend, priority-preempt and hit-density: hand-made queues and trees where the right order is
known, preemption through the real scheduler (exact outputs, invariants after every step), and the simulator."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import msgspec
import pytest

from radixserve.cache import RadixTree, SlotAllocator
from radixserve.lab.simulate import CostModel, SimClock, simulate
from radixserve.lab.workloads import WorkloadSpec, build
from radixserve.policies import available, load_eviction_policy, load_schedule_policy
from radixserve.policies.schedule import MAX_MATCHED
from radixserve.sampling_params import SamplingParams

from test_policies import FakeReq, cache_with
from test_scheduler import make, reference, run_all

NEW_SCHEDULE = ["sjf-aging", "shortest-extend", "priority-preempt"]
P1, P2 = list(range(100, 140)), list(range(200, 220))  # cached in every queue test below


def fresh(n: int, start: int = 1000) -> list[int]:
    """``n`` tokens the cache does not hold."""
    return list(range(start, start + n))


def ids(reqs) -> list[str]:
    return [r.rid for r in reqs]


def test_registered_by_name():
    assert set(available("schedule")) >= set(NEW_SCHEDULE)
    assert "hit-density" in available("eviction")
    assert load_schedule_policy("shortest-extend").cache_aware and load_schedule_policy("sjf-aging").cache_aware
    preempt = load_schedule_policy("priority-preempt")
    assert preempt.preempt is True and preempt.max_preemptions == 2
    assert not getattr(load_schedule_policy("priority"), "preempt", False)


# -- shortest-extend --------------------------------------------------------------------------------------
def test_shortest_extend_fewest_uncached_tokens_first_ties_by_arrival():
    queue = [
        FakeReq("long-but-cached", 0.0, P1 + fresh(5)),  # 45 tokens, 40 cached: 5 to compute
        FakeReq("short-cold", 1.0, fresh(3)),  # 3
        FakeReq("long-cold", 2.0, fresh(20, 2000)),  # 20
        FakeReq("tie-later", 3.0, fresh(3, 3000)),  # 3, arrived after short-cold
        FakeReq("all-cached", 4.0, list(P2)),  # 0 uncached, but one token is always computed: 1
    ]
    out = load_schedule_policy("shortest-extend").order(queue, cache_with(P1, P2), 10.0)
    assert ids(out) == ["all-cached", "short-cold", "tie-later", "long-but-cached", "long-cold"]


@pytest.mark.parametrize("name", ["shortest-extend", "sjf-aging"])
def test_only_the_oldest_max_matched_are_matched(name):
    """A queue longer than MAX_MATCHED: the oldest are ordered by size, the rest follow by arrival however
    small they are (matching every request would make a step O(queue * prompt))."""
    old = [FakeReq(f"old{i}", i * 1e-6, fresh(10 + i % 7, 10 * i), max_new_tokens=1) for i in range(MAX_MATCHED)]
    tiny = FakeReq("tiny-newest", 1.0, [1], max_new_tokens=1)  # (arrival gaps far below a token of credit)
    out = load_schedule_policy(name).order([tiny] + old, cache_with(), 1.0)
    assert out[-1] is tiny
    sizes = [len(r.fill_ids) for r in out[:-1]]
    assert sizes == sorted(sizes)


# -- sjf-aging --------------------------------------------------------------------------------------------
def test_sjf_aging_is_shortest_job_first_counting_the_output_budget_and_the_cache():
    queue = [
        FakeReq("long-output", 0.0, fresh(10), max_new_tokens=500),  # 10 + 500
        FakeReq("long-prompt", 0.0, fresh(300, 2000), max_new_tokens=10),  # 300 + 10
        FakeReq("cached-prompt", 0.0, P1 + fresh(2, 3000), max_new_tokens=100),  # 2 + 100 (40 cached)
        FakeReq("small", 0.0, fresh(20, 4000), max_new_tokens=20),  # 20 + 20
    ]
    out = load_schedule_policy("sjf-aging").order(queue, cache_with(P1), 0.0)
    assert ids(out) == ["small", "cached-prompt", "long-prompt", "long-output"]


def test_sjf_aging_a_long_job_goes_ahead_of_newcomers_once_it_has_waited_long_enough():
    """Default credit 1000 tokens per second waited. A 2000-token job against a 100-token newcomer: the newcomer
    goes first while the long job has waited under (2000 - 100) / 1000 = 1.9 s, the long job after that."""
    policy, cache = load_schedule_policy("sjf-aging"), cache_with()
    long_job = FakeReq("long", 0.0, fresh(1000), max_new_tokens=1000)

    def order_at(now: float) -> list[str]:
        newcomer = FakeReq("new", now, fresh(50, 5000), max_new_tokens=50)
        return ids(policy.order([long_job, newcomer], cache, now))

    assert order_at(1.0) == ["new", "long"]
    assert order_at(1.8) == ["new", "long"]
    assert order_at(2.0) == ["long", "new"]
    assert order_at(60.0) == ["long", "new"]


def test_sjf_aging_bound_holds_on_a_random_queue():
    """Whatever its size S, a request goes ahead of every request that arrived more than (S - 1) / rate seconds
    after it."""
    rng = random.Random(5)
    policy, cache = load_schedule_policy("sjf-aging"), cache_with(P1)
    queue = [FakeReq(f"r{i}", rng.uniform(0, 5), (P1 if i % 2 else []) + fresh(rng.randrange(1, 2000), 5000 * i),
                     max_new_tokens=rng.randrange(0, 2000)) for i in range(80)]
    pos = {r.rid: i for i, r in enumerate(policy.order(queue, cache, 6.0))}
    for a in queue:
        size = max(1, len(a.fill_ids) - cache.match_len(a.fill_key)) + a.max_new_tokens
        for b in queue:
            if b.arrival > a.arrival + (size - 1) / policy.aging_tokens_per_s:
                assert pos[a.rid] < pos[b.rid], (a.rid, b.rid)


# -- hit-density ------------------------------------------------------------------------------------------
def tree_on(policy_name: str) -> tuple[RadixTree, SlotAllocator, SimClock]:
    alloc, clock = SlotAllocator(4096), SimClock()
    return RadixTree(load_eviction_policy(policy_name), alloc.free, clock), alloc, clock


def cache_at(tree: RadixTree, alloc: SlotAllocator, clock: SimClock, t: float, seq: list[int],
             hits_at: tuple[float, ...] = ()) -> None:
    clock.now = t
    tree.insert(seq, alloc.alloc(len(seq)))
    for at in hits_at:
        clock.now = at
        tree.match_prefix(seq)


SMALL_HOT, BIG = fresh(10), fresh(500, 5000)


@pytest.mark.parametrize("policy,first_out", [("lru", "small"), ("hit-density", "big")])
def test_hit_density_keeps_a_small_often_hit_segment_over_a_big_rarely_hit_one(policy, first_out):
    """The small segment was hit 5 times but last used before the big one (hit once): LRU lets the small one
    go; hit-density weighs hits per token and lets the big one go."""
    tree, alloc, clock = tree_on(policy)
    cache_at(tree, alloc, clock, 0.0, SMALL_HOT, hits_at=(1.0, 2.0, 3.0, 4.0, 5.0))
    cache_at(tree, alloc, clock, 6.0, BIG, hits_at=(7.0,))
    clock.now = 8.0
    tree.evict(1)
    gone = {"small": tree.match_len(SMALL_HOT) == 0, "big": tree.match_len(BIG) == 0}
    assert gone == {"small": first_out == "small", "big": first_out == "big"}


@pytest.mark.parametrize("new_at,first_out", [(60.0, "new"), (600.0, "hot")])
def test_hit_density_decay_lets_an_old_hot_segment_go(new_at, first_out):
    """Same size; "hot" was hit 7 times at t=0, "new" cached once later (half-life 60 s). One half-life on, hot
    still counts 8 / 2 = 4 uses against new's 1, so new goes; ten half-lives on, hot's 8 / 1024 lose."""
    tree, alloc, clock = tree_on("hit-density")
    hot, new = fresh(10), fresh(10, 7000)
    cache_at(tree, alloc, clock, 0.0, hot, hits_at=(0.0,) * 7)
    cache_at(tree, alloc, clock, new_at, new)
    tree.evict(1)
    assert (tree.match_len(hot) == 0, tree.match_len(new) == 0) == (first_out == "hot", first_out == "new")


def test_hit_density_keys_computed_at_different_times_order_as_densities_at_one_time():
    """The key does not depend on when it was computed; ordering keys is ordering the decayed densities at any
    common moment after the last accesses."""
    policy = load_eviction_policy("hit-density")
    rng = random.Random(1)
    nodes = [SimpleNamespace(hit_count=rng.randrange(50), num_tokens=rng.randrange(1, 2000),
                             last_access=rng.uniform(0, 1000)) for _ in range(200)]
    keys = [policy.key(n, now=rng.uniform(n.last_access, 2000)) for n in nodes]  # each at its own time

    def density(n, t: float) -> float:
        return (n.hit_count + 1) * 2 ** (-(t - n.last_access) / policy.half_life_s) / n.num_tokens

    for t in (1000.0, 1500.0):
        by_density = sorted(range(len(nodes)), key=lambda i: math.log2(density(nodes[i], t)))
        assert sorted(range(len(nodes)), key=keys.__getitem__) == by_density


# -- priority-preempt through the scheduler ---------------------------------------------------------------
def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def prompt(n: int, seed: int) -> list[int]:
    return [(i * (seed + 2) + seed) % 49 + 1 for i in range(n)]


def exact(reqs) -> bool:
    return all(r.output_ids == reference(r.prompt_ids, r.max_new_tokens) for r in reqs)


def full_pool_then_priority_1(policy_name: str, priorities: tuple[int, int]):
    """Two requests of ``priorities`` fill a 200-slot pool (their prompts plus the decode room kept for them);
    after 6 steps a priority-1 request arrives that fits only if one of them leaves. Returns the scheduler, its
    runner, the plan of the step after the arrival (already processed) and the three requests."""
    sched, runner = make(capacity=200, chunk=0, policy=load_schedule_policy(policy_name))
    running = [sched.add_request(f"p{prio}-{i}", prompt(40, i), greedy(60), priority=prio)
               for i, prio in enumerate(priorities)]
    for _ in range(6):
        sched.process(runner.forward(sched.schedule()))
    hi = sched.add_request("hi", prompt(40, 3), greedy(20), priority=1)
    plan = sched.schedule()
    sched.process(runner.forward(plan))
    return sched, runner, plan, (*running, hi)


def test_a_high_priority_arrival_retracts_a_low_priority_running_request_and_outputs_stay_exact():
    outputs = {}
    for name in ("priority", "priority-preempt"):
        sched, runner, plan, (lo1, lo2, hi) = full_pool_then_priority_1(name, (0, 0))
        if name == "priority":
            assert plan.mode == "decode" and hi in sched.waiting and sched.stats.preemptions == 0
        else:
            assert plan.mode == "extend" and hi in sched.running, "hi was admitted at once"
            assert sched.stats.preemptions == 1 and lo1 in sched.waiting and lo2 in sched.running
            assert (lo1.preemptions, lo2.preemptions) == (1, 0)
            assert lo1.kv is None and sched.cache.match_len(lo1.fill_key) >= 40, "its KV went to the tree"
            assert sched.policies.cache_stats()["totals"]["preemptions"] == 1
            assert sched.stats.retractions == 0, "a preemption is not an out-of-room retraction"
        run_all(sched, runner)
        outputs[name] = {r.rid: r.output_ids for r in (lo1, lo2, hi)}
        assert exact((lo1, lo2, hi))
    assert outputs["priority-preempt"] == outputs["priority"]


def test_never_preempts_a_request_of_equal_or_higher_priority():
    sched, runner, plan, (same, higher, hi) = full_pool_then_priority_1("priority-preempt", (1, 2))
    assert plan.mode == "decode" and sched.stats.preemptions == 0
    assert same in sched.running and higher in sched.running and hi in sched.waiting
    run_all(sched, runner)
    assert sched.stats.preemptions == 0 and exact((same, higher, hi))


def test_a_request_is_preempted_at_most_max_preemptions_times_and_finishes():
    """One long priority-0 request; each time it has made progress, a priority-1 request arrives that does not
    fit beside it. The first two take its room; the third waits until it is done."""
    sched, runner = make(capacity=200, chunk=0, policy=load_schedule_policy("priority-preempt"))
    lo = sched.add_request("lo", prompt(40, 1), greedy(100))
    his = []
    third_waited = False
    while sched.has_work:
        if lo in sched.running and len(his) < 3 and all(h.finished for h in his) and \
                len(lo.output_ids) > 10 * (len(his) + 1):
            his.append(sched.add_request(f"hi{len(his)}", prompt(100, 10 + len(his)), greedy(10), priority=1))
        plan = sched.schedule()
        if len(his) == 3 and not his[2].finished and not lo.finished:
            assert lo.preemptions == 2 and lo in sched.running and his[2] in sched.waiting, "lo is no victim now"
            third_waited = True
        sched.process(runner.forward(plan))
    sched.check()
    assert len(his) == 3 and third_waited
    assert lo.preemptions == 2 and sched.stats.preemptions == 2
    assert exact([lo] + his)


def test_mixed_priorities_in_a_small_pool_keep_exact_outputs_and_invariants():
    """Many requests of three priorities arriving over time in a pool far too small: preemption, retraction and
    eviction all run; invariants are checked after every step (make() turns them on)."""
    rng = random.Random(7)
    sched, runner = make(capacity=160, chunk=16, policy=load_schedule_policy("priority-preempt"))
    pending = [(f"r{i}", prompt(rng.randrange(5, 60), i), rng.randrange(1, 40), i % 3) for i in range(30)]
    reqs = []
    while pending or sched.has_work:
        if pending and (not sched.has_work or rng.random() < 0.3):
            rid, p, n, prio = pending.pop(0)
            reqs.append(sched.add_request(rid, p, greedy(n), priority=prio))
        sched.process(runner.forward(sched.schedule()))
    sched.check()
    assert sched.stats.preemptions > 0 and sched.stats.retractions > 0 and sched.cache.evicted_tokens > 0
    assert all(r.preemptions <= 2 for r in reqs)
    assert all(r.preemptions == 0 for r in reqs if r.priority == 2), "nothing outranks priority 2"
    assert exact(reqs)


# -- the simulator ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", NEW_SCHEDULE)
def test_the_simulator_runs_the_new_policies(schedule):
    trace = build(WorkloadSpec(kind="shared-prefix", requests=120, groups=6, prefix_tokens=128, rate=20))
    trace = [msgspec.structs.replace(r, priority=i % 3) for i, r in enumerate(trace)]
    kw = dict(cache_tokens=1024, cost=CostModel(), max_running=16, check_invariants=True)
    results = [simulate(trace, eviction, schedule, **kw) for eviction in ("lru", "hit-density")]
    for res in results:
        assert res.requests == len(trace) and res.rejected == 0
        assert res.cached_tokens > 0, "the shared prefixes were reused"
    assert simulate(trace, "hit-density", schedule, **kw).to_dict() | {"wall_s": None} == \
        results[1].to_dict() | {"wall_s": None}, "deterministic"


def test_priority_preempt_retracts_nobody_when_even_all_victims_would_not_make_room():
    """A high-priority H holds most of a 200-slot pool; A (priority 3) could not fit even if L (priority 0)
    left, so L keeps running."""
    from radixserve.actors.scheduler import Scheduler, SchedulerConfig
    from radixserve.cache import CacheManager
    from radixserve.lab.simulate import CostModel, CostModelRunner, SimClock
    from radixserve.policies import load_eviction_policy, load_schedule_policy
    from radixserve.sampling_params import SamplingParams

    cfg = SchedulerConfig(context_length=4096, vocab_size=50000, eos_ids=frozenset(), chunked_prefill_size=0,
                          check_invariants=True)
    clock = SimClock()
    sched = Scheduler(cfg, CacheManager(200, load_eviction_policy("lru"), clock=clock),
                      load_schedule_policy("priority-preempt"), clock=clock)
    runner = CostModelRunner(CostModel(), clock, {"H": [1] * 20, "L": [2] * 20, "A": [3] * 4})

    def params(n):
        return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)

    sched.add_request("H", list(range(1000, 1130)), params(20), priority=5)
    sched.add_request("L", list(range(2000, 2020)), params(20), priority=0)
    sched.process(runner.forward(sched.schedule(), sched.inflight))
    sched.add_request("A", list(range(3000, 3100)), params(4), priority=3)
    sched.process(runner.forward(sched.schedule(), sched.inflight))
    assert sched.stats.preemptions == 0 and {r.rid for r in sched.running} == {"H", "L"}
    while sched.has_work:
        sched.process(runner.forward(sched.schedule(), sched.inflight))
    assert sched.stats.preemptions == 0
