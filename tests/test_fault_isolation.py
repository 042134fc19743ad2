"""A request fails alone: queue timeouts, a failed step, a failed sampling row, a request that cannot be planned,
an abort while its step runs -- each ends that request (or that step's requests) with an error, gives back its
KV, and leaves every other request's output exact, with pool accounting checked after every step. Bookkeeping
cannot drift: a request that is not admitted is no cache hit, the eviction queue stays bounded, and the
invariant checks survive ``python -O``. The offline Engine stays usable after an exception or Ctrl-C mid-step,
and ``shutdown()`` frees the model and the pool."""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import numpy as np
import pytest

from radixserve.actors.scheduler import Scheduler, SchedulerConfig
from radixserve.cache import CacheManager
from radixserve.cache.radix_tree import RadixTree
from radixserve.policies.eviction import LFU, LRU
from radixserve.policies.schedule import FCFS
from radixserve.sampling_params import SamplingParams
from radixserve.wire.plans import ForwardResult
from test_scheduler import VOCAB, TokenPoolRunner, reference, run_all

GREEDY = {"temperature": 0.0}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(capacity=400, chunk=16, max_running=8, queue_timeout=None, clock=None, eviction=None):
    cfg = SchedulerConfig(context_length=4096, vocab_size=VOCAB, eos_ids=frozenset({0}),
                          max_running_requests=max_running, chunked_prefill_size=chunk, queue_timeout_s=queue_timeout,
                          check_invariants=True)
    clock = clock or Clock()
    cache = CacheManager(capacity, eviction or LRU(), clock=clock)
    return Scheduler(cfg, cache, FCFS(), clock=clock), TokenPoolRunner(capacity)


def add(sched, rid, prompt, n):
    return sched.add_request(rid, prompt, SamplingParams(max_new_tokens=n, **GREEDY))


def prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, VOCAB, n).tolist()


def test_requests_past_the_queue_timeout_fail_503_and_the_rest_run():
    clock = Clock()
    sched, runner = make(max_running=1, queue_timeout=5.0, clock=clock)
    first = add(sched, "first", prompt(1, 10), 20)
    late = [add(sched, f"late{i}", prompt(2 + i, 10), 5) for i in range(3)]
    while not first.finished:
        clock.now += 1.0  # each step takes a second; the queue waits behind the one running request
        sched.process(runner.forward(sched.schedule()))
    failures = sched.take_failures()
    assert {f.rid for f in failures} == {r.rid for r in late}
    assert all(f.status == 503 and f.code == "queue_timeout" and "--queue-timeout" in f.message for f in failures)
    assert first.output_ids == reference(first.prompt_ids, 20)
    assert not sched.has_work and sched.cache.owned_by_requests == 0 and sched.stats.queue_timeouts == 3
    sched.check()


def test_a_failed_step_fails_its_requests_gives_back_their_slots_and_the_rest_go_on():
    sched, runner = make(chunk=0)
    reqs = [add(sched, f"r{i}", prompt(i, 12 + i), 10) for i in range(4)]
    plan = sched.schedule()  # the first prefill: every request
    sched.process(ForwardResult(plan.step, error="RuntimeError: out of memory"))
    failures = sched.take_failures()
    assert sorted(f.rid for f in failures) == sorted(r.rid for r in reqs) and all(f.status == 500 for f in failures)
    assert sched.cache.evictable == 0, "nothing that step wrote may be cached: it never ran"
    sched.check()
    again = [add(sched, f"again{i}", prompt(i, 12 + i), 10) for i in range(4)]
    run_all(sched, runner)
    assert all(r.output_ids == reference(r.prompt_ids, 10) for r in again)


def test_a_request_whose_sampling_breaks_fails_alone():
    sched, runner = make()
    reqs = [add(sched, f"r{i}", prompt(i, 8), 12) for i in range(3)]
    for _ in range(3):
        sched.process(runner.forward(sched.schedule()))
    plan = sched.schedule()
    result = runner.forward(plan)
    broken = ForwardResult(result.step, [None if j == 1 else t for j, t in enumerate(result.next_ids)],
                           errors={1: "TypeError: bad seed"})
    sched.process(broken)
    assert [f.rid for f in sched.take_failures()] == [reqs[1].rid]
    run_all(sched, runner)
    assert reqs[0].output_ids == reference(reqs[0].prompt_ids, 12)
    assert reqs[2].output_ids == reference(reqs[2].prompt_ids, 12)


def test_a_request_that_cannot_be_planned_fails_alone():
    """The issue's crash: a top_k past int32 once killed the scheduler while it built the plan. Validation stops
    it now; here it slips past validation (set after the request was queued) and must still fail alone."""
    sched, runner = make()
    good = [add(sched, f"r{i}", prompt(i, 20), 8) for i in range(3)]
    poison = add(sched, "poison", prompt(9, 20), 8)
    poison.params.top_k = 3_000_000_000
    poison.params.temperature = 0.7
    run_all(sched, runner)
    failures = sched.take_failures()
    assert [f.rid for f in failures] == ["poison"] and failures[0].status == 500
    assert all(r.output_ids == reference(r.prompt_ids, 8) for r in good)


