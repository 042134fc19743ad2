"""The scheduler core (pure Python, no torch, no I/O) and, later, its actor shell."""
from radixserve.actors.scheduler.req import FinishReason, Req
from radixserve.actors.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerStats

__all__ = ["FinishReason", "Req", "Scheduler", "SchedulerConfig", "SchedulerStats"]
