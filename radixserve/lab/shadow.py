"""Shadow policies: while the server runs, every listed (eviction, schedule) pair replays the live request trace
in the simulator -- the real scheduler, cache manager and policies on a simulated clock -- so each pair's hit
rate, evictions and TTFT say what *it* would have done on this traffic, had it been in charge from the start.

The trace comes from the live scheduler (``ShadowFeed``: arrivals with their token ids, each request's output
once it has ended, step timings). A pair may only simulate time up to the *horizon*, the arrival of the oldest
live request whose output is not yet known: past it, an arrival the shadow has not heard of yet could change what
the pair would have done. The horizon trails the live clock by the age of the oldest live request (``lag_s``)::

    live clock ──────────────────────────────────────────────────────▶ now
    requests   ▕ended▏▕ended▏▕ live, output unknown ......▏▕ live ...▏
    simulated  ├─────────────────────────────────────┤ horizon = arrival of the oldest live one
               released to every pair, in arrival order

The cost model is refitted from the live server's own step timings (``fit_cost``), so simulated TTFT is in the
live server's seconds. Statistics are over a sliding window of simulated time (the last ``window_s``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from radixserve.actors.scheduler import Scheduler, SchedulerConfig
from radixserve.actors.scheduler.stats import latency_summary
from radixserve.cache import CacheManager
from radixserve.errors import InvalidRequest
from radixserve.lab.sim_drafts import DraftSim
from radixserve.lab.sim_tiers import SimTiers, TierSpec
from radixserve.lab.simulate import CostModel, CostModelRunner, SimClock
from radixserve.policies import available, load_eviction_policy, load_schedule_policy
from radixserve.sampling_params import SamplingParams
from radixserve.wire.messages import ShadowFeed

log = logging.getLogger(__name__)

Pair = tuple[str, str]  # (eviction, schedule)
MAX_LAG_S = 60.0  # a live request older than this is released with its output budget as a stand-in output
MIN_FIT_SAMPLES = 8
MAX_BACKLOG = 20000  # released requests a pair may be behind before it is stopped
ARRIVAL_SLACK_S = 1.0  # an arrival reaches the shadow within this long (the scheduler feeds it every 0.2 s)


def resolve_pairs(spec: str, live: Pair) -> list[Pair]:
    """``all``, or comma-separated names: ``ev:sc`` is one pair; an eviction name or a schedule name (a name that
    is both counts as both) joins its list, and the lists are crossed, the live policy standing in for an empty
    one. The live pair is always included, first. ValueError names an unknown policy."""
    evictions, schedules = available("eviction"), available("schedule")
    if spec.strip() == "all":
        pairs = list(itertools.product(evictions, schedules))
    else:
        explicit, evs, scs = [], [], []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if ":" in item:
                ev, _, sc = item.partition(":")
                for kind, name, names in (("eviction", ev, evictions), ("schedule", sc, schedules)):
                    if name not in names:
                        raise ValueError(f"--shadow-policies: unknown {kind} policy {name!r} in {item!r}; "
                                         f"available: {', '.join(names)}")
                explicit.append((ev, sc))
                continue
            if item not in evictions and item not in schedules:
                raise ValueError(f"--shadow-policies: {item!r} is neither an eviction policy ({', '.join(evictions)})"
                                 f" nor a schedule policy ({', '.join(schedules)})")
            evs += [item] if item in evictions else []
            scs += [item] if item in schedules else []
        crossed = itertools.product(evs or [live[0]], scs or [live[1]]) if evs or scs else ()
        pairs = explicit + list(crossed)
    return list(dict.fromkeys([live, *pairs]))


def fit_cost(samples: Iterable[tuple[str, int, int, float]], base: CostModel) -> CostModel:
    """The four costs fitted (least squares, clipped at 0) to ``(mode, tokens, batch, seconds)`` step timings;
    a part with too few or too uniform samples keeps ``base``'s numbers."""
    ext = np.array([(t, s) for m, t, _, s in samples if m == "extend"], dtype=float).reshape(-1, 2)
    dec = np.array([(b, s) for m, _, b, s in samples if m == "decode"], dtype=float).reshape(-1, 2)
    cost = base
    if len(ext) >= MIN_FIT_SAMPLES:
        if np.ptp(ext[:, 0]) > 0:
            per_token, overhead = map(float, np.polyfit(ext[:, 0], ext[:, 1], 1))
        else:  # every step the same size: the overhead cannot be told apart; at most half the step is overhead
            overhead = min(cost.step_overhead, float(ext[:, 1].mean()) / 2)
            per_token = float((ext[:, 1].mean() - overhead) / max(ext[0, 0], 1))
        cost = dataclasses.replace(cost, prefill_per_token=max(per_token, 1e-7), step_overhead=max(overhead, 0.0))
    if len(dec) >= MIN_FIT_SAMPLES:
        if np.ptp(dec[:, 0]) > 0:
            per_seq, per_step = map(float, np.polyfit(dec[:, 0], dec[:, 1], 1))
        else:
            per_seq, per_step = cost.decode_per_seq, float(dec[:, 1].mean() - cost.decode_per_seq * dec[0, 0])
        cost = dataclasses.replace(cost, decode_per_seq=max(per_seq, 0.0),
                                   decode_per_step=max(per_step - cost.step_overhead, 0.0))
    return cost


