"""The shadow actor (--shadow-policies): a ShadowLab fed the live trace, simulating every shadow pair in a
process of its own at the lowest CPU priority (SCHED_IDLE), so that it takes only CPU time the serving actors
leave idle.
Every REPORT_INTERVAL_S it sends the api a ShadowReport and, with --auto-policy, may tell the scheduler to switch.
It never waits on anyone: a pair short of CPU reports a larger ``behind_s``, serving goes on at full speed; if
this process dies the server serves on without it.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from radixserve.actors.transport import ActorSpec, Channel, run_actor
from radixserve.lab.auto_policy import AutoPolicy
from radixserve.lab.shadow import ShadowLab, pair_dict, resolve_pairs
from radixserve.lab.sim_tiers import TierSpec
from radixserve.wire.messages import PolicySwitch, ShadowFeed, ShadowInbox, ShadowReport

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0
SLICE_S = 0.02  # CPU time simulated between two looks at the inbox


class ShadowActor:
    def __init__(self, lab: ShadowLab, channel: Channel, auto: AutoPolicy | None, metric: str) -> None:
        self.lab, self.channel, self.auto = lab, channel, auto
        self.ranker = auto or AutoPolicy(metric)  # who leads, by the same measure auto-policy would use
        self._last_report = 0.0
        self.behind = False  # some pair has work left before the horizon

    async def run(self) -> None:
        while True:
            if not self.behind:  # nothing to simulate: wait for the trace (or the next report)
                await self.channel.inbox.poll(REPORT_INTERVAL_S * 1000)
            for msg in await self.channel.recv_ready():
                try:
                    if isinstance(msg, ShadowFeed):
                        self.lab.feed(msg)
                except Exception:  # one bad feed must not lose the others
                    log.exception("internal error on a shadow feed; going on with the next")
            try:
                self.behind = self.lab.advance(SLICE_S, wall=time.monotonic())  # the scheduler's clock too
                if time.monotonic() - self._last_report >= REPORT_INTERVAL_S:
                    await self.report()
            except Exception:  # a bug of the shadow's must not end the server it only watches
                log.exception("internal error in the shadow; it goes on with the next feed")
                self.behind = False
                self._last_report = time.monotonic()

    async def report(self) -> None:
        self._last_report = time.monotonic()
        lab = self.lab
        if lab.live is None:
            return
        rows = lab.pair_stats()
        body = lab.report(rows)
        leader = self.ranker.leader(rows)
        body.update(behind=self.behind, leader=pair_dict((leader["eviction"], leader["schedule"])) if leader else None,
                    metric=self.ranker.metric, auto_policy=self.auto is not None)
        if self.auto is not None:
            switch = self.auto.decide(lab.horizon, lab.live, rows)
            if switch is not None:
                log.info("auto-policy: %s/%s -> %s/%s: %s", *switch.old, *switch.new, switch.reason)
                await self.channel.send("scheduler", PolicySwitch(*switch.new, switch.reason))
                lab.live = switch.new  # the scheduler's next feed confirms it (or, if it refused, undoes it)
            body.update(margin=self.auto.margin, hold_s=self.auto.hold_s)
        body["switches"] = [s.to_dict() for s in self.auto.switches] if self.auto else []
        await self.channel.send("api", ShadowReport(body))


def lowest_cpu_priority() -> None:
    """Run only on CPU time nothing else wants: Linux's SCHED_IDLE class (below every nice level), else nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def tier_spec(args) -> TierSpec | None:
    """The live server's KV tiers as the shadows simulate them (host memory in pages at the pool's own dtype)."""
    if not args.enable_hierarchical_cache:
        return None
    page = args.hicache_page_size
    return TierSpec(args.hicache_write_policy, args.hicache_storage_prefetch_policy, page,
                    host_pages=int(args.hicache_ratio * args.max_total_tokens) // page,
                    storage_pages=0 if args.hicache_storage_backend == "none" else TierSpec.storage_pages)


def build(spec: ActorSpec, channel: Channel) -> tuple[ShadowActor, dict[str, Any]]:
    args = spec.server_args
    pairs = resolve_pairs(args.shadow_policies, (args.eviction_policy, args.schedule_policy))
    lab = ShadowLab(pairs, spec.scheduler_config, window_s=args.shadow_window, tiers=tier_spec(args))
    auto = AutoPolicy(args.auto_policy_metric, args.auto_policy_margin, args.auto_policy_hold,
                      args.auto_policy_cooldown) if args.auto_policy else None
    return ShadowActor(lab, channel, auto, args.auto_policy_metric), {"pairs": len(pairs)}


def main(spec: ActorSpec) -> None:
    lowest_cpu_priority()  # before any thread starts (ZeroMQ's I/O threads inherit it)
    run_actor("shadow", spec, ShadowInbox, ("api", "scheduler"), build)
