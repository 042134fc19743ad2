"""The scheduler core (pure Python, no torch, no I/O) and its actor shell (actor.py)."""
from __future__ import annotations

import time
from collections.abc import Callable

from radixserve.actors.scheduler.req import FinishReason, Req
from radixserve.actors.scheduler.scheduler import Scheduler, SchedulerConfig
from radixserve.actors.scheduler.stats import PolicyEpoch, SchedulerStats
from radixserve.cache.manager import CacheManager
from radixserve.cache.tiers import LowerTiers

__all__ = ["FinishReason", "PolicyEpoch", "Req", "Scheduler", "SchedulerConfig", "SchedulerStats", "build_scheduler"]


def build_scheduler(args, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> Scheduler:
    """The scheduler a server or Engine runs: cache manager and policies named by ``args`` (ServerArgs)."""
    from radixserve.policies import load_eviction_policy, load_prefetch_policy, load_schedule_policy, load_write_policy

    cache = CacheManager(args.max_total_tokens, load_eviction_policy(args.eviction_policy),
                         disable_radix_cache=args.disable_radix_cache, clock=clock)
    if config.tiers is not None:
        cache.attach_tiers(LowerTiers(config.tiers, load_write_policy(config.tiers.write_policy),
                                      load_prefetch_policy(config.tiers.prefetch_policy), clock))
    return Scheduler(config, cache, load_schedule_policy(args.schedule_policy), clock=clock)