@dataclass(eq=False, slots=True)
class TraceEntry:
    rid: str
    at: float  # the live scheduler's arrival time
    prompt: np.ndarray  # int32: a long backlog stays 4 bytes a token
    max_new_tokens: int
    priority: int
    output: list[int] | None = None  # known once the live request has ended
    admitted: bool = True  # False: it ended live before it was ever admitted
    seen: float = 0.0  # wall time the shadow heard of it


@dataclass(slots=True)
class Done:
    """One request a pair finished: what the window statistics are made of."""

    at: float  # simulated time it finished
    ttft: float
    wait: float | None
    prompt: int
    cached: int
    evicted_total: int  # the pair's evicted tokens when it finished


class PairSim:
    """One pair's counterfactual: its own scheduler and cache on its own simulated clock."""

    def __init__(self, pair: Pair, capacity: int, config: SchedulerConfig, cost: CostModel,
                 tiers: TierSpec | None = None) -> None:
        """``tiers``: the KV tiers below the pool, as the live server has them (its write policy, or another
        one's for a write-policy shadow)."""
        self.pair = pair
        self.clock = SimClock()
        self.cache = CacheManager(capacity, load_eviction_policy(pair[0]), clock=self.clock)
        self.tiers = SimTiers(tiers, self.clock) if tiers is not None else None
        if self.tiers is not None:
            self.cache.attach_tiers(self.tiers.scheduler_side)
        self.sched = Scheduler(config, self.cache, load_schedule_policy(pair[1]), clock=self.clock)
        self.outputs: dict[str, list[int]] = {}
        self.runner = CostModelRunner(cost, self.clock, self.outputs, self.tiers)
        self.cursor = 0  # the next released entry to add
        self.done: deque[Done] = deque()
        self.evicted_before = 0  # the pair's evicted tokens when the window's first request finished
        self.rejected = 0
        self.error: str | None = None
        self.started: float | None = None  # the live time it joined (a pair added while the server ran)

    def run(self, released: list[TraceEntry], offset: int, horizon: float, max_steps: int) -> bool:
        """Add released requests and take steps up to ``horizon``; True if it stopped early (work left)."""
        sched, clock = self.sched, self.clock
        for _ in range(max_steps):
            nxt = released[self.cursor - offset] if self.cursor - offset < len(released) else None
            if nxt is not None and (not sched.has_work or nxt.at <= clock.now):
                clock.now = max(clock.now, nxt.at)
                self.add(nxt)
                continue
            if not sched.has_work or clock.now >= horizon:
                return False
            plan = sched.schedule()
            if plan is None and self.tiers is not None and sched.held:  # pages asked for again: answered at once
                self.tiers.answer(sched)
                plan = sched.schedule()
            if plan is None:  # nothing fits until a request ends or arrives
                if nxt is None:
                    raise RuntimeError(f"the simulated scheduler of {self.pair} stalled with work left")
                clock.now = max(clock.now, nxt.at)
                continue
            for req in sched.process(self.runner.forward(plan, sched.inflight)):
                if req.finished:
                    self.outputs.pop(req.rid, None)
                    ttft = req.ttft if req.ttft is not None else clock.now - req.arrival
                    self.done.append(Done(clock.now, ttft, req.queue_wait, len(req.prompt_ids),
                                          req.cached_tokens or 0, self.cache.evicted_tokens))
        return True

    def add(self, entry: TraceEntry) -> None:
        self.cursor += 1
        output = entry.output or []
        self.outputs[entry.rid] = output  # a client may reuse a rid, but never while it is live
        params = SamplingParams(max_new_tokens=len(output), temperature=0, ignore_eos=True)
        try:
            self.sched.add_request(entry.rid, entry.prompt.tolist(), params, priority=entry.priority,
                                   arrival=entry.at)
            if self.tiers is not None:
                self.tiers.answer(self.sched)
        except InvalidRequest:  # cannot happen with the live server's own limits; counted, never fatal
            self.rejected += 1
            del self.outputs[entry.rid]

    def window(self, now: float, window_s: float) -> dict:
        """Statistics of the requests finished in the last ``window_s`` of simulated time before ``now``."""
        while self.done and self.done[0].at < now - window_s:
            self.evicted_before = self.done.popleft().evicted_total
        recent = list(self.done)
        prompt, cached = sum(d.prompt for d in recent), sum(d.cached for d in recent)
        ttft = [d.ttft for d in recent]
        return {
            "eviction": self.pair[0], "schedule": self.pair[1], "requests": len(recent),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "evicted_tokens": (recent[-1].evicted_total if recent else self.cache.evicted_tokens) - self.evicted_before,
            **latency_summary(ttft, [d.ttft for d in recent if d.cached == 0],
                              [d.wait for d in recent if d.wait is not None]),
            "simulated_to": self.clock.now, "behind_s": max(now - self.clock.now, 0.0) if self.sched.has_work else 0.0,
            "rejected": self.rejected, "error": self.failure(),
            **(self.tier_row() if self.tiers is not None else {}),
        }

    def tier_row(self) -> dict:
        """With tiers: the write policy and each tier's share of the admitted prompt tokens (since the start)."""
        c = self.cache.tiers.counters
        return {"write": self.tiers.spec.write,
                "tier_hit_rates": {f"L{i + 1}": n / c.prompt_tokens if c.prompt_tokens else 0.0
                                   for i, n in enumerate(c.hit_tokens)}}

    def failure(self) -> str | None:
        """Why the pair's numbers are not its own: its simulation raised, or one of its policies did and was
        replaced by a fallback (so the numbers are the fallback's)."""
        errors = list(self.sched.policies.errors) + (list(self.cache.tree.policy_errors) if self.cache.tree else [])
        return self.error or (errors[0] if errors else None)


