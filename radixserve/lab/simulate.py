"""The simulator: the *same* scheduler, cache manager and policies as the server, driven on a simulated clock by
a runner that computes nothing and charges each step a modelled cost instead.

    step cost = step_overhead + prefill_per_token * new prompt tokens            (an extend step)
              = step_overhead + decode_per_step + decode_per_seq * batch size    (a decode step)

Calibrate the four numbers against a live server with ``radixserve compare --calibrate URL`` (or give them).

With ``replicas`` > 1 it simulates --dp replicas (or servers behind ``radixserve router``): each replica its own
scheduler, cache and clock, running in parallel; each arrival goes where the routing policy sends it -- the same
policy objects as the router's, fed the prompt's token ids and each replica's requests in flight as its load.
"""
from __future__ import annotations

import heapq
import itertools
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Protocol

from radixserve.actors.router.policies import Worker, load_routing_policy
from radixserve.actors.scheduler import Req, Scheduler, SchedulerConfig
from radixserve.actors.scheduler.stats import latency_summary
from radixserve.cache import CacheManager
from radixserve.lab.sim_tiers import SimTiers, TierSpec
from radixserve.lab.trace import TraceRequest
from radixserve.policies import load_eviction_policy, load_schedule_policy
from radixserve.sampling_params import SamplingParams
from radixserve.wire.plans import ForwardPlan, ForwardResult


@dataclass(frozen=True)
class CostModel:
    """Seconds. Defaults: SmolLM2-135M bf16 on 2 CPU cores with the native decode step, as the shadow fitted
    them to a live server in this project's benchmarks (``make bench``, stage shadow); ``--calibrate URL`` fits
    them to yours."""

    prefill_per_token: float = 0.0003
    decode_per_step: float = 0.002
    decode_per_seq: float = 0.0016
    step_overhead: float = 0.016

    def step(self, plan: ForwardPlan) -> float:
        if plan.mode == "decode":
            return self.step_overhead + self.decode_per_step + self.decode_per_seq * plan.batch_size
        return self.step_overhead + self.prefill_per_token * int(plan.extend_lens.sum())


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostModelRunner:
    """Answers a plan with each request's scripted next token (the trace's ``output``) and advances the clock (the
    step's cost, and its loads and writes of KV pages with simulated tiers)."""

    def __init__(self, cost: CostModel, clock: SimClock, outputs: dict[str, list[int]],
                 tiers: SimTiers | None = None) -> None:
        self.cost, self.clock, self.outputs, self.tiers = cost, clock, outputs, tiers

    def forward(self, plan: ForwardPlan, reqs: list[Req]) -> ForwardResult:
        sample = plan.sample
        ids = [self.outputs[r.rid][len(r.output_ids)] for r, s in zip(reqs, sample) if s]
        self.clock.now += self.cost.step(plan) + (self.tiers.apply(plan.tiers) if self.tiers is not None else 0.0)
        return ForwardResult(plan.step, ids)


@dataclass
class RunResult:
    """One policy pair on one trace, simulated or live, as a client would measure it."""

    eviction: str
    schedule: str
    cache_tokens: int
    requests: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    throughput_tokens_per_s: float
    makespan_s: float
    evicted_tokens: int | None = None  # simulated: from the cache manager
    retractions: int | None = None
    steps: int | None = None
    wall_s: float | None = None
    ttft_mean_s: float | None = None
    cold_ttft_p99_s: float | None = None  # starvation: requests that reused nothing,
    max_queue_wait_s: float | None = None  # the longest wait for admission (simulated only),
    slowest5_ttft_share: float | None = None  # the share of all TTFT the slowest 5% carry
    server_epoch: dict | None = None  # live: the server's own record of the run (GET /cache/stats)
    replicas: int = 1
    routing: str | None = None  # the routing policy, with replicas > 1
    write: str | None = None  # with simulated KV tiers: the write policy, and each tier's share of prompt tokens
    tier_hit_rates: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def starvation(ttft: list[float], cold: list[float], waits: list[float]) -> dict:
    """RunResult's starvation fields (and mean TTFT), as the server's epochs compute them."""
    summary = latency_summary(ttft, cold, waits)
    return {k: summary[k] for k in ("ttft_mean_s", "cold_ttft_p99_s", "max_queue_wait_s", "slowest5_ttft_share")}


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


class Replica:
    """One simulated replica: the real scheduler and cache manager on a clock of their own."""

    def __init__(self, cfg: SchedulerConfig, eviction: str, schedule: str, cache_tokens: int, cost: CostModel,
                 outputs: dict[str, list[int]], index: int, tiers: TierSpec | None = None) -> None:
        self.clock = SimClock()
        self.cache = CacheManager(cache_tokens, load_eviction_policy(eviction), clock=self.clock)
        self.tiers = SimTiers(tiers, self.clock) if tiers is not None else None
        if self.tiers is not None:
            self.cache.attach_tiers(self.tiers.scheduler_side)
        self.sched = Scheduler(cfg, self.cache, load_schedule_policy(schedule), clock=self.clock)
        self.runner = CostModelRunner(cost, self.clock, outputs, self.tiers)
        self.worker = Worker(str(index))

    @property
    def load(self) -> int:
        return len(self.sched.running) + len(self.sched.waiting) + (self.sched.chunked is not None)


class Observer(Protocol):
    """Watches a simulation (the auto-policy simulation runs shadows beside it)."""

    def start(self, replicas: list[Replica]) -> None: ...
    def step(self, replica: Replica, plan: ForwardPlan, seconds: float) -> None: ...


