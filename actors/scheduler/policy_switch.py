"""The scheduler's policy lifecycle: the schedule policy in charge and the one it replaced, live switching by name,
guarded ordering (a broken plugin is replaced, never fatal), and the statistics of every policy epoch."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from radixserve.actors.scheduler.req import Req
from radixserve.actors.scheduler.stats import PolicyEpoch, SchedulerStats
from radixserve.cache.manager import CacheManager
from radixserve.policies.base import EvictionPolicy, SchedulePolicy
from radixserve.policies.schedule import FCFS

R = TypeVar("R")


class Policies:
    """The scheduler's policies (``Scheduler.policies``): see the module's docstring."""

    def __init__(self, cache: CacheManager, policy: SchedulePolicy, clock: Callable[[], float],
                 stats: SchedulerStats) -> None:
        self.cache = cache
        self.stats = stats  # the scheduler's totals (cache_stats shows them)
        self.policy = policy
        self.fallback: SchedulePolicy = FCFS()  # what a failing schedule policy is replaced by
        self.clock = clock
        self.errors: deque[str] = deque(maxlen=100)  # the newest failures of replaced schedule policies
        self.epochs: list[PolicyEpoch] = []
        self.speculation = None  # the scheduler's Speculation (speculate.py): its statistics are shown here
        self.new_epoch()

    # -- switching ---------------------------------------------------------------------------------------
    def set(self, eviction: EvictionPolicy | None = None, schedule: SchedulePolicy | None = None,
            reason: str | None = None) -> None:
        """Swap policies between steps: no cached entry and no request is lost; a new stats epoch starts
        (``reason``: why, kept with it). ValueError (nothing changed) if the eviction policy fails on the
        current cache."""
        if eviction is not None:
            self.cache.set_eviction_policy(eviction)
        if schedule is not None:
            self.fallback, self.policy = self.policy, schedule
        self.new_epoch(reason)

    def switch(self, eviction: str | None = None, schedule: str | None = None, reason: str | None = None,
               write: str | None = None, prefetch: str | None = None, draft: str | None = None) -> None:
        """``set`` by registered name (built-in or plugin); ValueError naming the problem. ``write`` and
        ``prefetch``: the lower KV tiers' policies (only with --enable-hierarchical-cache); ``draft``:
        speculative decoding's (``none``: off; only with --speculative-algorithm). These take effect at once and
        start no epoch of their own (their figures are in cache_stats)."""
        from radixserve.policies import (
            load_eviction_policy, load_prefetch_policy, load_schedule_policy, load_write_policy
        )

        if eviction is None and schedule is None and write is None and prefetch is None and draft is None:
            raise ValueError("give an eviction, schedule, write, prefetch and/or draft policy name")
        if draft is not None and (self.speculation is None or not self.speculation.tokens):
            raise ValueError("draft policies are speculative decoding's: start with --speculative-algorithm")
        new_draft = self.speculation.load(draft) if draft is not None else None
        tiers = self.cache.tiers
        if (write or prefetch) and tiers is None:
            raise ValueError("write and prefetch policies are the KV tiers': start with --enable-hierarchical-cache")
        new_write = load_write_policy(write) if write else None  # every name is checked before anything changes
        new_prefetch = load_prefetch_policy(prefetch) if prefetch else None
        if eviction or schedule:
            self.set(load_eviction_policy(eviction) if eviction else None,
                     load_schedule_policy(schedule) if schedule else None, reason)
        if new_write is not None:
            tiers.write = new_write
        if new_prefetch is not None:
            tiers.prefetch = new_prefetch
        if new_draft is not None:
            self.speculation.set_policy(new_draft)

    def adopt(self, eviction: str, schedule: str, reason: str) -> None:
        """Run this pair (--auto-policy): only the policy that differs is replaced, an unchanged one keeps its
        object and its state (e.g. GDSF's clock)."""
        eviction = eviction if eviction != self.cache.eviction_policy.name else None
        schedule = schedule if schedule != self.policy.name else None
        if eviction or schedule:  # already running it: nothing to do
            self.switch(eviction, schedule, reason)

    def info(self) -> dict[str, Any]:
        """What GET /policies shows: the current policies, the available ones, errors of failed policies."""
        from radixserve.policies import available

        errors = list(self.errors) + (list(self.cache.tree.policy_errors) if self.cache.tree else [])
        tiers = self.cache.tiers
        return {"eviction": {"current": self.cache.eviction_policy.name, "available": available("eviction")},
                "schedule": {"current": self.policy.name, "available": available("schedule")},
                **({"write": {"current": tiers.write.name, "available": available("write")},
                    "prefetch": {"current": tiers.prefetch.name, "available": available("prefetch")}}
                   if tiers is not None else {}),
                **({"draft": {"current": self.speculation.policy.name, "available": available("draft")}}
                   if self.speculation is not None and self.speculation.tokens else {}),
                "errors": errors[-20:]}

    # -- ordering ----------------------------------------------------------------------------------------
    def order(self, window: list[R], attempt: int = 0) -> list[R]:
        """``window`` (the oldest waiting requests) in the policy's order. A policy that raises, or (a plugin)
        loses or invents requests, is replaced by the one before it (FCFS at worst), the error is kept in
        ``errors``, and scheduling goes on."""
        try:
            ordered = self.policy.order(list(window), self.cache, self.clock())
            if not type(self.policy).__module__.startswith("radixserve.") and (
                    len(ordered) != len(window) or {id(r) for r in ordered} != {id(r) for r in window}):
                raise ValueError("order() did not return a permutation of the waiting requests")
            return ordered
        except Exception as exc:
            bad = self.policy
            self.policy = self.fallback if self.fallback is not bad else FCFS()
            self.fallback = FCFS()
            self.errors.append(f"schedule policy {bad.name!r} raised {type(exc).__name__}: {exc}; "
                               f"switched to {self.policy.name!r}")
            self.new_epoch(f"fallback: {bad.name!r} raised {type(exc).__name__}")
            if attempt >= 2:  # not even the fallbacks work: arrival order needs no policy at all
                return window
            return self.order(window, attempt + 1)

    # -- statistics --------------------------------------------------------------------------------------
    def finished(self, req: Req) -> None:
        """An admitted request ended: it counts in the epoch in charge now."""
        self.epochs[-1].finished(len(req.prompt_ids), req.cached_tokens or 0, req.ttft, req.queue_wait)

    def new_epoch(self, reason: str | None = None) -> None:
        now = self.clock()
        if self.epochs:
            self.epochs[-1].close(now, self.cache.evicted_tokens)
        self.epochs.append(PolicyEpoch(self.cache.eviction_policy.name, self.policy.name, now,
                                       self.cache.evicted_tokens, reason=reason))

    def cache_stats(self) -> dict[str, Any]:
        """Pool state now, totals since start, and one record per policy epoch (GET /cache/stats)."""
        cache, now, stats = self.cache, self.clock(), self.stats
        prompt = sum(e.prompt_tokens for e in self.epochs)  # of finished requests, like cached
        cached = sum(e.cached_tokens for e in self.epochs)
        return {
            "pool": {"capacity": cache.capacity, "free": cache.allocator.num_free, "evictable": cache.evictable,
                     "protected": cache.protected, "owned_by_requests": cache.owned_by_requests},
            "totals": {"requests_received": stats.requests,
                       "requests_finished": sum(e.requests for e in self.epochs),
                       "requests_failed": stats.failed, "queue_timeouts": stats.queue_timeouts,
                       "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
                       "generated_tokens": stats.generated_tokens, "evicted_tokens": cache.evicted_tokens,
                       "retractions": stats.retractions, "preemptions": stats.preemptions, "steps": stats.steps,
                       "ahead_steps": stats.ahead_steps},
            "epochs": [e.to_dict(now, cache.evicted_tokens) for e in self.epochs],
            **({"tiers": cache.tiers.stats()} if cache.tiers is not None else {}),
            **({"speculative": self.speculation.info()} if self.speculation is not None and self.speculation.tokens
               else {}),
        }
