"""The scheduler's side of --shadow-policies: the live trace, collected as it happens and sent to the shadow
process in one ``ShadowFeed`` every FEED_INTERVAL_S at most. Collecting is a list append per request and per
step; everything else (simulating every pair) happens in the shadow's own process, at the lowest CPU priority.
"""
from __future__ import annotations

from radixserve.actors.messages import ShadowArrival, ShadowEnd, ShadowFeed, StepTiming, array
from radixserve.actors.scheduler.req import Req

FEED_INTERVAL_S = 0.2


class ShadowTap:
    def __init__(self) -> None:
        self.arrivals: list[ShadowArrival] = []
        self.ends: list[ShadowEnd] = []
        self.steps: list[StepTiming] = []
        self.last_sent = float("-inf")

    def arrived(self, req: Req) -> None:
        self.arrivals.append(ShadowArrival(req.rid, req.arrival, array(req.prompt_ids), req.max_new_tokens,
                                           req.priority))

    def ended(self, req: Req) -> None:
        self.ends.append(ShadowEnd(req.rid, array(req.output_ids)))

    def step(self, mode: str, tokens: int, batch: int, seconds: float) -> None:
        self.steps.append(StepTiming(mode, tokens, batch, seconds))

    @property
    def pending(self) -> bool:
        return bool(self.arrivals or self.ends or self.steps)

    def due(self, now: float) -> bool:
        return self.pending and now - self.last_sent >= FEED_INTERVAL_S

    def feed(self, now: float, eviction: str, schedule: str, capacity: int) -> ShadowFeed:
        """Everything collected since the last feed the shadow took (``sent`` clears it; a feed its full inbox
        refused is sent again, grown, the next time: the trace never has holes)."""
        return ShadowFeed(now, eviction, schedule, capacity, self.arrivals, self.ends, self.steps)

    def sent(self, now: float) -> None:
        self.arrivals, self.ends, self.steps = [], [], []
        self.last_sent = now