def simulate(trace: list[TraceRequest], eviction: str, schedule: str, cache_tokens: int, cost: CostModel,
             max_running: int = 64, chunk: int = 2048, progress=None, check_invariants: bool = False,
             replicas: int = 1, routing: str = "cache-aware", observer: Observer | None = None,
             tiers: TierSpec | None = None) -> RunResult:
    """Replay ``trace`` through the real scheduler on a simulated clock (``replicas`` of it, requests routed by
    ``routing``, each with ``cache_tokens``, and ``tiers`` below each pool); returns what a client would measure."""
    wall = time.perf_counter()
    longest = max(len(r.prompt) + r.max_tokens for r in trace)
    cfg = SchedulerConfig(context_length=longest + 1, vocab_size=max(max(r.prompt) for r in trace) + 1 + 2**20,
                          eos_ids=frozenset(), max_running_requests=max_running, chunked_prefill_size=chunk,
                          check_invariants=check_invariants)
    outputs = {r.id: r.output or [1] * r.max_tokens for r in trace}
    reps = [Replica(cfg, eviction, schedule, cache_tokens, cost, outputs, i, tiers) for i in range(replicas)]
    policy = load_routing_policy(routing) if replicas > 1 else None
    if observer is not None:
        observer.start(reps)

    order = itertools.count()
    arrivals: list[tuple[float, int, TraceRequest]] = []
    children: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in trace:
        if r.after is None:
            heapq.heappush(arrivals, (r.arrival, next(order), r))
        else:
            children[r.after].append(r)
    ttft, e2e, cold, waits, rejected, generated = [], [], [], [], 0, 0
    prompt_tokens = cached_tokens = 0

    def release(parent_id: str, now: float) -> None:
        for child in children.pop(parent_id, ()):
            heapq.heappush(arrivals, (now + child.delay, next(order), child))

    def route(r: TraceRequest) -> Replica:
        if policy is None:
            return reps[0]
        for rep in reps:
            rep.worker.load = rep.load
        chosen = policy.choose("".join(map(chr, r.prompt)), [rep.worker for rep in reps])
        return reps[int(chosen.url)]

    while True:
        busy = [rep for rep in reps if rep.sched.has_work]
        if arrivals and (not busy or arrivals[0][0] <= min(rep.clock.now for rep in busy)):
            at, _, r = heapq.heappop(arrivals)  # the next event is an arrival
            rep = route(r)
            rep.clock.now = max(rep.clock.now, at)  # an idle replica waits for it
            params = SamplingParams(max_new_tokens=r.max_tokens, temperature=0, ignore_eos=True)
            try:
                rep.sched.add_request(r.id, r.prompt, params, priority=r.priority, arrival=at)
                if rep.tiers is not None:
                    rep.tiers.answer(rep.sched)
            except ValueError:  # longer than this cache can ever hold
                rejected += 1
                release(r.id, rep.clock.now)
                if progress is not None:
                    progress.update()
            continue
        if not busy:
            break
        rep = min(busy, key=lambda x: x.clock.now)  # the replica furthest behind takes its next step
        plan = rep.sched.schedule()
        if plan is None and rep.tiers is not None and rep.sched.held:  # asked for pages again: answered at once
            rep.tiers.answer(rep.sched)
            plan = rep.sched.schedule()
        if plan is None:
            if arrivals:  # nothing it can run yet: it idles until the next arrival
                rep.clock.now = max(rep.clock.now, arrivals[0][0])
                continue
            raise RuntimeError("the scheduler stalled with work left (a bug)")
        before = rep.clock.now
        for req in rep.sched.process(rep.runner.forward(plan, rep.sched.inflight)):
            generated += 1
            if req.finished:
                ttft.append(req.ttft)
                e2e.append(rep.clock.now - req.arrival)
                if not req.cached_tokens:
                    cold.append(req.ttft)
                waits.append(req.queue_wait)
                prompt_tokens += len(req.prompt_ids)
                cached_tokens += req.cached_tokens or 0
                release(req.rid, rep.clock.now)
                if progress is not None:
                    progress.update()
        if observer is not None:
            observer.step(rep, plan, rep.clock.now - before)
    makespan = max(rep.clock.now for rep in reps)
    return RunResult(
        eviction=eviction, schedule=schedule, cache_tokens=cache_tokens, requests=len(ttft), rejected=rejected,
        prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_s=quantile(ttft, 50), ttft_p99_s=quantile(ttft, 99), e2e_p50_s=quantile(e2e, 50),
        **starvation(ttft, cold, waits),
        throughput_tokens_per_s=generated / makespan if makespan else 0.0, makespan_s=makespan,
        evicted_tokens=sum(rep.cache.evicted_tokens for rep in reps),
        retractions=sum(rep.sched.stats.retractions for rep in reps),
        steps=sum(rep.sched.stats.steps for rep in reps), wall_s=time.perf_counter() - wall,
        replicas=replicas, routing=routing if replicas > 1 else None,
        write=tiers.write if tiers is not None else None,
        tier_hit_rates=tier_hit_rates(reps) if tiers is not None else None,
    )


def tier_hit_rates(reps: list[Replica]) -> dict[str, float]:
    """Each tier's share of the admitted requests' prompt tokens, over the replicas."""
    counts = [rep.cache.tiers.counters for rep in reps]
    prompt = sum(c.prompt_tokens for c in counts)
    return {f"L{i + 1}": sum(c.hit_tokens[i] for c in counts) / prompt if prompt else 0.0 for i in range(3)}
