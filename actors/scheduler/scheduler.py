"""The scheduler core: no torch, no I/O. It decides every batch and every KV slot; the runner only computes.

One step, in words: *prefill if something fits, else decode*. A prefill step continues the chunked request,
then admits waiting requests in the schedule policy's order while they fit. A decode step gives every running
request one more slot, first retracting the requests that lose least if the pool has run out.

A request fails alone: one that waited past the queue timeout, or broke while its step was planned or sampled,
ends with a ``RequestError`` (collected in ``failures``) and gives back its KV; the others go on.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.actors.scheduler.plan import Step, build_plan, plannable
from radixserve.actors.scheduler.policy_switch import Policies
from radixserve.actors.scheduler.preempt import preempt_for, preempt_rule
from radixserve.actors.scheduler.prefill import InBatchDedup, PrefillAdder, future_tokens
from radixserve.actors.scheduler.priority import PriorityConfig
from radixserve.actors.scheduler.req import FinishReason, Req
from radixserve.actors.scheduler.runner_state import RunnerState
from radixserve.actors.scheduler.shadow_tap import ShadowTap
from radixserve.actors.scheduler.speculate import Speculation
from radixserve.actors.scheduler.stats import SchedulerStats
from radixserve.actors.scheduler.validate import check_request
from radixserve.cache.invariants import require
from radixserve.cache.manager import CacheManager
from radixserve.cache.tiers import TierConfig
from radixserve.errors import InvalidRequest
from radixserve.logit_processors import ProcessorCatalog
from radixserve.policies.base import SchedulePolicy
from radixserve.policies.drafts import DraftOptions
from radixserve.sampling_params import SamplingParams
from radixserve.wire.messages import RequestError
from radixserve.wire.plans import ForwardPlan, ForwardResult, Prefetched

log = logging.getLogger(__name__)

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
    queue_timeout_s: float | None = None  # a request not started within this long fails (503); None: never
    priority: PriorityConfig = PriorityConfig()  # --enable-priority-scheduling and its flags (priority.py)
    logit_processors: tuple[str, ...] = ()  # the named logit processors requests may use (--logit-processors)
    tiers: TierConfig | None = None  # --enable-hierarchical-cache: pages below the pool (cache/tiers.py)
    draft_policy: str = "none"  # speculative decoding (speculate.py): where drafts come from
    draft_tokens: int = 0  # ... and how many tokens a draft may have (0: off)
    draft_options: DraftOptions = DraftOptions()  # ... for a policy that takes them (the draft model's path)
    draft_sampled: bool = True  # ... sampled requests too (False under --random-seed: their tokens must not
    # depend on which steps drafted)
    overlap: bool = False  # plan the next decode step while this one computes (schedule_ahead; the actor's)
    check_invariants: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, policy: SchedulePolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.cache = cache
        self.clock = clock
        self.live: dict[str, Req] = {}
        self.waiting: list[Req] = []  # in arrival order
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # mid-prefill: continues in the next prefill step
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self.policies = Policies(cache, policy, clock, self.stats)  # policies, switching, epochs, GET /cache/stats
        self.failures: list[RequestError] = []  # requests that failed since the caller last took them
        self._step = 0
        self._queue_version = 0  # bumped when requests join the queue (new or retracted)
        self._blocked: tuple[tuple[int, int], float] | None = None  # (queue, cache) state and room of the last
        # prefill that admitted nothing
        self._inflight: Step | None = None
        self._ahead: Step | None = None  # overlap: the decode step planned to follow _inflight (schedule_ahead)
        self.runner_state = RunnerState(config.max_running_requests + 1)  # table rows and grammars, per request
        self.tap: ShadowTap | None = None  # --shadow-policies: the live trace for the shadow process
        self.processors = ProcessorCatalog(config.logit_processors)  # checks requests' custom_logit_processor
        self.spec = Speculation(config.draft_policy, config.draft_tokens, config.vocab_size, config.draft_sampled,
                                config.draft_options)
        self.policies.speculation = self.spec

    @property
    def policy(self) -> SchedulePolicy:
        return self.policies.policy

    # -- requests in and out -----------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams, top_logprobs: int | None = None,
                    priority: int | None = None, logprob_start: int | None = None, arrival: float | None = None,
                    output_interval: int = 1) -> Req:
        """Queue a request; InvalidRequest (nothing queued) if it can never run. ``top_logprobs``: None for no
        logprobs, else how many top alternatives to record with each output token's logprob; with it,
        ``logprob_start`` asks for the prompt's logprobs from that position on. ``max_new_tokens`` 0 computes
        and caches the prompt and ends without a token (a prefill only). ``arrival``: when it arrived, if
        earlier than now (a simulator that learns of an arrival only after the step it came during). ``priority``:
        the client's (None: none given), ranked by ``config.priority``; with priority scheduling a full queue
        fails the least important queued request, or this one (see ``failures``). ``output_interval``: its new
        tokens are handed on (``take_tokens``) with the first, every this many, and with its end."""
        if rid in self.live:
            raise InvalidRequest(f"request id {rid!r} is already in use", param="rid")
        max_new = self.validate(prompt_ids, params, top_logprobs, logprob_start)
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.config.eos_ids
        req = Req(rid, list(prompt_ids), params, max_new, frozenset(stop_ids),
                  arrival=self.clock() if arrival is None else arrival, top_logprobs=top_logprobs,
                  priority=self.config.priority.rank(priority),
                  logprob_start=logprob_start if top_logprobs is not None else None,
                  output_interval=max(1, output_interval))
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)
        self.live[rid] = req
        self.waiting.append(req)
        self._queue_version += 1
        if self.tap is not None:
            self.tap.arrived(req)
        self._ask_tiers(req)
        self._limit_queue(req)
        return req

    def _ask_tiers(self, req: Req) -> None:
        """--enable-hierarchical-cache: read back the request's pages that the pool does not hold while it waits."""
        tiers = self.cache.tiers
        if tiers is not None and not req.finished:
            cap = req.match_limit
            tiers.ask(req.rid, req.fill_key, self.cache.match_len(req.fill_key[:cap]), cap, self.cache.version)

    def _pages_moved(self, req: Req) -> bool:
        """Did the pool lose pages of ``req``'s prefix since they were asked for? Then they are asked for again
        (True: the request waits for the answer, as the prefetch policy says)."""
        tiers, cap, version = self.cache.tiers, req.match_limit, self.cache.version
        if tiers.unchanged_since_asked(req.rid, version):  # the usual case: no walk of the tree per step
            return False
        cached = self.cache.match_len(req.fill_key[:cap])
        if not tiers.moved(req.rid, cached, version):
            return False
        tiers.ask(req.rid, req.fill_key, cached, cap, version)
        return not tiers.ready(req.rid, self.clock())

    def prefetched(self, msg: Prefetched) -> None:
        """The runner has read a waiting request's pages back (or found them nowhere)."""
        if self.cache.tiers is not None:
            self.cache.tiers.answered(msg)
            self._queue_version += 1  # a request that could not start may start now

    def flush(self, keep_storage: bool = False) -> dict[str, Any]:
        """Drop every cached prefix no running request holds: from the pool, and from the lower tiers (all of them,
        or all but storage)."""
        body: dict[str, Any] = {"tokens_freed": self.cache.flush(), "flushed": ["L1"]}
        if self.cache.tiers is not None:
            self.cache.tiers.flush(storage=not keep_storage)
            body["flushed"] += ["L2"] if keep_storage else ["L2", "L3"]
        return body

    @property
    def held(self) -> bool:
        """Is a waiting request held for its read-back from the lower tiers? (Then a step may plan nothing while
        there is work: the caller waits for the runner's answer, or for the prefetch policy to let it go.)"""
        tiers = self.cache.tiers
        return tiers is not None and bool(tiers.fetches) and any(not f.done for f in tiers.fetches.values())

    def validate(self, prompt_ids: list[int], params: SamplingParams, top_logprobs: int | None = None,
                 logprob_start: int | None = None) -> int:
        """Check a request against the model and the pool (again: the offline Engine has no API in front of
        it); returns the resolved max_new_tokens. InvalidRequest names the field that is wrong."""
        max_new = check_request(self.config, self.cache.capacity, prompt_ids, params, top_logprobs, logprob_start)
        self.processors.check(params.custom_logit_processor, params.custom_params, self.config.vocab_size)
        return max_new

    def finish(self, rid: str, reason: FinishReason) -> Req | None:
        """End a request now (stop string found, client gone, abort); its KV stays cached as evictable."""
        req = self.live.get(rid)
        if req is None:
            return None
        self._rollback_inflight(req)
        req.finish_reason = reason
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.cache.tiers is not None:
            self.cache.tiers.forget(rid)
        return req

    def fail(self, req: Req, message: str, status: int = 500, code: str | None = "internal_error") -> None:
        """End ``req`` with an error (kept in ``failures`` for the caller to report); its KV goes back."""
        if req.finished:
            return
        self.finish(req.rid, FinishReason("abort", message=message))
        self.failures.append(RequestError(req.rid, message, status=status, code=code))
        self.stats.failed += 1

    def take_failures(self) -> list[RequestError]:
        out, self.failures = self.failures, []
        return out

    def fail_step(self, message: str) -> None:
        """The plan in flight will never produce tokens (the runner failed, or the caller gave up on it): every
        request in it fails, and the slots it allocated for this step go back uncomputed."""
        steps = [s for s in (self._inflight, self._ahead) if s]  # the step after it never gets its inputs either
        self._inflight = self._ahead = None
        for step in steps:  # the earlier step first: its floors are the lower
            for req, floor in zip(step.reqs, step.floors or step.starts):
                if not req.finished:
                    self.cache.truncate(req.kv, floor)
                    self.fail(req, message)

    def fail_all(self, message: str) -> None:
        """Last resort after a bug in the scheduler itself: every request fails (500) and lets go of its KV, so
        the server is back in a clean state and serves the next request. A step still being computed stays in
        flight: its result finds only finished requests and is dropped."""
        for req in list(self.live.values()):
            self.fail(req, message)

    @property
    def inflight(self) -> list[Req]:
        """The requests of the plan being computed, in batch order (empty when none is)."""
        return list(self._inflight.reqs) if self._inflight else []

    @property
    def inflight_step(self) -> int | None:
        """The step whose result comes next (with overlap another may follow it: ``ahead_step``)."""
        return self._inflight.plan.step if self._inflight else None

    @property
    def ahead_step(self) -> int | None:
        return self._ahead.plan.step if self._ahead else None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # -- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> ForwardPlan | None:
        """The next batch, or None when there is nothing to run (requests may have failed meanwhile: see
        ``failures``)."""
        require(self._inflight is None, "process() the result of the previous plan first")
        self._expire_queue()
        return self._schedule_prefill() or self._schedule_decode()

    def schedule_ahead(self) -> ForwardPlan | None:
        """Overlap (``config.overlap``): the decode step after the one being computed, planned before its result
        comes back, so the runner goes from one step to the next without waiting for the scheduler. Its input
        tokens are the ones the runner samples in the step before (``ForwardPlan.follows``). Only a plain decode
        of every running request qualifies: nothing waits to be admitted, the pool has a slot for each, no drafts,
        tiers, grammars or logit processors (a step that ends a request by its grammar would hand the next one a
        finished matcher). A request whose step in flight ends it by length sits this one out; one that ends by a
        stop token computes one token nobody takes, its slot given back (``_rollback_inflight``). None: not now
        (the next plan is made from the result, as without overlap)."""
        cur = self._inflight
        if (not self.config.overlap or cur is None or self._ahead is not None or cur.plan.mode != "decode"
                or self.waiting or self.chunked is not None or self.spec.tokens or self.cache.tiers is not None
                or len(cur.reqs) != len(self.running) or self.cache.available < len(self.running)):
            return None
        if any(r.params.constraint is not None or r.params.custom_logit_processor is not None for r in self.running):
            return None
        row = {id(r): j for j, r in enumerate(cur.reqs)}
        if any(id(r) not in row for r in self.running):
            return None
        reqs = [r for r in self.running if len(r.output_ids) + 1 < r.max_new_tokens]  # the others end with cur
        if not reqs:
            return None
        starts = [r.kv_len for r in reqs]
        for req in reqs:
            require(self.cache.extend(req.kv, 1), "the pool was checked to have a slot for each")
        try:
            plan = build_plan(self._step + 1, "decode", reqs, starts, self.config.vocab_size,
                              self.runner_state.released(), follows=(cur.plan.step, [row[id(r)] for r in reqs]))
        except Exception:  # a request that cannot be planned: the plan is made from the result, where it fails alone
            log.exception("could not plan step %d ahead; planning it from the result instead", self._step + 1)
            for req, start in zip(reqs, starts):
                self.cache.truncate(req.kv, start)
            return None
        self._step += 1
        self.runner_state.sent(reqs, plan)
        self._ahead = Step(plan, reqs, starts)
        self.stats.ahead_steps += 1
        return plan

    def process(self, result: ForwardResult) -> list[Req]:
        """Apply the runner's tokens. Returns the requests that got a token (finished ones included) and the
        prefill-only ones that ended (they have no output token)."""
        step = self._inflight
        if step is None or step.plan.step != result.step:
            log.warning("dropping the result of step %d: it is not the step in flight", result.step)
            return []
        if result.error is not None:
            log.error("step %d failed in the runner: %s", result.step, result.error)
            self.fail_step("internal error in the model step (logged)")
            return []
        self._inflight, self._ahead = self._ahead, None  # with overlap, the next step is already computing
        plan, reqs = step.plan, step.reqs
        verify = step.drafts is not None  # a decode step that verified drafts (an extend plan)
        if verify:
            self.spec.stats.steps += 1
        updated = []
        sampled = np.flatnonzero(plan.sample).tolist()  # sampling row j is batch row sampled[j]
        done_rows = set(result.grammar_done)
        row_of = {i: j for j, i in enumerate(sampled)}
        now = self.clock()
        for i, req in enumerate(reqs):
            if req.finished:  # aborted while its step ran (its KV of this step was already given back)
                continue
            if plan.mode == "extend" and not verify:  # what was just computed is reusable at once (kept locked)
                self.cache.cache_prefix(req.kv, req.fill_key)
                req.prompt_logprobs.extend(result.prompt_logprobs.get(i, ()))
                if req.prefill_only and req.extend_len == 0:  # the whole prompt is computed and cached: done
                    req.first_token_at = now
                    req.finish_reason = FinishReason("length")
                    self._release(req)
                    updated.append(req)
                    continue
            j = row_of.get(i)
            if j is None:  # a prefill chunk that is not the last
                continue
            if j in result.errors:
                log.error("request %s: sampling failed: %s", req.rid, result.errors[j])
                if verify:  # its draft's slots hold tokens it never took
                    self.cache.truncate(req.kv, min(req.kv_len, req.seq_len - 1))
                self.fail(req, "internal error while sampling (logged)")
                continue
            if req is self.chunked:
                self.chunked = None
            if verify and step.drafts[i]:
                new, path = self.spec.accept(req.rid, step.drafts[i], result.drafted.get(i, []), result.next_ids[j])
                req.drafted, req.accepted = req.drafted + len(step.drafts[i]), req.accepted + len(new) - 1
                # the kept path's K/V moves up to follow the request's last token (a chain's is there already)
                self.cache.keep(req.kv, req.seq_len, path)
            else:
                new = [result.next_ids[j]]
            grammar_done = j in done_rows
            if req.first_token_at is None:
                req.first_token_at = now
            if req.top_logprobs is not None:
                req.output_logprobs.append(result.logprobs[j])
            req.fresh = 0
            for token in new:  # one token, or a verified draft's: each checked as a step of its own would be
                req.output_ids.append(token)
                req.fresh += 1
                req.finish_reason = req.check_finished()
                if req.finished:
                    break
            self.stats.generated_tokens += req.fresh
            self.policies.epochs[-1].generated_tokens += req.fresh
            updated.append(req)
            if grammar_done and not req.finished:  # the grammar ended it
                req.finish_reason = FinishReason("stop", matched=req.output_ids[-1])
            if verify:  # the rejected part of the draft was computed into slots nobody may read: they go back
                self.cache.truncate(req.kv, min(req.kv_len, req.seq_len - 1))
            if req.finished:
                self._rollback_inflight(req)  # overlap: the step after this one computes a token it never takes
                self._release(req)
            elif plan.mode == "extend" and not verify:
                self.running.append(req)
        if verify:
            self.spec.kept = sum(r.fresh for r in updated)
        if plan.mode == "decode" or verify:  # finished requests already left `running` in _release
            self.new_token_ratio = max(self.config.min_new_token_ratio,
                                       self.new_token_ratio - self.config.new_token_ratio_decay)
        self.stats.steps += 1
        if self.config.check_invariants:
            self.check()
        return updated

    def _expire_queue(self) -> None:
        """Fail the requests that waited longer than the queue timeout without being started."""
        timeout = self.config.queue_timeout_s
        if timeout is None or not self.waiting or self.clock() - self.waiting[0].arrival <= timeout:
            return
        now = self.clock()
        for req in [r for r in self.waiting if now - r.arrival > timeout and r.first_token_at is None]:
            self.stats.queue_timeouts += 1
            self.fail(req, f"the request waited {now - req.arrival:.1f}s in the queue, longer than the server's "
                           f"--queue-timeout of {timeout:g}s: the server is overloaded; retry later",
                      status=503, code="queue_timeout")

    def _limit_queue(self, arrival: Req) -> None:
        """Priority scheduling with --max-queued-requests (SGLang's): a full queue drops its least important
        request (503) when ``arrival`` is more important, else refuses ``arrival`` (429). Only requests waiting
        for their first admission count and may be dropped: a preempted or retracted one has started."""
        prio = self.config.priority
        queued = [r for r in self.waiting if r.admitted_at is None and r is not arrival]
        free = self.config.max_running_requests - len(self.running) - (self.chunked is not None)
        if prio.queue_full(len(queued), free):
            drop = prio.to_drop(queued, arrival)
            self.fail(drop, *prio.drop_error(drop, arrival))

    def _rollback_inflight(self, req: Req) -> None:
        """``req`` leaves while its step runs (or the two planned steps do): the slots they write for it must not
        reach the tree as if they held its KV (a step may yet fail, the one after it computes a token nobody
        takes), so they go back now; the runner is done with them before any later step can reuse them."""
        floors = [f for step in (self._inflight, self._ahead) if step and (f := step.floor_of(req)) is not None]
        if floors and req.kv is not None:
            self.cache.truncate(req.kv, min(floors))

    def _schedule_prefill(self) -> ForwardPlan | None:
        if not self.waiting and self.chunked is None:
            return None
        cfg = self.config
        chunking = cfg.chunked_prefill_size > 0
        reserved = sum(future_tokens(r, cfg.clip_max_new_tokens, self.new_token_ratio) for r in self.running)
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
        rule = preempt_rule(cfg.priority, self.policy)
        held = False
        if self.waiting and (room > 0 or (rule is not None and rule.for_places)):
            dedup = InBatchDedup(self.cache) if getattr(self.policy, "cache_aware", False) and self.cache.tree else None
            tiers, now = self.cache.tiers, self.clock()
            for req in cfg.priority.order(self.policies.order(self.waiting[:POLICY_WINDOW])):
                if tiers is not None and not tiers.ready(req.rid, now):
                    held = True
                    continue  # its pages are still being read back: the prefetch policy holds it
                if tiers is not None and req.kv is None and self._pages_moved(req):
                    held = True
                    continue  # the pool lost part of its prefix while it waited: asked for again, from below
                if dedup is not None and dedup.defer(req, bool(adder.reqs)):
                    continue  # shares a prefix that this step computes for another request: reuse it next step
                if room <= 0:  # every running place is taken: a more important arrival may take one
                    admitted, retracted = self._preempt_for(req, adder, need_place=True)
                    room += retracted - int(admitted)
                    if not admitted:
                        break
                elif adder.add(req):
                    room -= 1
                elif adder.short_of_kv and (taken := self._preempt_for(req, adder))[0]:
                    room += taken[1] - 1
                else:
                    break
                if dedup is not None:
                    dedup.admitted(req)
        if not adder.reqs:
            if not held:  # a held request may be let go by the clock alone: try again next time
                self._blocked = (state, room_tokens)
            return None
        self._blocked = None
        now = self.clock()
        for req in adder.reqs:
            if req.admitted_at is None:
                req.admitted_at = now
        admitted = {id(r) for r in adder.reqs}
        head = self.waiting[:POLICY_WINDOW]  # everything admitted came from the window
        self.waiting = [r for r in head if id(r) not in admitted] + self.waiting[POLICY_WINDOW:]
        if adder.partial is not None:
            self.chunked = adder.partial
        return self._launch("extend", adder.reqs, adder.starts, adder.floors)

    def _schedule_decode(self) -> ForwardPlan | None:
        if not self.running:
            return None
        while self.cache.available < len(self.running) and self._retract_one():
            pass
        starts = [r.kv_len for r in self.running]
        drafts = self.spec.propose(self.running, self.cache.available - len(self.running), self.cache.tree)
        for req, draft in zip(self.running, drafts or [[]] * len(self.running)):
            require(self.cache.extend(req.kv, 1 + len(draft)),
                    "a lone request always fits: validate() caps prompt + max_new_tokens at the pool size")
        if drafts is not None:
            return self._launch("extend", list(self.running), starts, drafts=drafts)
        return self._launch("decode", list(self.running), starts)

    def _launch(self, mode, reqs: list[Req], starts: list[int], floors: list[int] | None = None,
                drafts: list[list[int]] | None = None) -> ForwardPlan | None:
        """The plan for ``reqs``. A request that cannot be planned (a bug around its values) fails alone: its
        slots of this step go back and the others run without it. ``floors``: what each request held before the
        step's loads from the lower tiers (default: ``starts``); ``drafts``: what a speculative step verifies."""
        self._step += 1
        for req in reqs:
            self.runner_state.take_row(req)
        tiers = self.cache.tiers.take_ops() if self.cache.tiers is not None else None
        try:
            plan = build_plan(self._step, mode, reqs, starts, self.config.vocab_size,
                              self.runner_state.released(), tiers, drafts)
        except Exception:
            log.exception("could not plan step %d; finding the request(s) that break it", self._step)
            bad = [r for r, s in zip(reqs, starts) if not plannable(mode, r, s, self.config.vocab_size)] or reqs
            log.error("failing request(s) %s: they cannot be planned", ", ".join(r.rid for r in bad))
            floors = floors or starts
            for req, floor in zip(reqs, floors):
                if any(req is b for b in bad):  # its loads still run: into slots nobody reads before they are reused
                    self.cache.truncate(req.kv, floor)
                    self.fail(req, "internal error while planning the request (logged)")
            keep = [i for i, r in enumerate(reqs) if not r.finished]
            if not keep:
                return None  # the tier ops are lost with the plan: only pages not written and read-backs not used
            reqs, starts, floors = [reqs[i] for i in keep], [starts[i] for i in keep], [floors[i] for i in keep]
            drafts = [drafts[i] for i in keep] if drafts is not None else None
            plan = build_plan(self._step, mode, reqs, starts, self.config.vocab_size,
                              self.runner_state.released(), tiers, drafts)  # with the requests that just failed
        self.runner_state.sent(reqs, plan)
        self._inflight = Step(plan, reqs, starts, floors, drafts)
        return plan

    # -- retraction --------------------------------------------------------------------------------------
    def _retract_one(self) -> bool:
        """Send back to the queue the request whose retraction loses least: the one mid-prefill, else the one
        with the fewest generated tokens (longest first on ties, it frees most); with priority scheduling the
        least important of them first. Its KV goes to the tree, so whatever survives eviction is reused when it
        comes back. False if only one request is left."""
        candidates = ([self.chunked] if self.chunked else []) + (self.running if len(self.running) > 1 else [])
        if not candidates:
            return False
        ranked = self.config.priority.enabled
        victim = min(candidates, key=lambda r: (r.priority if ranked else 0, r is not self.chunked,
                                                len(r.output_ids), -r.seq_len))
        self._requeue(victim)
        self.stats.retractions += 1
        self.new_token_ratio = self.config.init_new_token_ratio
        return True

    def _preempt_for(self, req: Req, adder: PrefillAdder, need_place: bool = False) -> tuple[bool, int]:
        """Less important running requests make room for ``req`` (preempt.py): (admitted, how many retracted)."""
        rule = preempt_rule(self.config.priority, self.policy)
        if rule is None:
            return False, 0
        admitted, retracted = preempt_for(rule, self.running, req, adder, self.cache, self._requeue, need_place)
        self.stats.preemptions += retracted
        return admitted, retracted

    def _requeue(self, req: Req) -> None:
        """Retract ``req``: its KV goes to the tree, its output is kept, it rejoins the queue where it arrived."""
        self._release(req)
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)
        self._queue_version += 1
        self._ask_tiers(req)  # what it computed went to the tree; what is evicted before it returns may be below

    def _release(self, req: Req) -> None:
        """Drop ``req`` from the running set and close its KV (computed tokens go to the tree)."""
        if req.kv is not None:
            self.cache.close(req.kv, req.fill_key)
            req.kv = None
        self.runner_state.release(req)
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        if req.finished:
            self.live.pop(req.rid, None)
            self.spec.release(req)
            if self.cache.tiers is not None:
                self.cache.tiers.forget(req.rid)
            if self.tap is not None:
                self.tap.ended(req)
            if req.cached_tokens is not None:  # it was admitted: it reused (or not) and computed
                self.stats.cached_tokens += req.cached_tokens
                self.policies.finished(req)

    # -- invariants --------------------------------------------------------------------------------------
    def check(self) -> None:
        """Pool accounting and queue consistency (tests call this after every step); InvariantError if broken."""
        holders = [r for r in self.live.values() if r.kv is not None]
        self.cache.check(r.kv for r in holders)
        require(all(r.kv is None for r in self.waiting), "a waiting request holds KV")
        computing = {id(r) for r in self._inflight.reqs} if self._inflight else set()  # their next token's slot
        require(all(r.kv is not None and r.extend_len == (id(r) not in computing) for r in self.running),
                "a running request is not decoding")
        require(len({id(r) for r in self.waiting + self.running}) == len(self.waiting) + len(self.running),
                "a request is queued twice")
        require(len(self.running) + (self.chunked is not None) <= self.config.max_running_requests,
                "more requests running than --max-running-requests")
        require(not any(r.finished for r in self.live.values()), "a finished request is still live")
        self.runner_state.check(self.live.values())
