"""Priority preemption: which running requests give up their place and KV so that a more important arrival runs.

Two sources ask for it, and one rule object says what each allows:

    --enable-priority-scheduling (SGLang's)   the arrival outranks the victim by more than
                                              --priority-scheduling-preemption-threshold; for a running place
                                              (--max-running-requests reached) or for KV room; no bound on how
                                              often a request is preempted (strict priority)
    schedule policy with ``preempt = True``   strictly lower priority; for KV room only; at most the policy's
    (priority-preempt)                        ``max_preemptions`` times per request (then it runs to the end)

The flag's rule wins when both apply. The scheduler retracts a victim the way it retracts when decoding runs out
of room: its KV goes to the radix tree (kept, evictable: it resumes from what survives), it rejoins the queue
where it arrived, it keeps its output and resumes with the same tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixserve.actors.scheduler.prefill import PrefillAdder
from radixserve.actors.scheduler.priority import PriorityConfig
from radixserve.actors.scheduler.req import Req
from radixserve.cache.manager import CacheManager
from radixserve.policies.base import SchedulePolicy

DEFAULT_MAX_PREEMPTIONS = 2  # a preempting policy's ``max_preemptions``, when it has none


@dataclass(frozen=True)
class PreemptRule:
    threshold: int  # the arrival's rank must exceed the victim's by more than this
    max_preemptions: int | None  # a request preempted this often is never a victim again; None: no bound
    for_places: bool  # also when --max-running-requests is reached (else for KV room only)


def preempt_rule(priority: PriorityConfig, policy: SchedulePolicy) -> PreemptRule | None:
    """The rule in force now (the policy may have been switched since the last step); None: nobody preempts."""
    if priority.preempts:
        return PreemptRule(priority.preemption_threshold, None, for_places=True)
    if getattr(policy, "preempt", False):
        return PreemptRule(0, getattr(policy, "max_preemptions", DEFAULT_MAX_PREEMPTIONS), for_places=False)
    return None


def victims(rule: PreemptRule, running: list[Req], req: Req) -> list[Req]:
    """The running requests ``req`` may take the place of."""
    return [r for r in running if req.priority - r.priority > rule.threshold
            and (rule.max_preemptions is None or r.preemptions < rule.max_preemptions)]


def pick_victim(rule: PreemptRule, running: list[Req], req: Req) -> Req | None:
    """The lowest priority first, then the fewest generated tokens (it loses least), then the longest (it frees
    most); None if no running request may be preempted for ``req``."""
    return min(victims(rule, running, req), key=lambda r: (r.priority, len(r.output_ids), -r.seq_len), default=None)


def preempt_for(rule: PreemptRule, running: list[Req], req: Req, adder: PrefillAdder, cache: CacheManager,
                requeue: Callable[[Req], None], need_place: bool = False) -> tuple[bool, int]:
    """``req``, next in the queue's order, found no running place (``need_place``) or no KV room (the adder just
    refused it, ``adder.short_of_kv``): retract victims, one at a time in ``pick_victim``'s order, until
    ``adder`` admits it. Returns (admitted, how many were retracted).

    Nobody is retracted when it could not help: the step's token budget is spent, or even all victims together
    would not make room (their KV, counted whole though part of it may stay shared, and the decode room kept for
    them)."""
    if need_place and not rule.for_places:
        return False, 0
    pool = victims(rule, running, req)
    if not pool or adder.partial is not None or adder.tokens_left <= 0:
        return False, 0
    could_free = sum(v.kv_len + adder.future_tokens(v) for v in pool)
    need = min(req.extend_len, adder.tokens_left) + adder.future_tokens(req)
    if cache.available - adder.reserved + could_free < need:
        return False, 0
    retracted = 0
    while need_place or adder.short_of_kv:
        victim = pick_victim(rule, running, req)
        if victim is None:
            break
        adder.unreserve(victim)
        victim.preemptions += 1
        retracted += 1
        requeue(victim)  # (the scheduler's new_token_ratio stays: the estimate was right, a more important one came)
        need_place = False
        if adder.add(req):
            return True, retracted
    return False, retracted
