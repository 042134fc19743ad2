"""How many CPUs this process may use, and how the runner's OpenMP threads wait for each other (torch-free).

Two rules keep decode from collapsing when the CPU is shared (with radixserve's own actors or with a neighbour):

- **Threads from the CPUs we may use**: the affinity mask (``taskset``, a cpuset) and the cgroup's CPU quota
  (a container's ``--cpus``: cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``), the smaller of
  the two, rounded down. On a large machine one CPU is left to the actors beside the runner.
- **Fewer threads, not shorter spins**: the native decode step's threads meet at a barrier after every phase of
  every layer, microseconds apart, and a thread that spins there (libgomp's default: ~300,000 iterations, then
  sleep) is much faster than one that sleeps. What collapses decode on a shared CPU is a thread spinning while the
  partner it waits for was preempted, burning the core that partner needs; the runner avoids it by running fewer
  threads while other processes keep CPUs busy (radixserve/cpu_load.py), one thread having no partner to wait for.
  The wait policy itself is left as libgomp's default or the user's ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``:
  measured side by side (benchmarks/shared_cpu.py), a shorter spin (``GOMP_SPINCOUNT=30000``) cost the server
  idle decode speed and gained nothing beside a neighbour, and sleeping at once (``OMP_WAIT_POLICY=PASSIVE``)
  cost far more idle. With a fixed thread count (``--num-threads``, ``--deterministic``,
  the compiled kernel) on a CPU others use, ``OMP_WAIT_POLICY=PASSIVE`` is the user's lever.

    budget = read_budget()
    budget.threads(ranks=1, actors_beside=True)  # what the runner of a one-rank server takes
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

USER_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one means the user chose how threads wait
RESERVE_FROM = 8  # CPUs from which one is left to the api, tokenizer and scheduler beside the runner


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """The CPUs this process may use: ``affinity`` CPUs in its mask, at most ``quota`` CPUs' worth of time
    (None: no cgroup limit)."""

    affinity: int
    quota: float | None = None

    def __post_init__(self) -> None:
        if self.affinity < 1:
            raise ValueError(f"affinity={self.affinity}: a process runs on at least one CPU")
        if self.quota is not None and not self.quota > 0:
            raise ValueError(f"quota={self.quota}: a cgroup CPU quota is a positive number of CPUs")

    @property
    def cpus(self) -> int:
        """Whole CPUs to plan for. Rounded down: threads that meet at barriers all wait once the quota throttles
        one of them, for the rest of the period (up to 100 ms), so 2 threads on 1.5 CPUs lose to 1."""
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.floor(self.quota)))

    def threads(self, ranks: int = 1, actors_beside: bool = False) -> int:
        """torch threads for each of ``ranks`` runner ranks sharing these CPUs. ``actors_beside``: the server's api,
        tokenizer and scheduler run on them too; on RESERVE_FROM CPUs or more one is theirs (below that, taking one
        of 2-4 cores from decode would cost more than the actors' short turns between steps)."""
        if ranks < 1:
            raise ValueError(f"ranks={ranks} must be >= 1")
        cpus = self.cpus - (1 if actors_beside and self.cpus >= RESERVE_FROM else 0)
        return max(1, cpus // ranks)

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup CPU quota {self.quota:g}"
        return f"{self.affinity} CPUs in the affinity mask, {quota}"


def read_budget(proc_self: Path = Path("/proc/self"), cgroup_root: Path = Path("/sys/fs/cgroup"),
                affinity: int | None = None) -> CpuBudget:
    """This process's budget (the paths and the affinity are parameters for tests)."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0))
    return CpuBudget(affinity, cgroup_quota(proc_self, cgroup_root))


def cgroup_quota(proc_self: Path = Path("/proc/self"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU limit of this process's cgroup in CPUs (the tightest along its path up to the mount's root), or
    None without one. v2 where the unified hierarchy has the cpu controller, else v1's cpu controller; a cgroup
    file that cannot be read or parsed counts as no limit (never an error: the runner must start)."""
    try:
        lines = (proc_self / "cgroup").read_text().splitlines()
    except OSError:
        return None
    v2: str | None = None
    v1: tuple[str, str] | None = None  # (controllers' mount name, path)
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = (controllers, path)
    if v2 is not None and (cgroup_root / "cgroup.controllers").exists():
        found = _tightest(cgroup_root, v2, _read_cpu_max)
        if found is not None or v1 is None:
            return found
    if v1 is not None:
        controllers, path = v1
        for mount in (cgroup_root / controllers, cgroup_root / "cpu,cpuacct", cgroup_root / "cpu"):
            if mount.is_dir():
                return _tightest(mount, path, _read_cfs)
    return None


def _tightest(mount: Path, path: str, read: Callable[[Path], float | None]) -> float | None:
    """The smallest limit ``read`` finds in the cgroup at ``path`` under ``mount`` and its ancestors. A container
    often sees its own cgroup as the mount's root while /proc/self/cgroup names a host path: the levels that do
    not exist here are skipped, and the root is read last."""
    parts = [p for p in path.strip("/").split("/") if p]
    limits = [read(mount.joinpath(*parts[:depth])) for depth in range(len(parts), -1, -1)]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def _read_cpu_max(folder: Path) -> float | None:
    """cgroup v2 ``cpu.max``: "max 100000" (no limit) or "150000 100000" (quota and period, microseconds)."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _read_cfs(folder: Path) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` (-1: no limit) over ``cpu.cfs_period_us``."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def wait_policy(environ: Mapping[str, str]) -> str:
    """How this process's OpenMP threads were told to wait, for logs and /get_server_info."""
    chosen = [f"{name}={environ[name]}" for name in USER_WAIT_VARIABLES if name in environ]
    return ", ".join(chosen) or "libgomp's default (spin, then sleep)"
