"""The scheduler actor: the Scheduler core behind an inbox (no torch here either).

Overlap: as soon as a step's result arrives, the next plan goes to the runner *before* this step's tokens go
to the tokenizer, so detokenizing and HTTP streaming run while the model computes the next step. While decoding
(``Scheduler.schedule_ahead``), the plan of the step after the one in flight goes out at once, so the runner
starts it the moment it has sent its result, and the scheduler takes the result in while that step computes.
Plans are published once per step to every tensor-parallel rank; rank 0 answers.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from radixserve.actors.scheduler import build_scheduler
from radixserve.actors.scheduler.batch_log import BatchLog
from radixserve.actors.scheduler.dashboard_view import dashboard_view
from radixserve.actors.scheduler.req import Req
from radixserve.actors.scheduler.scheduler import Scheduler
from radixserve.actors.scheduler.shadow_tap import FEED_INTERVAL_S, ShadowTap
from radixserve.actors.transport import ActorSpec, Channel, Publisher, run_actor
from radixserve.errors import InvalidRequest
from radixserve.wire.codec import array
from radixserve.wire.messages import (
    AddReq, ControlReply, ControlReq, Finished, FinishReq, PolicySwitch, RequestError, SchedulerInbox, Status,
    TokenBatch,
)
from radixserve.wire.plans import ForwardPlan, ForwardResult, Prefetched

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.25
HELD_POLL_S = 0.02  # while requests wait for their pages: how often the prefetch policy is asked again


class SchedulerActor:
    def __init__(self, scheduler: Scheduler, channel: Channel, plans: Publisher, ranks: int,
                 timeout_s: float, replica: int = 0) -> None:
        self.scheduler = scheduler
        self.replica = replica  # with --dp: which replica's scheduler this is
        self.channel = channel
        self.plans = plans
        self._ranks, self._timeout_s = ranks, timeout_s  # every rank has subscribed before the first plan
        self._last_status = 0.0
        self._dirty = True  # something changed since the last Status
        self._sent: dict[int, tuple[float, ForwardPlan]] = {}  # the plans in flight (step ->), and when sent
        self._last_result = 0.0  # when the last result came (a step planned ahead starts no earlier)
        self.batch_log = BatchLog()  # SGLang-style "Prefill batch." / "Decode batch." lines
        self._held = False  # the last launch planned nothing: every request that could run waits for its pages
        self.tiers_peer = "tiers"  # the runner's tier thread's inbox (its replica's: build sets it)

    @property
    def inflight(self) -> bool:
        """Is a step being computed (its result still to come)?"""
        return self.scheduler.inflight_step is not None

    async def run(self) -> None:
        sched = self.scheduler
        await self.maybe_status()  # the api knows the pool from the start
        while True:
            if self.inflight or not sched.has_work:  # nothing to plan: wait
                tap = sched.tap
                if tap is None or not tap.pending or await self.channel.inbox.poll(FEED_INTERVAL_S * 1000):
                    await self.guarded(await self.channel.recv())
            elif self._held:  # requests wait for their pages: for the runner's answer, or the prefetch policy
                if await self.channel.inbox.poll(HELD_POLL_S * 1000):
                    await self.guarded(await self.channel.recv())
            for msg in await self.channel.recv_ready():
                await self.guarded(msg)
            if not self.inflight:
                await self.launch()
            await self.send_tier_messages()
            await self.report_failures()
            await self.maybe_status()
            await self.maybe_feed_shadow()

    async def guarded(self, msg: Any) -> None:
        """Handle one message; a bug on it fails the requests it touched (500), never this actor."""
        try:
            await self.handle(msg)
        except Exception:
            log.exception("internal error on %s", type(msg).__name__)
            if isinstance(msg, AddReq):
                await self.channel.send("tokenizer", RequestError(msg.rid, "internal error while queueing the "
                                                                  "request (logged)", status=500,
                                                                  code="internal_error"))
            elif isinstance(msg, ForwardResult):
                sched = self.scheduler
                if sched.inflight_step == msg.step:  # it broke before taking this result: take it as failed
                    sched.fail_step("internal error in the scheduler (logged)")
                sched.fail_all("internal error in the scheduler (logged)")

    async def launch(self) -> None:
        try:
            plan = self.scheduler.schedule() if self.scheduler.has_work else None
        except Exception:  # a bug in planning that no single request explains: start clean rather than stop
            log.exception("internal error while scheduling; failing the requests in flight")
            self.scheduler.fail_all("internal error in the scheduler (logged)")
            return
        self._held = plan is None and self.scheduler.held
        if plan is not None:
            self.publish(plan)
            self.ahead()

    def ahead(self) -> None:
        """With overlap, the decode step after the one in flight, sent now."""
        try:
            plan = self.scheduler.schedule_ahead()
        except Exception:  # a bug there: the requests in flight fail, the server goes on
            log.exception("internal error while planning ahead; failing the requests in flight")
            self.scheduler.fail_all("internal error in the scheduler (logged)")
            return
        if plan is not None:
            self.publish(plan)

    def publish(self, plan: ForwardPlan) -> None:
        self.plans.wait_for(self._ranks, self._timeout_s)  # returns at once after the first time
        self.plans.send(plan)
        self.batch_log.planned(plan, self.scheduler)
        self._sent[plan.step] = (time.monotonic(), plan)  # the shadows and speculation's cost gate time the steps

    async def send_tier_messages(self) -> None:
        """Read-backs (and flushes) go at once to the runner's tier thread, on a socket of its own: not behind
        the plans, which the runner reads only between steps (a read-back would wait for the step in flight)."""
        tiers = self.scheduler.cache.tiers
        if tiers is not None and tiers.outbox:
            for msg in tiers.take_outbox():
                await self.channel.send(self.tiers_peer, msg)

    async def report_failures(self) -> None:
        for err in self.scheduler.take_failures():
            await self.channel.send("tokenizer", err)

    async def handle(self, msg: Any) -> None:
        sched = self.scheduler
        self._dirty = True
        if isinstance(msg, ForwardResult):
            now, last = time.monotonic(), self._last_result
            self._last_result = now
            sent = self._sent.pop(msg.step, None)
            self._sent = {step: s for step, s in self._sent.items() if step > msg.step}  # failed with it
            updated = sched.process(msg)
            if sent is not None and msg.error is None:
                seconds = now - max(sent[0], last)  # a step planned ahead started when the one before it ended
                if sched.tap is not None:
                    sched.tap.step(sent[1], seconds)
                sched.spec.timed(sent[1].mode, sent[1].drafts, sent[1].batch_size, seconds)
            if self.inflight:  # with overlap, the next step is computing already
                self.ahead()  # the runner has the next step: plan the one after it ...
            else:
                await self.launch()  # the runner starts the next step now ...
            batch = take_tokens(updated)
            if batch is not None:  # ... while the tokenizer turns this step's tokens into text
                await self.channel.send("tokenizer", batch)
        elif isinstance(msg, AddReq):
            try:
                sched.add_request(msg.rid, msg.input_ids.tolist(), msg.params, msg.top_logprobs,
                                  msg.priority, msg.logprob_start, output_interval=msg.output_interval)
            except InvalidRequest as exc:
                await self.channel.send("tokenizer", RequestError(msg.rid, str(exc), param=exc.param))
        elif isinstance(msg, Prefetched):
            sched.prefetched(msg)
        elif isinstance(msg, FinishReq):
            sched.finish(msg.rid, msg.reason)
        elif isinstance(msg, ControlReq):
            await self.channel.send("api", control(sched, msg))
        elif isinstance(msg, PolicySwitch):  # --auto-policy: the shadow's leader, with its evidence
            log.info("auto-policy: switching to eviction %s, schedule %s: %s", msg.eviction, msg.schedule,
                     msg.reason)
            try:
                sched.policies.adopt(msg.eviction, msg.schedule, reason=f"auto-policy: {msg.reason}")
                if sched.tap is not None:
                    sched.tap.force = True  # the shadow learns the live pair now, not with the next request
            except ValueError as exc:
                log.error("auto-policy: the switch was refused: %s", exc)

    async def maybe_feed_shadow(self) -> None:
        """--shadow-policies: the trace since the last feed, without ever waiting on the shadow: if its inbox is
        full the feed is kept and sent, grown, next time."""
        tap, now = self.scheduler.tap, time.monotonic()
        if tap is None or not tap.due(now):
            return
        if await self.channel.try_send("shadow", tap.feed(self.scheduler)):
            tap.sent(now)

    async def maybe_status(self) -> None:
        """Tell the api how things stand: every STATUS_INTERVAL_S while busy, once more when going idle."""
        now = time.monotonic()
        if now - self._last_status >= STATUS_INTERVAL_S or (self._dirty and not self.scheduler.has_work):
            self._last_status, self._dirty = now, False
            await self.channel.send("api", status_of(self.scheduler, self.replica))


def control(sched: Scheduler, msg: ControlReq) -> ControlReply:
    """Control requests run between steps, so a policy switch never lands in the middle of one."""
    try:
        if msg.op == "flush_cache":
            return ControlReply(msg.reply_id, sched.flush(msg.keep_storage))
        if msg.op == "cache_stats":
            return ControlReply(msg.reply_id, sched.policies.cache_stats())
        if msg.op == "dashboard":
            return ControlReply(msg.reply_id, dashboard_view(sched))
        if msg.op == "set_policies":
            sched.policies.switch(msg.eviction, msg.schedule, write=msg.write, prefetch=msg.prefetch, draft=msg.draft)
        return ControlReply(msg.reply_id, sched.policies.info())
    except ValueError as exc:
        return ControlReply(msg.reply_id, sched.policies.info(), error=str(exc))


def take_tokens(reqs: list[Req]) -> TokenBatch | None:
    """One message for the step (None: nothing is due): the new tokens of each request that is due
    (``Req.due``: a run of them where a verified draft kept several or tokens were held back) and, for finished
    ones, why; the prompt logprobs come with a request's first token; prefill-only requests that ended travel in
    ``prefilled``. What it hands on counts as sent (``Req.sent``)."""
    prefilled = [Finished(r.rid, r.finish_reason, len(r.prompt_ids), r.cached_tokens or 0,
                          r.prompt_logprobs_out() if r.logprob_start is not None else None,
                          list(r.cached_tiers) if r.cached_tiers else None)
                 for r in reqs if not r.output_ids]
    reqs = [r for r in reqs if r.output_ids and r.due]
    if not reqs and not prefilled:
        return None
    first = [r.sent == 0 for r in reqs]
    runs = [r.output_ids[r.sent :] for r in reqs]
    batch = TokenBatch(
        rids=[r.rid for r in reqs],
        token_ids=array([t for run in runs for t in run]),
        prompt_tokens=array([len(r.prompt_ids) for r in reqs]),
        cached_tokens=array([r.cached_tokens or 0 for r in reqs]),
        finished={i: r.finish_reason for i, r in enumerate(reqs) if r.finish_reason is not None},
        logprobs={i: r.output_logprobs[r.sent :] for i, r in enumerate(reqs) if r.top_logprobs is not None},
        prompt_logprobs={i: r.prompt_logprobs_out() for i, r in enumerate(reqs)
                         if r.logprob_start is not None and first[i]},
        prefilled=prefilled,
        cached_tiers={i: list(r.cached_tiers) for i, r in enumerate(reqs) if r.cached_tiers and (
            first[i] or r.finish_reason is not None)},
        drafts={i: [r.drafted, r.accepted] for i, r in enumerate(reqs) if r.drafted and r.finish_reason is not None},
        counts=array([len(run) for run in runs]) if any(len(run) != 1 for run in runs) else None,
    )
    for r in reqs:
        r.sent = len(r.output_ids)
    return batch


def status_of(sched: Scheduler, replica: int = 0) -> Status:
    cache, epoch = sched.cache, sched.policies.epochs[-1]
    return Status(
        running=len(sched.running) + (sched.chunked is not None),
        waiting=len(sched.waiting),
        capacity=cache.capacity,
        free=cache.allocator.num_free,
        evictable=cache.evictable,
        protected=cache.protected,
        retractions=sched.stats.retractions,
        evicted_tokens=cache.evicted_tokens,
        steps=sched.stats.steps,
        eviction=epoch.eviction,
        schedule=epoch.schedule,
        epoch_requests=epoch.requests,
        epoch_prompt_tokens=epoch.prompt_tokens,
        epoch_cached_tokens=epoch.cached_tokens,
        epoch_evicted_tokens=cache.evicted_tokens - epoch.evicted_at_start,
        queue_timeouts=sched.stats.queue_timeouts,
        failed_requests=sched.stats.failed,
        replica=replica,
        tiers=cache.tiers.counts() if cache.tiers is not None else {},
        speculative=sched.spec.info() if sched.spec.tokens else {},
    )


def build(spec: ActorSpec, channel: Channel) -> tuple[SchedulerActor, dict[str, Any]]:
    args = spec.server_args
    scheduler = build_scheduler(args, spec.scheduler_config)
    if args.shadow_policies:
        scheduler.tap = ShadowTap()
    plans = Publisher(spec.endpoints.plans_bound(spec.named("plans")), spec.endpoints.keys)
    actor = SchedulerActor(scheduler, channel, plans, args.tp, args.dist_timeout, spec.replica or 0)
    actor.tiers_peer = spec.named("tiers")
    return actor, {"capacity": scheduler.cache.capacity, "replica": spec.replica or 0}


def main(spec: ActorSpec) -> None:
    peers = ("tokenizer", "api") + (("shadow",) if spec.server_args.shadow_policies else ()) + (
        (spec.named("tiers"),) if spec.scheduler_config.tiers is not None else ())  # the runner's tier thread
    run_actor(spec.named("scheduler"), spec, SchedulerInbox, peers, build)
