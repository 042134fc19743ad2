"""Priority scheduling with SGLang's semantics (--enable-priority-scheduling): which request is more important, the
order the queue runs in, which queued request a full queue drops, and which running requests a more important
arrival may preempt (preempt.py retracts them).

A request's priority becomes a *rank* once, when it is queued: larger = more important, whatever the client's
convention. Everything after that (schedule and eviction policies, preemption, the queue limit) reads the rank:

    the client's priority   --schedule-low-priority-values-first   rank
    7                       off (larger values first: the default)  7
    7                       on                                      -7
    none                    --default-priority-value V given        V's rank
    none                    priority scheduling on, no default      LOWEST: below every value a client can give
    none                    priority scheduling off, no default     0 (the priority policies' default)

Priority is a layer over the schedule policy, not a policy of its own: the policy in charge (fcfs, lpm, a plugin,
whichever a switch put in charge) orders the waiting window, then the window is sorted by rank, stably, so among
requests of one priority the policy's order stands.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

LOWEST = -(2**31) - 1  # below every rank a client's int32 priority can have, negated or not


class Ranked(Protocol):
    @property
    def priority(self) -> int: ...  # the rank

    @property
    def arrival(self) -> float: ...


R = TypeVar("R", bound=Ranked)


@dataclass(frozen=True)
class PriorityConfig:
    enabled: bool = False  # --enable-priority-scheduling
    low_values_first: bool = False  # --schedule-low-priority-values-first
    preemption_threshold: int = 10  # --priority-scheduling-preemption-threshold
    preempt: bool = True  # not --disable-priority-preemption
    default: int | None = None  # --default-priority-value: the priority of a request that gives none
    max_queued: int | None = None  # --max-queued-requests, enforced here when enabled (else by the api alone)

    def __post_init__(self) -> None:
        if self.preemption_threshold < 0:
            raise ValueError(f"priority_scheduling_preemption_threshold={self.preemption_threshold} must be >= 0 "
                             "(below 0, two requests of one priority would take turns preempting each other)")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"max_queued_requests={self.max_queued} must be >= 0")

    def rank(self, priority: int | None) -> int:
        """The rank of a request that asked for ``priority`` (None: it gave none)."""
        if priority is None:
            priority = self.default
            if priority is None:
                return LOWEST if self.enabled else 0
        return -priority if self.enabled and self.low_values_first else priority

    def client_value(self, rank: int) -> int | None:
        """The priority a client gives for ``rank`` (None: the lowest rank, which no client value has)."""
        if rank == LOWEST:
            return None
        return -rank if self.enabled and self.low_values_first else rank

    def describe(self, rank: int) -> str:
        """A rank in the client's terms, for messages."""
        value = self.client_value(rank)
        return "none given (the lowest)" if value is None else str(value)

    def order(self, ordered: list[R]) -> list[R]:
        """The schedule policy's order with the most important first; among equals the policy's order stands."""
        return sorted(ordered, key=lambda r: -r.priority) if self.enabled else ordered

    @property
    def preempts(self) -> bool:
        """Does a more important arrival take the place of running requests (SGLang's priority preemption)?"""
        return self.enabled and self.preempt

    def outranks(self, arrival: Ranked, running: Ranked) -> bool:
        """May ``arrival`` preempt ``running``? Its rank must exceed the running one's by more than the threshold
        (SGLang: 20 preempts 0 at the default threshold of 10; 10 does not)."""
        return arrival.priority - running.priority > self.preemption_threshold

    def queue_full(self, queued: int, free_places: int) -> bool:
        """Is the queue full for one more arrival? ``queued``: requests waiting for their first admission;
        ``free_places``: running places free now (that many of the queued start at the next step, so they do
        not count as waiting)."""
        return self.enabled and self.max_queued is not None and queued - max(free_places, 0) >= self.max_queued

    def to_drop(self, queued: list[R], arrival: R) -> R:
        """The queue is full and ``arrival`` comes: the request to drop. The least important queued request (the
        newest among equals) if ``arrival`` is strictly more important, else ``arrival`` itself."""
        least = min(queued, key=lambda r: (r.priority, -r.arrival), default=None)
        return least if least is not None and arrival.priority > least.priority else arrival

    def drop_error(self, dropped: Ranked, arrival: Ranked) -> tuple[str, int, str]:
        """What the dropped request's client is told: (message, HTTP status, code)."""
        limit = f"--max-queued-requests {self.max_queued}"
        if dropped is arrival:
            return (f"the queue is full ({limit}) and no request in it is less important than this one (priority "
                    f"{self.describe(arrival.priority)}); retry later, or with a higher priority", 429, "queue_full")
        return (f"this request (priority {self.describe(dropped.priority)}) was the least important in a full queue "
                f"({limit}) when a more important one (priority {self.describe(arrival.priority)}) arrived, so it "
                "was dropped; retry later, or with a higher priority", 503, "dropped_for_priority")