def test_an_abort_while_the_step_runs_never_caches_what_the_step_wrote():
    sched, runner = make()
    victim = add(sched, "victim", prompt(1, 30), 10)
    other = add(sched, "other", prompt(2, 30), 10)
    plan = sched.schedule()
    sched.finish("victim", victim.finish_reason or __import__("radixserve.wire.messages").wire.messages.FinishReason("abort"))
    sched.check()  # its slots of this step went back at once
    sched.process(runner.forward(plan))
    run_all(sched, runner)
    assert other.output_ids == reference(other.prompt_ids, 10)
    # the victim's prompt must not look cached: nothing of it was kept as computed before its step ran
    assert sched.cache.match_len(victim.prompt_ids) < len(victim.prompt_ids) - 16


def test_a_request_that_is_not_admitted_is_no_cache_hit():
    sched, runner = make(capacity=200, chunk=0, eviction=LFU())
    shared = prompt(1, 40)
    add(sched, "warm", shared + [1], 2)
    run_all(sched, runner)
    _, node = sched.cache.tree.match_prefix(shared, touch=False)  # the node a request sharing `shared` locks
    hits = node.hit_count
    hog = add(sched, "hog", prompt(7, 60), 50)  # holds most of the pool while it decodes
    sched.process(runner.forward(sched.schedule()))
    blocked = add(sched, "blocked", shared + [2] * 30, 100)  # matches the cached prefix, but does not fit yet
    for _ in range(5):
        sched.process(runner.forward(sched.schedule()))
        assert blocked.kv is None, "the test needs it to stay blocked a while"
    assert node.hit_count == hits, "admission attempts that failed counted as hits"
    run_all(sched, runner)
    assert hog.finished and blocked.finished and blocked.cached_tokens == 40
    assert node.hit_count == hits + 1, "admitted once: one hit"


def test_the_eviction_queue_stays_bounded_when_the_pool_never_fills():
    tree = RadixTree(LFU(), lambda slots: None)
    tokens = list(range(1, 101))
    tree.insert(tokens, np.arange(1, 101, dtype=np.int32))
    for _ in range(1_000_000):
        tree.match_prefix(tokens)
    assert len(tree._queue) <= 2 * tree.num_nodes + 1024
    sched, runner = make(capacity=4000)  # and through the scheduler: one prompt, many times
    p = prompt(3, 50)
    for i in range(2000):
        add(sched, f"again{i}", p, 1)
        run_all(sched, runner)
    assert len(sched.cache.tree._queue) <= 2 * sched.cache.tree.num_nodes + 1024


def test_invariant_checks_survive_python_dash_o():
    code = ("from radixserve.cache import CacheManager\n"
            "from radixserve.cache.invariants import InvariantError\n"
            "from radixserve.policies.eviction import LRU\n"
            "m = CacheManager(10, LRU())\n"
            "m.owned_by_requests = 3  # drifted accounting\n"
            "try:\n    m.check([])\nexcept InvariantError as e:\n    print('caught:', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert "caught: request-owned count drifted" in out.stdout, out.stderr


# -- the offline Engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_models):
    from radixserve import Engine

    return Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, max_total_tokens=600)


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_the_engine_is_usable_after_an_interrupt_mid_step(engine, monkeypatch, raised):
    prompts = ["the engine keeps going", "after a Ctrl-C in a step", "and gives the same tokens"]
    params = {"max_new_tokens": 12, "temperature": 0}
    expected = [r["output_ids"] for r in engine.generate(prompts, params)]
    real, calls = engine.runner.forward, []

    def interrupted(plan):
        calls.append(plan.step)
        if len(calls) == 3:
            raise raised("interrupted mid-step")
        return real(plan)

    monkeypatch.setattr(engine.runner, "forward", interrupted)
    with pytest.raises(raised):
        engine.generate(prompts, params)
    sched = engine.scheduler
    assert not sched.live and not sched.has_work and sched.inflight == [] and sched.cache.owned_by_requests == 0
    sched.check()
    assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected


def test_shutdown_frees_the_model_and_the_pool(tiny_models):
    from radixserve import Engine

    e = Engine(str(tiny_models["llama"]), dtype="float32", max_total_tokens=300)
    e.generate("warm up", {"max_new_tokens": 2})
    model, pool = weakref.ref(e.runner.model), weakref.ref(e.runner.kv.k)
    e.shutdown()
    gc.collect()
    assert model() is None and pool() is None
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate("again", {"max_new_tokens": 2})
    e.shutdown()  # idempotent
