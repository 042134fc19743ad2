"""Statistics per policy epoch: a new epoch starts whenever the eviction or schedule policy changes, so policies
can be compared on the same server (GET /cache/stats)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_TTFT_SAMPLES = 20000  # per epoch; enough for stable p99


@dataclass
class SchedulerStats:
    """Totals since start."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    preemptions: int = 0  # retractions for a higher-priority arrival (a preempting schedule policy)
    steps: int = 0
    ahead_steps: int = 0  # overlap: decode steps planned while the step before them computed
    failed: int = 0  # requests that ended with an error (timed out in the queue, broke on our side)
    queue_timeouts: int = 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


SLOWEST_SHARE = 0.05  # starvation: the share of all TTFT that the slowest 5% of requests account for


def latency_summary(ttft: list[float], cold_ttft: list[float], waits: list[float]) -> dict[str, Any]:
    """TTFT percentiles plus what shows starvation: cold requests' (no cache hit) TTFT p99, the longest queue
    wait (arrival to admission), and the share of the total TTFT spent by the slowest 5% of requests (1.0: one
    request carries it all; 0.05: all equal). None where there is nothing to measure."""
    total = sum(ttft)
    worst = sorted(ttft, reverse=True)[:max(1, math.ceil(SLOWEST_SHARE * len(ttft)))] if ttft else []
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": total / len(ttft) if ttft else None,
        "cold_requests": len(cold_ttft),
        "cold_ttft_p99_s": percentile(cold_ttft, 99),
        "max_queue_wait_s": max(waits) if waits else None,
        "slowest5_ttft_share": sum(worst) / total if total > 0 else None,
    }


@dataclass
class PolicyEpoch:
    """What happened while one (eviction, schedule) pair was in charge. Requests count in the epoch they
    finish in, if they were ever admitted (one that timed out in the queue reused nothing and computed nothing);
    TTFT is the scheduler's (arrival to first token, no HTTP)."""

    eviction: str
    schedule: str
    started: float
    evicted_at_start: int
    ended: float | None = None
    evicted_at_end: int | None = None
    reason: str | None = None  # why it started, if not by hand: auto-policy's evidence, a policy's failure
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft: list[float] = field(default_factory=list)  # the first MAX_TTFT_SAMPLES (percentiles come from them)
    cold_ttft: list[float] = field(default_factory=list)  # of requests that reused nothing
    waits: list[float] = field(default_factory=list)  # arrival to admission
    cold_requests: int = 0  # all of them, past the samples too
    max_wait: float | None = None
    summary: dict[str, Any] | None = None  # a closed epoch's latency figures, computed once at close

    def finished(self, prompt_tokens: int, cached_tokens: int, ttft: float | None, wait: float | None) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.cold_requests += cached_tokens == 0
        if wait is not None and (self.max_wait is None or wait > self.max_wait):
            self.max_wait = wait
        if len(self.ttft) >= MAX_TTFT_SAMPLES:
            return
        if ttft is not None:
            self.ttft.append(ttft)
            if cached_tokens == 0:
                self.cold_ttft.append(ttft)
        if wait is not None:
            self.waits.append(wait)

    def close(self, now: float, evicted_total: int) -> None:
        """The epoch is over: its figures are final, so they are computed once and its samples let go (a
        server that switches often keeps many epochs)."""
        self.ended, self.evicted_at_end = now, evicted_total
        self.summary = self.latency()
        self.ttft, self.cold_ttft, self.waits = [], [], []

    def latency(self) -> dict[str, Any]:
        if self.summary is not None:
            return self.summary
        return {**latency_summary(self.ttft, self.cold_ttft, self.waits), "cold_requests": self.cold_requests,
                "max_queue_wait_s": self.max_wait}

    def to_dict(self, now: float, evicted_total: int) -> dict[str, Any]:
        end = self.ended if self.ended is not None else now
        evicted = (self.evicted_at_end if self.evicted_at_end is not None else evicted_total) - self.evicted_at_start
        duration = max(end - self.started, 1e-9)
        return {
            "eviction": self.eviction,
            "schedule": self.schedule,
            "started": self.started,
            "duration_s": end - self.started,
            "current": self.ended is None,
            "reason": self.reason,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "evicted_tokens": evicted,
            "generated_tokens": self.generated_tokens,
            "throughput_tokens_per_s": self.generated_tokens / duration,
            **self.latency(),
        }
