"""The scheduler core: no torch, no I/O. It decides every batch and every KV slot; the runner only computes.

One step, in words: *prefill if something fits, else decode*. A prefill step continues the chunked request,
then admits waiting requests in the schedule policy's order while they fit. A decode step gives every running
request one more slot, first retracting the requests that lose least if the pool has run out.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from radixserve.actors.messages import ForwardPlan, ForwardResult, array
from radixserve.actors.scheduler.plan import build_plan
from radixserve.actors.scheduler.prefill import InBatchDedup, PrefillAdder
from radixserve.actors.scheduler.req import FinishReason, Req
from radixserve.actors.scheduler.stats import PolicyEpoch, SchedulerStats
from radixserve.cache.manager import CacheManager
from radixserve.policies.base import EvictionPolicy, SchedulePolicy
from radixserve.policies.schedule import FCFS
from radixserve.sampling_params import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128
POLICY_WINDOW = 1024  # the schedule policy orders the oldest this many waiting requests (keeps a step O(1))


@dataclass(frozen=True)
class SchedulerConfig:
    context_length: int
    vocab_size: int
    eos_ids: frozenset[int]
    max_running_requests: int = 128
    chunked_prefill_size: int = 2048  # <= 0: off
    max_prefill_tokens: int = 16384
    # Running requests rarely use all of max_new_tokens: admission reserves this fraction of it, decaying
    # while decoding goes well and reset when the pool runs out (then requests are retracted).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    clip_max_new_tokens: int = 4096
    check_invariants: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, policy: SchedulePolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.cache = cache
        self.policy = policy
        self.clock = clock
        self.live: dict[str, Req] = {}
        self.waiting: list[Req] = []  # in arrival order
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # mid-prefill: continues in the next prefill step
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self.schedule_fallback: SchedulePolicy = FCFS()
        self.policy_errors: list[str] = []
        self.epochs: list[PolicyEpoch] = []
        self._new_epoch()
        self._step = 0
        self._queue_version = 0  # bumped when requests join the queue (new or retracted)
        self._blocked: tuple[tuple[int, int], float] | None = None  # (queue, cache) state and room of the last
        # prefill that admitted nothing
        self._inflight: tuple[ForwardPlan, list[Req]] | None = None

    # -- requests in and out -----------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams, logprobs: int = -1,
                    priority: int = 0) -> Req:
        """Queue a request; ValueError (nothing queued) if it can never run. ``logprobs``: -1 none, else how many
        top alternatives to record with each output token's logprob."""
        if rid in self.live:
            raise ValueError(f"request id {rid!r} is already in use")
        max_new = self.validate(prompt_ids, params)
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.config.eos_ids
        req = Req(rid, list(prompt_ids), params, max_new, frozenset(stop_ids), arrival=self.clock(),
                  logprobs=logprobs, priority=priority)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)
        if max_new == 0:  # nothing to generate
            req.finish_reason = FinishReason("length")
            req.cached_tokens = 0
            return req
        self.live[rid] = req
        self.waiting.append(req)
        self._queue_version += 1
        return req

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against the model and the pool; returns the resolved max_new_tokens."""
        n, ctx, cap = len(prompt_ids), self.config.context_length, self.cache.capacity
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        limit = min(ctx, cap)
        if n >= ctx:
            raise ValueError(f"the prompt has {n} tokens; this model's context is {ctx} tokens "
                             "and at least one token must be generated")
        if n >= cap:
            raise ValueError(f"the prompt has {n} tokens; the KV pool holds only {cap} (--max-total-tokens)")
        if params.max_new_tokens is None:
            return min(DEFAULT_MAX_NEW_TOKENS, limit - n)
        if n + params.max_new_tokens > limit:
            what = f"the context length {ctx}" if ctx <= cap else f"the KV pool size {cap} (--max-total-tokens)"
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) = {n + params.max_new_tokens} "
                f"exceeds {what}; lower max_new_tokens to at most {limit - n}"
            )
        return params.max_new_tokens

    def finish(self, rid: str, reason: FinishReason) -> Req | None:
        """End a request now (stop string found, client gone, abort); its KV stays cached as evictable."""
        req = self.live.get(rid)
        if req is None:
            return None
        req.finish_reason = reason
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        return req

    @property
    def inflight(self) -> list[Req]:
        """The requests of the plan being computed, in batch order (empty when none is)."""
        return list(self._inflight[1]) if self._inflight else []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # -- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> ForwardPlan | None:
        """The next batch, or None when there is nothing to run."""
        assert self._inflight is None, "process() the result of the previous plan first"
        return self._schedule_prefill() or self._schedule_decode()

    def process(self, result: ForwardResult) -> list[Req]:
        """Apply the runner's tokens. Returns the requests that got a token (finished ones included)."""
        assert self._inflight is not None and self._inflight[0].step == result.step, "result for another step"
        plan, reqs = self._inflight
        self._inflight = None
        updated = []
        logprobs = _Logprobs(result, reqs)
        now = self.clock()
        for i, (req, next_id) in enumerate(zip(reqs, array(result.next_ids).tolist())):
            if req.finished:  # aborted while its step ran
                continue
            if plan.mode == "extend":  # what was just computed is reusable by others at once (kept locked)
                self.cache.cache_prefix(req.kv, req.fill_ids)
            if next_id < 0:  # a prefill chunk that is not the last
                continue
            if req is self.chunked:
                self.chunked = None
            req.output_ids.append(next_id)
            if req.first_token_at is None:
                req.first_token_at = now
            if req.logprobs >= 0:
                req.output_logprobs.append(logprobs.of(i))
            self.stats.generated_tokens += 1
            self.epochs[-1].generated_tokens += 1
            updated.append(req)
            req.finish_reason = req.check_finished()
            if req.finished:
                self._release(req)
            elif plan.mode == "extend":
                self.running.append(req)
        if plan.mode == "decode":  # finished requests already left `running` in _release
            self.new_token_ratio = max(self.config.min_new_token_ratio,
                                       self.new_token_ratio - self.config.new_token_ratio_decay)
        self.stats.steps += 1
        if self.config.check_invariants:
            self.check()
        return updated

    def _schedule_prefill(self) -> ForwardPlan | None:
        if not self.waiting and self.chunked is None:
            return None
        cfg = self.config
        chunking = cfg.chunked_prefill_size > 0
        reserved = sum(map(self._future_tokens, self.running))
        room_tokens = self.cache.available - reserved
        state = (self._queue_version, self.cache.version)
        if self._blocked is not None and self.running and self._blocked[0] == state and room_tokens <= self._blocked[1]:
            return None  # nothing fitted last time; same queue, same cache, no more room: it would not fit now
        adder = PrefillAdder(
            self.cache,
            token_budget=cfg.chunked_prefill_size if chunking else cfg.max_prefill_tokens,
            chunking=chunking,
            reserved=reserved,
            new_token_ratio=self.new_token_ratio,
            clip_max_new_tokens=cfg.clip_max_new_tokens,
        )
        if self.chunked is not None and not adder.add(self.chunked):
            return None  # the chunked request goes first; until it fits, decoding frees room
        room = cfg.max_running_requests - len(self.running) - (self.chunked is not None)
        if self.waiting and room > 0:
            dedup = InBatchDedup(self.cache) if getattr(self.policy, "cache_aware", False) and self.cache.tree else None
            for req in self._ordered_waiting()[:room]:
                if dedup is not None and dedup.defer(req, bool(adder.reqs)):
                    continue  # shares a prefix that this step computes for another request: reuse it next step
                if not adder.add(req):
                    break
                if dedup is not None:
                    dedup.admitted(req)
        if not adder.reqs:
            self._blocked = (state, room_tokens)
            return None
        self._blocked = None
        admitted = {id(r) for r in adder.reqs}
        head = self.waiting[:POLICY_WINDOW]  # everything admitted came from the window
        self.waiting = [r for r in head if id(r) not in admitted] + self.waiting[POLICY_WINDOW:]
        if adder.partial is not None:
            self.chunked = adder.partial
        return self._launch("extend", adder.reqs, adder.starts)

    def _schedule_decode(self) -> ForwardPlan | None:
        if not self.running:
            return None
        while self.cache.available < len(self.running) and self._retract_one():
            pass
        starts = [r.kv_len for r in self.running]
        for req in self.running:
            ok = self.cache.extend(req.kv, 1)
            assert ok, "a lone request always fits: validate() caps prompt + max_new_tokens at the pool size"
        return self._launch("decode", list(self.running), starts)

    def _launch(self, mode, reqs: list[Req], starts: list[int]) -> ForwardPlan:
        self._step += 1
        plan = build_plan(self._step, mode, reqs, starts)
        self._inflight = (plan, reqs)
        return plan

    # -- statistics --------------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        """Pool state now, totals since start, and one record per policy epoch (GET /cache/stats)."""
        cache, st, now = self.cache, self.stats, self.clock()
        prompt = sum(e.prompt_tokens for e in self.epochs)  # of finished requests, like cached
        cached = sum(e.cached_tokens for e in self.epochs)
        return {
            "pool": {"capacity": cache.capacity, "free": cache.allocator.num_free, "evictable": cache.evictable,
                     "protected": cache.protected, "owned_by_requests": cache.owned_by_requests},
            "totals": {"requests_received": st.requests, "requests_finished": sum(e.requests for e in self.epochs),
                       "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
                       "generated_tokens": st.generated_tokens, "evicted_tokens": cache.evicted_tokens,
                       "retractions": st.retractions, "steps": st.steps},
            "epochs": [e.to_dict(now, cache.evicted_tokens) for e in self.epochs],
        }

    # -- policies ----------------------------------------------------------------------------------------
    def set_policies(self, eviction: EvictionPolicy | None = None, schedule: SchedulePolicy | None = None) -> None:
        """Swap policies between steps: no cached entry and no request is lost; a new stats epoch starts.
        ValueError (nothing changed) if the eviction policy fails on the current cache."""
        if eviction is not None:
            self.cache.set_eviction_policy(eviction)
        if schedule is not None:
            self.schedule_fallback, self.policy = self.policy, schedule
        self._new_epoch()

    def switch_policies(self, eviction: str | None = None, schedule: str | None = None) -> None:
        """``set_policies`` by registered name (built-in or plugin); ValueError naming the problem."""
        from radixserve.policies import load_eviction_policy, load_schedule_policy

        if eviction is None and schedule is None:
            raise ValueError("give an eviction and/or a schedule policy name")
        self.set_policies(load_eviction_policy(eviction) if eviction else None,
                          load_schedule_policy(schedule) if schedule else None)

    def policies_info(self) -> dict:
        """What GET /policies shows: the current policies, the available ones, errors of failed policies."""
        from radixserve.policies import available

        errors = self.policy_errors + (self.cache.tree.policy_errors if self.cache.tree else [])
        return {"eviction": {"current": self.cache.eviction_policy.name, "available": available("eviction")},
                "schedule": {"current": self.policy.name, "available": available("schedule")},
                "errors": errors[-20:]}

    def _new_epoch(self) -> None:
        now = self.clock()
        if self.epochs:
            self.epochs[-1].close(now, self.cache.evicted_tokens)
        self.epochs.append(PolicyEpoch(self.cache.eviction_policy.name, self.policy.name, now,
                                       self.cache.evicted_tokens))

    def _ordered_waiting(self, attempt: int = 0) -> list[Req]:
        """The oldest POLICY_WINDOW waiting requests in the policy's order. A policy that raises, or (a plugin)
        loses or invents requests, is replaced by the one before it (FCFS at worst), the error is kept in
        policy_errors, and scheduling goes on."""
        window = self.waiting[:POLICY_WINDOW]
        try:
            ordered = self.policy.order(list(window), self.cache, self.clock())
            if not type(self.policy).__module__.startswith("radixserve.") and (
                    len(ordered) != len(window) or {id(r) for r in ordered} != {id(r) for r in window}):
                raise ValueError("order() did not return a permutation of the waiting requests")
            return ordered
        except Exception as exc:
            bad = self.policy
            self.policy = self.schedule_fallback if self.schedule_fallback is not bad else FCFS()
            self.schedule_fallback = FCFS()
            self.policy_errors.append(f"schedule policy {bad.name!r} raised {type(exc).__name__}: {exc}; "
                                      f"switched to {self.policy.name!r}")
            self._new_epoch()
            if attempt >= 2:  # not even the fallbacks work: arrival order needs no policy at all
                return window
            return self._ordered_waiting(attempt + 1)

    # -- retraction --------------------------------------------------------------------------------------
    def _future_tokens(self, req: Req) -> float:
        return min(req.max_new_tokens - len(req.output_ids), self.config.clip_max_new_tokens) * self.new_token_ratio

    def _retract_one(self) -> bool:
        """Send back to the queue the request whose retraction loses least: the one mid-prefill, else the one
        with the fewest generated tokens (longest first on ties, it frees most). Its KV goes to the tree, so
        whatever survives eviction is reused when it comes back. False if only one request is left."""
        candidates = ([self.chunked] if self.chunked else []) + (self.running if len(self.running) > 1 else [])
        if not candidates:
            return False
        victim = min(candidates, key=lambda r: (r is not self.chunked, len(r.output_ids), -r.seq_len))
        self._release(victim)
        bisect.insort(self.waiting, victim, key=lambda r: r.arrival)  # back in line where it arrived
        self._queue_version += 1
        self.stats.retractions += 1
        self.new_token_ratio = self.config.init_new_token_ratio
        return True

    def _release(self, req: Req) -> None:
        """Drop ``req`` from the running set and close its KV (computed tokens go to the tree)."""
        if req.kv is not None:
            self.cache.close(req.kv, req.fill_ids)
            req.kv = None
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        if req.finished:
            self.live.pop(req.rid, None)
            self.stats.cached_tokens += req.cached_tokens or 0
            ttft = req.first_token_at - req.arrival if req.first_token_at is not None else None
            self.epochs[-1].finished(len(req.prompt_ids), req.cached_tokens or 0, ttft)

    # -- invariants --------------------------------------------------------------------------------------
    def check(self) -> None:
        """Pool accounting and queue consistency (tests call this after every step)."""
        holders = [r for r in self.live.values() if r.kv is not None]
        self.cache.check(r.kv for r in holders)
        assert all(r.kv is None for r in self.waiting), "a waiting request holds KV"
        assert all(r.kv is not None and r.extend_len == 1 for r in self.running), "a running request is not decoding"
        assert len({id(r) for r in self.waiting + self.running}) == len(self.waiting) + len(self.running)
        assert len(self.running) + (self.chunked is not None) <= self.config.max_running_requests
        assert not any(r.finished for r in self.live.values()), "a finished request is still live"


