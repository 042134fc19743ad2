"""Shadows and --auto-policy inside the simulator: the simulated server's scheduler feeds a ShadowLab through the
same ShadowTap and ShadowFeed messages as the live one, and an AutoPolicy switches its policies -- so what the
shadow process does on a server can be tested, and compared with fixed policies, in seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.actors.scheduler import Scheduler
from radixserve.actors.scheduler.shadow_tap import ShadowTap
from radixserve.lab.auto_policy import AutoPolicy, Switch
from radixserve.lab.shadow import Pair, ShadowLab
from radixserve.lab.simulate import CostModel, Replica, RunResult, simulate
from radixserve.lab.trace import TraceRequest
from radixserve.wire.plans import ForwardPlan


@dataclass
class ShadowObserver:
    """Runs the shadow pairs beside a one-replica simulation, evaluating (and maybe switching) every
    ``every_s`` of simulated time, as the shadow actor does every second of wall time."""

    pairs: list[Pair]
    window_s: float
    auto: AutoPolicy | None
    every_s: float = 1.0
    lab: ShadowLab | None = None
    live: Scheduler | None = None  # the simulated server's scheduler
    reports: list[dict] = field(default_factory=list)
    _next: float = 0.0

    def start(self, replicas: list[Replica]) -> None:
        if len(replicas) != 1:
            raise ValueError("shadow policies simulate one replica")
        sched = self.live = replicas[0].sched
        sched.tap = ShadowTap()
        self.lab = ShadowLab(list(self.pairs), sched.config, window_s=self.window_s, cost=replicas[0].runner.cost,
                             calibrated=True)

    def step(self, replica: Replica, plan: ForwardPlan, seconds: float) -> None:
        sched, now, lab = replica.sched, replica.clock.now, self.lab
        sched.tap.step(plan, seconds)
        lab.feed(sched.tap.feed(sched), wall=now)
        sched.tap.sent(now)
        if now < self._next:
            return
        self._next = now + self.every_s
        lab.advance(float("inf"))
        rows = lab.pair_stats()
        self.reports.append({"at": now, "live": sched.policies.policy.name, "rows": rows})
        switch = self.auto.decide(lab.horizon, lab.live, rows) if self.auto else None
        if switch is not None:
            sched.policies.adopt(*switch.new, reason=f"auto-policy: {switch.reason}")


def simulate_auto(trace: list[TraceRequest], pairs: list[Pair], cache_tokens: int, cost: CostModel,
                  auto: AutoPolicy | None, window_s: float = 60.0, **kw) -> tuple[RunResult, list[Switch],
                                                                                  ShadowObserver]:
    """The simulated server starts with ``pairs[0]``; with ``auto`` it switches to the shadow leader."""
    observer = ShadowObserver(pairs, window_s, auto)
    result = simulate(trace, pairs[0][0], pairs[0][1], cache_tokens, cost, observer=observer, **kw)
    result.eviction, result.schedule = ("auto", "auto") if auto else pairs[0]
    return result, list(auto.switches) if auto else [], observer
