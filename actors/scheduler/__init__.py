"""The scheduler core (pure Python, no torch, no I/O) and, later, its actor shell."""
from radixserve.actors.scheduler.req import FinishReason, Req
from radixserve.actors.scheduler.scheduler import Scheduler, SchedulerConfig
from radixserve.actors.scheduler.stats import PolicyEpoch, SchedulerStats

__all__ = ["FinishReason", "PolicyEpoch", "Req", "Scheduler", "SchedulerConfig", "SchedulerStats"]
