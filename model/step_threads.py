"""The threads a CPU runner's steps run on: a fixed count, or as many as other processes leave free.

    threads = StepThreads(fixed=None, cap=None, adaptive=True, server_root=None)  # this process's CPU budget
    threads.apply()  # before every step, in the thread that runs it

A fixed count comes from ``--num-threads`` (or ``--deterministic``, whose row-by-row fallback relies on unchanged
calls, or a compiled decode, whose graphs are guarded on the count they were compiled at); otherwise the count
follows radixserve/cpu_load.py's AdaptiveThreads, up to ``cap`` (default: the CPUs this process may use).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from radixserve.cpu_budget import read_budget, wait_policy
from radixserve.cpu_load import AdaptiveThreads, ProcessTree, ProcStat

log = logging.getLogger(__name__)


class StepThreads:
    """``fixed``: the thread count to keep (None: decide); ``cap``: the most threads (None: this process's CPU
    budget, affinity and cgroup quota); ``adaptive``: fewer while other processes keep CPUs busy (only without
    ``fixed``); ``server_root``: the pid of the server's launcher, whose processes count as this runner's own
    (None: this process only, as in an Engine). Sets torch's thread count now."""

    def __init__(self, fixed: int | None, cap: int | None, adaptive: bool, server_root: int | None) -> None:
        budget = read_budget()
        self.count = fixed or cap or budget.threads()  # adaptive: the most
        self.adaptive: AdaptiveThreads | None = None  # None: ``count``, fixed
        if fixed is None and adaptive:
            mask = os.sched_getaffinity(0)
            own = ProcessTree(server_root).seconds if server_root is not None else time.process_time
            self.adaptive = AdaptiveThreads(self.count, len(mask), ProcStat(mask, own=own).read)
        torch.set_num_threads(self.count)
        log.info("%s torch threads (%s); OpenMP threads wait by %s",
                 f"up to {self.count} (fewer while other processes keep CPUs busy)" if self.adaptive else self.count,
                 budget.describe(), wait_policy(os.environ))

    def fix(self, why: str) -> None:
        """Keep ``count`` from now on (``why``: for the log)."""
        if self.adaptive is not None:
            self.adaptive = None
            log.info("%d torch threads, fixed (%s)", self.count, why)

    def apply(self) -> None:
        """The step's threads: the adaptive count (a clock read most steps), applied in the calling thread
        (OpenMP's thread count is per calling thread, and an Engine's step may run in any caller's)."""
        threads = self.adaptive.update() if self.adaptive is not None else self.count
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            if self.adaptive is not None:
                log.debug("%d torch threads (other processes keep %.1f CPUs busy)", threads, self.adaptive.others)