@dataclass
class ShadowLab:
    """Every shadow pair, fed the live trace; no I/O (the shadow actor and the tests drive it)."""

    pairs: list[Pair]
    config: SchedulerConfig
    window_s: float = 60.0
    cost: CostModel = field(default_factory=CostModel)
    sims: dict[Pair, PairSim] = field(default_factory=dict)
    live: Pair | None = None
    capacity: int | None = None
    horizon: float = 0.0
    live_now: float = 0.0
    requests_seen: int = 0
    calibrated: bool = False  # ``cost`` already fits the server; else nothing is simulated before a fit (``ready``)
    tiers: TierSpec | None = None  # the live server's KV tiers: every pair is simulated with them
    writes: dict[str, PairSim] = field(default_factory=dict)  # with tiers: the first live pair under each other
    # write policy (compared in report()["writes"], never switched to by --auto-policy)

    def __post_init__(self) -> None:
        # the trace holds ranks (priority.py), not the clients' values; the live queue limit already ran
        priority = dataclasses.replace(self.config.priority, low_values_first=False, max_queued=None)
        self.config = dataclasses.replace(self.config, eos_ids=frozenset(), queue_timeout_s=None,
                                          check_invariants=False, priority=priority, logit_processors=())
        self.pending: deque[TraceEntry] = deque()  # arrived, in arrival order, not yet released
        self.by_rid: dict[tuple[str, float], TraceEntry] = {}  # (rid, arrival): a client may reuse a rid
        self.released: list[TraceEntry] = []
        self.offset = 0  # entries before released[0] were added by every pair and dropped
        self.timings: deque[tuple[str, int, int, float]] = deque(maxlen=1024)
        self.first_fed: float | None = None
        self.broken: dict[Pair, str] = {}  # pairs whose policies failed to load, and why
        # with --speculative-algorithm: every draft policy, drafting as the server's does
        self.drafts = draft_sims(self.config.draft_tokens, self.config.draft_options.width)
        self.gaps = 0  # times the scheduler dropped trace the shadow could not take

    # -- the trace in -----------------------------------------------------------------------------------
    def feed(self, msg: ShadowFeed, wall: float | None = None) -> None:
        wall = time.monotonic() if wall is None else wall
        self.first_fed = wall if self.first_fed is None else self.first_fed
        self.live, self.live_now = (msg.eviction, msg.schedule), msg.now
        if self.capacity is None:
            self.capacity = msg.capacity
            for pair in self.pairs:
                self._add_pair(pair)
            self._add_write_shadows()
        if self.live not in self.sims and self.live not in self.broken:  # switched by hand to a pair that was not
            if self._add_pair(self.live) is not None:                     # shadowed: shadow it from now on
                self.pairs.append(self.live)
                self.sims[self.live].started = msg.now
        if msg.dropped:  # the scheduler dropped trace it could not send: what is pending will never end
            self.gaps += 1
            self.pending.clear()
            self.by_rid.clear()
        for a in msg.arrivals:
            entry = TraceEntry(a.rid, a.at, a.prompt, a.max_new_tokens, a.priority, seen=wall)
            self.pending.append(entry)
            self.by_rid[(a.rid, a.at)] = entry
            self.requests_seen += 1
        for e in msg.ends:
            if (entry := self.by_rid.pop((e.rid, e.at), None)) is not None:
                entry.output = e.output.tolist()
                entry.admitted = e.admitted
                if e.greedy and entry.output:
                    self._draft(entry)
        if msg.steps:  # refitted before anything is simulated with them: simulated time is live time
            self.timings.extend((t.mode, t.tokens, t.batch, t.seconds) for t in msg.steps)
            self.refit()
        self._release(wall)

    def ready(self, wall: float) -> bool:
        """Whether simulating may start: a cost model that was never fitted would make every pair's first
        minutes wrong (queues that the server never had), so the first steps wait for MIN_FIT_SAMPLES timings
        of each step kind -- or MAX_LAG_S, for traffic that never decodes."""
        if not self.calibrated:
            kinds = [m for m, *_ in self.timings]
            self.calibrated = min(kinds.count("extend"), kinds.count("decode")) >= MIN_FIT_SAMPLES or (
                self.first_fed is not None and wall - self.first_fed > MAX_LAG_S)
        return self.calibrated

    def _draft(self, entry: TraceEntry) -> None:
        """Every draft policy's drafts for a greedy request that ended, against its output (a policy that
        raises is dropped, with why)."""
        prompt = entry.prompt.tolist()
        for name, sim in list(self.drafts.items()):
            try:
                sim.add(prompt, entry.output)
            except Exception:
                log.exception("draft policy %r failed in the shadow; it is dropped", name)
                del self.drafts[name]

    def _add_pair(self, pair: Pair) -> PairSim | None:
        """Start shadowing ``pair``; None (kept in ``broken`` with the reason) if one of its policies fails to
        load -- a plugin's bug stops that pair, never the shadow."""
        try:
            sim = PairSim(pair, self.capacity, self.config, self.cost, self.tiers)
        except Exception as exc:
            log.error("shadow pair %s/%s cannot run: %s", *pair, exc)
            self.broken[pair] = f"{type(exc).__name__}: {exc}"
            return None
        sim.cursor = self.offset + len(self.released)  # a pair joining late starts with the next request
        self.sims[pair] = sim
        return sim

    def _add_write_shadows(self) -> None:
        """With tiers: the live pair once more under every other registered write policy."""
        if self.tiers is None or self.live is None:
            return
        from radixserve.policies import available

        for write in available("write"):
            if write == self.tiers.write:
                continue
            try:
                self.writes[write] = PairSim(self.live, self.capacity, self.config, self.cost,
                                             dataclasses.replace(self.tiers, write=write))
            except Exception as exc:  # a plugin's bug: that write policy is not shadowed
                log.error("shadow of write policy %s cannot run: %s", write, exc)
                continue
            self.writes[write].cursor = self.offset + len(self.released)

    def _all(self) -> list[PairSim]:
        return [*self.sims.values(), *self.writes.values()]

    def _release(self, wall: float) -> None:
        while self.pending and (self.pending[0].output is not None or wall - self.pending[0].seen > MAX_LAG_S):
            entry = self.pending.popleft()
            if entry.output is None:  # still running live after MAX_LAG_S: its budget stands in for its output
                self.by_rid.pop((entry.rid, entry.at), None)  # (those tokens, not its real answer, get cached)
                entry.output = [0] * entry.max_new_tokens
            if entry.admitted:  # one that ended before it ever ran (aborted, timed out) computed nothing live
                self.released.append(entry)
        self.horizon = self.pending[0].at if self.pending else self.live_now

    # -- simulating --------------------------------------------------------------------------------------
    def advance(self, budget_s: float, wall: float | None = None, steps_per_turn: int = 64) -> bool:
        """Simulate every pair towards the horizon, round robin, for at most ``budget_s`` of CPU; True if some
        pair still has work before the horizon. ``wall``: the live clock now -- with no live request pending,
        every arrival older than ARRIVAL_SLACK_S has been fed, so the horizon moves on with it (a pair slower
        than the server catches up while it idles). A pair whose simulation raises is stopped and says why."""
        if wall is not None and not self.pending:
            self.horizon = max(self.horizon, wall - ARRIVAL_SLACK_S)
        if not self.ready(time.monotonic() if wall is None else wall):
            return False
        deadline = time.process_time() + budget_s
        behind = [s for s in self._all() if s.error is None]
        while behind and time.process_time() < deadline:
            for sim in list(behind):
                try:
                    more = sim.run(self.released, self.offset, self.horizon, steps_per_turn)
                except Exception as exc:
                    log.exception("shadow pair %s failed; it is stopped", sim.pair)
                    sim.error, more = f"{type(exc).__name__}: {exc}", False
                if not more:
                    behind.remove(sim)
        self._compact()
        return bool(behind)

    def _compact(self) -> None:
        """Drop the released requests every pair has added; a pair more than MAX_BACKLOG requests behind the
        newest is stopped (it could never catch up, and its backlog would grow without bound)."""
        newest = self.offset + len(self.released)
        for sim in self._all():
            if sim.error is None and newest - sim.cursor > MAX_BACKLOG:
                sim.error = f"fell more than {MAX_BACKLOG} requests behind the live traffic; stopped"
                log.error("shadow pair %s/%s %s", *sim.pair, sim.error)
        low = min((s.cursor for s in self._all() if s.error is None), default=newest)
        if low - self.offset > 1024:
            del self.released[:low - self.offset]
            self.offset = low

    def refit(self) -> None:
        self.cost = fit_cost(self.timings, self.cost)
        for sim in self._all():
            sim.runner.cost = self.cost

    # -- the numbers out -----------------------------------------------------------------------------------
    def pair_stats(self) -> list[dict]:
        now = min(self.horizon, max((s.clock.now for s in self.sims.values()), default=self.horizon))
        rows = []
        for pair, sim in self.sims.items():
            row = sim.window(now, self.window_s)
            row["live"] = pair == self.live
            row["started"] = sim.started
            rows.append(row)
        return rows

    def report(self, rows: list[dict] | None = None) -> dict:
        return {
            "enabled": True, "window_s": self.window_s, "live": pair_dict(self.live) if self.live else None,
            "lag_s": max(self.live_now - self.horizon, 0.0), "requests_seen": self.requests_seen,
            "pending": len(self.pending), "cost_model": dataclasses.asdict(self.cost), "gaps": self.gaps,
            "failed_pairs": [{**pair_dict(p), "error": e} for p, e in self.broken.items()],
            "pairs": rows if rows is not None else self.pair_stats(),
            **({"writes": self.write_stats()} if self.writes else {}),
            **({"drafts": [sim.stats.as_dict() for sim in self.drafts.values()]} if self.drafts else {}),
        }

    def write_stats(self) -> list[dict]:
        """The live pair (when the shadow started) under each write policy: the live one's row, then the others."""
        first = next(iter(self.writes.values()))
        sims = ([self.sims[first.pair]] if first.pair in self.sims else []) + list(self.writes.values())
        now = min(self.horizon, max((s.clock.now for s in sims), default=self.horizon))
        return [sim.window(now, self.window_s) for sim in sims]


SHADOWLESS_DRAFTS = ("none", "draft-model")  # nothing to measure; a second model to run for every request


def draft_sims(k: int, width: int = 1) -> dict[str, DraftSim]:
    """A simulator for each installed draft policy that can shadow (``k`` tokens a draft, trees up to ``width``
    children a token; none when ``k`` is 0)."""
    sims = {}
    for name in available("draft") if k else []:
        if name in SHADOWLESS_DRAFTS:
            continue
        try:
            sims[name] = DraftSim(name, k, width)
        except ValueError:
            log.exception("draft policy %r cannot shadow", name)
    return sims


def pair_dict(pair: Pair) -> dict[str, str]:
    return {"eviction": pair[0], "schedule": pair[1]}
