"""The scheduler's periodic log lines, shaped as SGLang's so the log scrapers and habits of its users carry over:

    Prefill batch. #new-seq: 2, #new-token: 96, #cached-token: 512, token usage: 0.03, #running-req: 1, #queue-req: 4
    Decode batch. #running-req: 3, #token: 1804, token usage: 0.11, gen throughput (token/s): 41.20, #queue-req: 0

A prefill line for every step that computes prompt tokens, a decode line every ``DECODE_EVERY`` decode steps (its
throughput: the tokens decoded from the first of those steps to the last, over the time between their plans). ``#cached-token``: tokens of
the batch's requests already in the KV pool before the step (a radix-cache hit, or an earlier chunk);
``#token`` and ``token usage``: KV slots held by requests (not free, not an evictable cached prefix), and that over
the pool's size. At ``--log-level info``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.actors.scheduler.scheduler import Scheduler
    from radixserve.wire.plans import ForwardPlan

log = logging.getLogger("radixserve.scheduler")

DECODE_EVERY = 40  # decode steps per decode line (SGLang's default decode_log_interval)


class BatchLog:
    def __init__(self, every: int = DECODE_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self._decodes = 0  # decode steps since the last decode line
        self._decoded = 0  # tokens decoded by those steps but the latest (whose step is still running)
        self._latest = 0  # the latest decode step's batch
        self._latest_verified = False  # ... was it a speculative step (its kept tokens: sched.spec.kept)
        self._since = 0.0  # when the first of them was planned

    def planned(self, plan: ForwardPlan, sched: Scheduler) -> str | None:
        """The line for this step, logged, or None (a decode step between two lines)."""
        cache = sched.cache
        used = cache.capacity - cache.allocator.num_free - cache.evictable
        usage = used / cache.capacity if cache.capacity else 0.0
        running, queued = len(sched.running) + (sched.chunked is not None), len(sched.waiting)
        if plan.mode == "extend" and plan.drafts is None:
            line = (f"Prefill batch. #new-seq: {len(plan.extend_lens)}, #new-token: {int(plan.extend_lens.sum())}, "
                    f"#cached-token: {int(plan.prefix_lens.sum())}, token usage: {usage:.2f}, "
                    f"#running-req: {running}, #queue-req: {queued}")
        else:
            now = self.clock()
            if self._decodes == 0:
                self._since, self._decoded = now, 0
            else:  # the latest step is processed now: a speculative one kept sched.spec.kept tokens
                self._decoded += sched.spec.kept if self._latest_verified else self._latest
            self._latest, self._latest_verified = len(plan.extend_lens), plan.drafts is not None
            self._decodes += 1
            if self._decodes < self.every:
                return None
            throughput = self._decoded / (now - self._since) if now > self._since else 0.0
            self._decodes = 0
            line = (f"Decode batch. #running-req: {running}, #token: {used}, token usage: {usage:.2f}, "
                    f"gen throughput (token/s): {throughput:.2f}, #queue-req: {queued}")
        log.info("%s", line)
        return line
