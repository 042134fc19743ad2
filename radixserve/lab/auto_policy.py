"""``--auto-policy``: switch the live policies to the shadow leader, with hysteresis.

The leader is the shadow pair with the best ``metric`` over the window (among pairs with at least
``min_requests`` finished in it). A switch happens only when the same leader has beaten the *shadow of the live
pair* -- simulated on the same trace with the same cost model, so like is compared with like -- by ``margin``
(relative) at every evaluation for ``hold_s`` of trace time, and ``cooldown_s`` after the last switch. Every
switch comes with its evidence in words.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Pair = tuple[str, str]
METRICS = {  # name -> True if larger is better
    "ttft_mean_s": False, "ttft_p50_s": False, "ttft_p99_s": False, "cold_ttft_p99_s": False, "hit_rate": True,
}


@dataclass
class Switch:
    at: float  # trace time (the live scheduler's clock)
    old: Pair
    new: Pair
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "from": {"eviction": self.old[0], "schedule": self.old[1]},
                "to": {"eviction": self.new[0], "schedule": self.new[1]}, "reason": self.reason}


@dataclass
class AutoPolicy:
    metric: str = "ttft_mean_s"
    margin: float = 0.1
    hold_s: float = 10.0
    cooldown_s: float = 30.0
    min_requests: int = 8
    switches: list[Switch] = field(default_factory=list)
    _leading: tuple[Pair, float] | None = None  # the challenger and since when it has led by the margin
    _live: Pair | None = None  # the live pair at the last evaluation
    _changed: float = float("-inf")  # when the live pair last changed (by us or by hand): the cooldown's start

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"--auto-policy-metric {self.metric!r}: choose one of {', '.join(METRICS)}")
        if self.margin < 0 or self.hold_s < 0 or self.cooldown_s < 0:
            raise ValueError("--auto-policy margin, hold and cooldown must be >= 0")

    def score(self, row: dict) -> float | None:
        value = row.get(self.metric)
        if value is None or row["requests"] < self.min_requests:
            return None
        return value if METRICS[self.metric] else -value  # larger score = better

    def leader(self, rows: list[dict]) -> dict | None:
        scored = [(self.score(r), r) for r in rows if r.get("error") is None and r.get("started") is None]
        scored = [(s, r) for s, r in scored if s is not None]
        return max(scored, key=lambda sr: sr[0])[1] if scored else None

    def decide(self, now: float, live: Pair, rows: list[dict]) -> Switch | None:
        """Called at each evaluation with the shadow rows; the switch to make now, if any (recorded)."""
        if live != self._live:  # a switch (ours, or by hand: that one is respected for a cooldown too)
            self._live, self._changed = live, now if self._live is not None else self._changed
            self._leading = None
        best = self.leader(rows)
        mine = next((r for r in rows if (r["eviction"], r["schedule"]) == live), None)
        if best is None or mine is None or mine.get("started") is not None or self.score(mine) is None:
            # (a live pair shadowed only since a hand switch has a colder cache: no fair baseline)
            self._leading = None
            return None
        pair = (best["eviction"], best["schedule"])
        ours, theirs = abs(mine[self.metric]), abs(best[self.metric])
        better = (theirs - ours if METRICS[self.metric] else ours - theirs) / max(ours, 1e-9)
        if pair == live or better <= self.margin:
            self._leading = None
            return None
        if self._leading is None or self._leading[0] != pair:
            self._leading = (pair, now)
        held = now - self._leading[1]
        cooled = now - self._changed >= self.cooldown_s
        if held < self.hold_s or not cooled:
            return None
        reason = (f"{pair[0]}/{pair[1]} {self.metric} {best[self.metric]:.4g} vs live {live[0]}/{live[1]} "
                  f"{mine[self.metric]:.4g} ({better:.0%} better, margin {self.margin:.0%}) over the last window "
                  f"({best['requests']} vs {mine['requests']} requests), leading for {held:.1f}s")
        switch = Switch(now, live, pair, reason)
        self.switches.append(switch)
        self._leading, self._live, self._changed = None, pair, now
        return switch
