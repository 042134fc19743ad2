"""The scheduler's side of --shadow-policies: the live trace, collected as it happens and sent to the shadow
process in one ``ShadowFeed`` every FEED_INTERVAL_S at most. Collecting is a list append per request and per
step; everything else (simulating every pair) happens in the shadow's own process, at the lowest CPU priority.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.actors.scheduler.req import Req
from radixserve.wire.codec import array
from radixserve.wire.messages import ShadowArrival, ShadowEnd, ShadowFeed, StepTiming
from radixserve.wire.plans import ForwardPlan

if TYPE_CHECKING:
    from radixserve.actors.scheduler.scheduler import Scheduler

FEED_INTERVAL_S = 0.2
MAX_KEPT = 50000  # arrivals + ends kept for a shadow that takes no feed
MAX_STEPS = 1024  # step timings per feed (the shadow fits its cost model to the newest 1024)


class ShadowTap:
    def __init__(self) -> None:
        self.arrivals: list[ShadowArrival] = []
        self.ends: list[ShadowEnd] = []
        self.steps: list[StepTiming] = []
        self.last_sent = float("-inf")
        self.dropped = 0
        self.force = False  # feed at the next chance even with nothing new (the policies just changed)

    def arrived(self, req: Req) -> None:
        self.arrivals.append(ShadowArrival(req.rid, req.arrival, array(req.prompt_ids), req.max_new_tokens,
                                           req.priority))
        self._bound()

    def _bound(self) -> None:
        """A shadow that takes no feeds for long (stuck, or far behind) must not grow the scheduler: past
        MAX_KEPT events the trace so far is dropped, and the next feed says so (the shadow starts over)."""
        if len(self.arrivals) + len(self.ends) > MAX_KEPT:
            self.dropped += len(self.arrivals) + len(self.ends)
            self.arrivals, self.ends = [], []

    def ended(self, req: Req) -> None:
        self.ends.append(ShadowEnd(req.rid, req.arrival, array(req.output_ids), req.cached_tokens is not None,
                                   req.params.greedy))
        self._bound()

    def step(self, plan: ForwardPlan, seconds: float) -> None:
        """``plan`` took ``seconds`` from sent to answered."""
        tokens = int(plan.extend_lens.sum()) if plan.mode == "extend" else plan.batch_size
        self.steps.append(StepTiming(plan.mode, tokens, plan.batch_size, seconds))
        if len(self.steps) >= 2 * MAX_STEPS:  # only the newest are ever sent
            del self.steps[:MAX_STEPS]

    @property
    def pending(self) -> bool:
        return bool(self.arrivals or self.ends or self.steps or self.dropped or self.force)

    def due(self, now: float) -> bool:
        return self.pending and now - self.last_sent >= FEED_INTERVAL_S

    def feed(self, sched: Scheduler) -> ShadowFeed:
        """Everything collected since the last feed the shadow took (``sent`` clears it; a feed its full inbox
        refused is sent again, grown, the next time: the trace never has holes)."""
        return ShadowFeed(sched.clock(), sched.cache.eviction_policy.name, sched.policy.name, sched.cache.capacity,
                          self.arrivals, self.ends, self.steps[-MAX_STEPS:], self.dropped)

    def sent(self, now: float) -> None:
        self.arrivals, self.ends, self.steps = [], [], []
        self.last_sent, self.dropped, self.force = now, 0, False
