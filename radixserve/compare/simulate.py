"""The simulator: the *same* scheduler, cache manager and policies as the server, driven on a simulated clock by
a runner that computes nothing and charges each step a modelled cost instead.

    step cost = step_overhead + prefill_per_token * new prompt tokens            (an extend step)
              = step_overhead + decode_per_step + decode_per_seq * batch size    (a decode step)

Calibrate the four numbers against a live server with ``radixserve compare --calibrate URL`` (or give them).
"""
from __future__ import annotations

import heapq
import itertools
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

from radixserve.actors.messages import ForwardPlan, ForwardResult
from radixserve.actors.scheduler import Req, Scheduler, SchedulerConfig
from radixserve.cache import CacheManager
from radixserve.compare.trace import TraceRequest
from radixserve.policies import load_eviction_policy, load_schedule_policy
from radixserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class CostModel:
    """Seconds. Defaults: SmolLM2-135M bf16 on 2 CPU cores, as calibrated in this project's benchmarks."""

    prefill_per_token: float = 0.002
    decode_per_step: float = 0.035
    decode_per_seq: float = 0.003
    step_overhead: float = 0.001

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
    """Answers a plan with each request's scripted next token (the trace's ``output``) and advances the clock."""

    def __init__(self, cost: CostModel, clock: SimClock, outputs: dict[str, list[int]]) -> None:
        self.cost, self.clock, self.outputs = cost, clock, outputs

    def forward(self, plan: ForwardPlan, reqs: list[Req]) -> ForwardResult:
        sample = plan.sample
        ids = [self.outputs[r.rid][len(r.output_ids)] for r, s in zip(reqs, sample) if s]
        self.clock.now += self.cost.step(plan)
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
    server_epoch: dict | None = None  # live: the server's own record of the run (GET /cache/stats)

    def to_dict(self) -> dict:
        return asdict(self)


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def simulate(trace: list[TraceRequest], eviction: str, schedule: str, cache_tokens: int, cost: CostModel,
             max_running: int = 64, chunk: int = 2048, progress=None, check_invariants: bool = False) -> RunResult:
    """Replay ``trace`` through the real scheduler on a simulated clock; returns what a client would measure."""
    wall = time.perf_counter()
    clock = SimClock()
    longest = max(len(r.prompt) + r.max_tokens for r in trace)
    cfg = SchedulerConfig(context_length=longest + 1, vocab_size=max(max(r.prompt) for r in trace) + 1 + 2**20,
                          eos_ids=frozenset(), max_running_requests=max_running, chunked_prefill_size=chunk,
                          check_invariants=check_invariants)
    cache = CacheManager(cache_tokens, load_eviction_policy(eviction), clock=clock)
    sched = Scheduler(cfg, cache, load_schedule_policy(schedule), clock=clock)
    runner = CostModelRunner(cost, clock, {r.id: r.output or [1] * r.max_tokens for r in trace})

    order = itertools.count()
    arrivals: list[tuple[float, int, TraceRequest]] = []
    children: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in trace:
        if r.after is None:
            heapq.heappush(arrivals, (r.arrival, next(order), r))
        else:
            children[r.after].append(r)
    ttft, e2e, rejected, generated = [], [], 0, 0
    prompt_tokens = cached_tokens = 0

    def release(parent_id: str) -> None:
        for child in children.pop(parent_id, ()):
            heapq.heappush(arrivals, (clock.now + child.delay, next(order), child))

    while arrivals or sched.has_work:
        while arrivals and arrivals[0][0] <= clock.now:
            _, _, r = heapq.heappop(arrivals)
            params = SamplingParams(max_new_tokens=r.max_tokens, temperature=0, ignore_eos=True)
            try:
                sched.add_request(r.id, r.prompt, params, priority=r.priority)
            except ValueError:  # longer than this cache can ever hold
                rejected += 1
                release(r.id)
                if progress is not None:
                    progress.update()
        plan = sched.schedule() if sched.has_work else None
        if plan is None:
            if arrivals:  # idle until the next arrival
                clock.now = max(clock.now, arrivals[0][0])
                continue
            if sched.has_work:
                raise RuntimeError("the scheduler stalled with work left (a bug)")
            break  # the last arrivals were all rejected
        for req in sched.process(runner.forward(plan, sched.inflight)):
            generated += 1
            if req.finished:
                ttft.append(req.first_token_at - req.arrival)
                e2e.append(clock.now - req.arrival)
                prompt_tokens += len(req.prompt_ids)
                cached_tokens += req.cached_tokens or 0
                release(req.rid)
                if progress is not None:
                    progress.update()
    return RunResult(
        eviction=eviction, schedule=schedule, cache_tokens=cache_tokens, requests=len(ttft), rejected=rejected,
        prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_s=quantile(ttft, 50), ttft_p99_s=quantile(ttft, 99), e2e_p50_s=quantile(e2e, 50),
        throughput_tokens_per_s=generated / clock.now if clock.now else 0.0, makespan_s=clock.now,
        evicted_tokens=cache.evicted_tokens, retractions=sched.stats.retractions, steps=sched.stats.steps,
        wall_s=time.perf_counter() - wall,
    )