def build_scheduler(args, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> Scheduler:
    """The scheduler a server or Engine runs: cache manager and policies named by ``args`` (ServerArgs)."""
    from radixserve.policies import load_eviction_policy, load_schedule_policy

    cache = CacheManager(args.max_total_tokens, load_eviction_policy(args.eviction_policy),
                         disable_radix_cache=args.disable_radix_cache, clock=clock)
    return Scheduler(config, cache, load_schedule_policy(args.schedule_policy), clock=clock)


class _Logprobs:
    """Reads a ForwardResult's logprob arrays: the alternatives of request i follow those of every earlier
    request in the batch that sampled with logprobs > 0."""

    def __init__(self, result: ForwardResult, reqs: list[Req]) -> None:
        self.chosen = array(result.logprob, np.float32)
        self.top_ids = array(result.top_ids).tolist()
        self.top_lp = array(result.top_logprobs, np.float32).tolist()
        self.spans: dict[int, tuple[int, int]] = {}
        at = 0
        for i, (req, next_id) in enumerate(zip(reqs, array(result.next_ids))):
            if next_id >= 0 and req.logprobs > 0:
                self.spans[i] = (at, at + req.logprobs)
                at += req.logprobs

    def of(self, i: int) -> tuple[float, list[tuple[int, float]]]:
        start, end = self.spans.get(i, (0, 0))
        return float(self.chosen[i]), list(zip(self.top_ids[start:end], self.top_lp[start:end]))
