"""Priority preemption, for schedule policies with ``preempt = True`` (see policies.base.SchedulePolicy): which
running request gives up its KV so that a more important arrival fits. The scheduler retracts the victim the way
it retracts when decoding runs out of room: its KV goes to the tree, it rejoins the queue where it arrived, and
it resumes with the same output."""
from __future__ import annotations

from collections.abc import Callable

from radixserve.actors.scheduler.prefill import PrefillAdder
from radixserve.actors.scheduler.req import Req
from radixserve.cache.manager import CacheManager
from radixserve.policies.base import SchedulePolicy

DEFAULT_MAX_PREEMPTIONS = 2  # a preempting policy's ``max_preemptions``, when it has none


def victims(policy: SchedulePolicy, running: list[Req], req: Req) -> list[Req]:
    """The running requests ``req`` may take the place of: strictly lower priority, preempted fewer than the
    policy's ``max_preemptions`` times; none if the policy does not preempt."""
    if not getattr(policy, "preempt", False):
        return []
    limit = getattr(policy, "max_preemptions", DEFAULT_MAX_PREEMPTIONS)
    return [r for r in running if r.priority < req.priority and r.preemptions < limit]


def pick_victim(policy: SchedulePolicy, running: list[Req], req: Req) -> Req | None:
    """The running request to retract so that ``req`` fits: one of strictly lower priority, retracted so fewer
    than the policy's ``max_preemptions`` times (after that it runs to the end, so nothing starves); the lowest
    priority first, then the fewest generated tokens (it loses least), then the longest (it frees most). None if
    the policy does not preempt or no running request may be retracted for ``req``."""
    return min(victims(policy, running, req), key=lambda r: (r.priority, len(r.output_ids), -r.seq_len),
               default=None)


def preempt_for(policy: SchedulePolicy, running: list[Req], req: Req, adder: PrefillAdder, cache: CacheManager,
                requeue: Callable[[Req], None]) -> tuple[bool, int]:
    """``req``, the preempting policy's first choice, found no KV room: retract victims (``requeue``, one at a
    time, in ``pick_victim``'s order) until ``adder`` admits it. Returns (admitted, how many were retracted).
    Nobody is retracted when even all victims together would not make room: their KV (counted whole, though
    part of it may stay shared with others) and the decode room kept for them."""
    could_free = sum(v.kv_len + adder.future_tokens(v) for v in victims(policy, running, req))
    need = min(req.extend_len, adder.tokens_left) + adder.future_tokens(req)
    if cache.available - adder.reserved + could_free < need:
        return False, 0
    retracted = 0
    while adder.short_of_kv and (victim := pick_victim(policy, running, req)) is not None:
        adder.unreserve(victim)
        victim.preemptions += 1
        retracted += 1
        requeue(victim)  # (the scheduler's new_token_ratio stays: the estimate was right, a more important one came)
        if adder.add(req):
            return True, retracted
    return False, retracted
