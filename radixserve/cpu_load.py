"""How many threads the runner can run without spinning against another process, decided between steps
(torch-free).

The native decode step's threads meet at a barrier after every phase of every layer. On CPUs no one else wants,
threads that spin there (libgomp's default) are the fastest; but a spinning thread whose partner was preempted
burns the very core that partner needs, and one busy neighbour on 2 cores collapses 2 threads to a few tokens/s,
while 1 thread (no partner to wait for) keeps most of its speed. So the runner watches the CPUs it may use and
runs as many threads as other processes leave free:

    others  = (busy time of our CPUs - our own CPU time) / elapsed     (in CPUs; /proc/stat, time.process_time())
    threads = max(1, min(cap, round(len(cpus) - others)))

In a server, "our own" is the whole server on this machine: the launcher (api) and every actor it started
(tokenizer, scheduler, shadow, the other ranks), ``ProcessTree`` of the launcher. Those actors run between the
runner's steps, and measured side by side (benchmarks/shared_cpu.py) two threads that spin through their turns
decode faster than one thread that leaves them a core; counting them as "others" dropped the runner to one thread
on an idle machine.

Fewer threads at once when the estimate drops (a neighbour took a CPU); more only after the estimate has asked for
them for ``grow_after`` seconds, so a burst does not make the count flap. Our own threads never count as
"others": spinning or sleeping, their time is ours. After a pause without steps (no requests) the count starts
again from the cap: what the CPUs did during the pause says little about now, and a quiet machine should not pay
``grow_after`` seconds of one thread per request; a busy one pays ``first`` seconds of too many.

    threads = AdaptiveThreads(cap=2, cpus=read_budget().affinity, read=ProcStat(os.sched_getaffinity(0)).read)
    n = threads.update()  # every step: a clock read; /proc/stat at most every ``interval`` seconds
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

INTERVAL = 0.25  # seconds between two reads: 50 ticks of 2 CPUs at 100 Hz, so a tick of error is 0.04 CPU
GROW_AFTER = 1.5  # seconds a higher estimate must last before threads are added
STALE = 1.0  # seconds without a step after which the last read no longer says what the CPUs do now
FIRST = 0.1  # seconds to the first read after a fresh start: a busy neighbour costs no more than this at full width


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """CPU seconds up to one moment: ``busy`` and ``idle`` summed over the CPUs we may use, ``own`` this process's
    (every thread, user and system)."""

    busy: float
    idle: float
    own: float


class ProcStat:
    """Reads CpuTimes from ``/proc/stat`` (the per-CPU lines of the CPUs in ``cpus``) and ``own`` (this process's
    CPU seconds: time.process_time, to the nanosecond where os.times counts 10 ms ticks)."""

    def __init__(self, cpus: Iterable[int], path: Path = Path("/proc/stat"),
                 own: Callable[[], float] = time.process_time) -> None:
        self.cpus = frozenset(f"cpu{c}" for c in cpus)
        self.path = path
        self.own = own
        self.tick = 1.0 / os.sysconf("SC_CLK_TCK")

    def read(self) -> CpuTimes | None:
        """None where /proc/stat cannot be read or names none of our CPUs (the thread count then stays put)."""
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return None
        busy = idle = 0
        found = False
        for line in lines:
            name, _, rest = line.partition(" ")
            if name not in self.cpus:
                continue
            # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user and nice]
            fields = [int(x) for x in rest.split()[:8]]
            fields += [0] * (8 - len(fields))
            idle += fields[3] + fields[4]
            busy += fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]  # steal: another VM's
            found = True
        return CpuTimes(busy * self.tick, idle * self.tick, self.own()) if found else None


class ProcessTree:
    """CPU seconds of a process and its descendants (the server's launcher and its actors), for ProcStat's
    ``own``: this process's own time from time.process_time (nanoseconds), the others' from /proc/<pid>/stat
    (utime + stime of every thread, in ticks). Descendants are found through /proc/<pid>/task/<tid>/children
    on every read, so actors started later count too; a process that cannot be read counts nothing."""

    def __init__(self, root: int, proc: Path = Path("/proc"), me: int | None = None,
                 own: Callable[[], float] = time.process_time) -> None:
        self.root, self.proc, self.own = root, proc, own
        self.me = os.getpid() if me is None else me
        self.tick = 1.0 / os.sysconf("SC_CLK_TCK")

    def pids(self) -> list[int]:
        """The root and its descendants, root first."""
        found, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                tasks = list((self.proc / str(pid) / "task").iterdir())
            except OSError:
                continue
            for task in tasks:
                try:
                    todo += [int(child) for child in (task / "children").read_text().split()]
                except (OSError, ValueError):
                    continue
        return found

    def seconds(self) -> float:
        total = self.own()
        for pid in self.pids():
            if pid != self.me:
                total += self._ticks(pid) * self.tick
        return total

    def _ticks(self, pid: int) -> int:
        try:
            stat = (self.proc / str(pid) / "stat").read_text()
        except OSError:
            return 0
        fields = stat.rpartition(")")[2].split()  # the name may hold spaces and parentheses
        # after the name: state is field 3 of stat(5), utime and stime are fields 14 and 15
        return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0


def others_busy(before: CpuTimes, after: CpuTimes, cpus: int) -> float:
    """CPUs kept busy by other processes between two reads (0 when nothing elapsed)."""
    total = (after.busy - before.busy) + (after.idle - before.idle)
    if total <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return min(float(cpus), max(0.0, others * cpus / total))  # /proc/stat counts whole ticks


def threads_for(others: float, cpus: int, cap: int) -> int:
    """Threads that leave ``others`` CPUs to other processes: the free CPUs rounded to the nearest (a neighbour
    using half a CPU costs a thread only from half up), at least 1, at most ``cap``."""
    return max(1, min(cap, math.floor(cpus - others + 0.5)))


class AdaptiveThreads:
    """The thread count for the next step. ``cap``: the budget (cpu_budget.CpuBudget.threads); ``cpus``: how many
    CPUs ``read`` sums over. Starts at ``cap``. Mutates only itself; the caller applies the count."""

    def __init__(self, cap: int, cpus: int, read: Callable[[], CpuTimes | None],
                 clock: Callable[[], float] = time.monotonic, interval: float = INTERVAL,
                 grow_after: float = GROW_AFTER, stale: float = STALE, first: float = FIRST) -> None:
        if cap < 1 or cpus < 1:
            raise ValueError(f"cap={cap}, cpus={cpus}: the runner needs at least one thread on one CPU")
        self.cap, self.cpus, self.read, self.clock = cap, cpus, read, clock
        self.interval, self.grow_after, self.stale, self.first = interval, grow_after, stale, first
        self.threads = cap
        self.others = 0.0  # the last estimate, for logs
        self._last: tuple[float, CpuTimes] | None = None
        self._wants_more_since: float | None = None
        self._wait = first  # seconds from the last read to the next

    def update(self) -> int:
        """The threads to run the next step on: reads the CPU times when ``interval`` has passed since the last
        read (``first`` after a fresh start), else returns the current count at the cost of a clock read. After
        more than ``stale`` seconds since the last read (no steps), the cap."""
        now = self.clock()
        if self._last is not None and now - self._last[0] < self._wait:
            return self.threads
        times = self.read()
        if times is None:
            return self.threads
        if self._last is None or now - self._last[0] > self.stale:
            self.threads, self._wants_more_since = self.cap, None  # a fresh start: see the module's docstring
            self._wait = self.first
        else:
            self.observe(now, others_busy(self._last[1], times, self.cpus))
            self._wait = self.interval
        self._last = (now, times)
        return self.threads

    def observe(self, now: float, others: float) -> None:
        """One estimate of the CPUs others keep busy: drop at once, grow after ``grow_after`` seconds of asking."""
        self.others = others
        wanted = threads_for(others, self.cpus, self.cap)
        if wanted < self.threads:
            self.threads = wanted
        if wanted <= self.threads:
            self._wants_more_since = None
        elif self._wants_more_since is None:
            self._wants_more_since = now
        elif now - self._wants_more_since >= self.grow_after:
            self.threads = wanted
            self._wants_more_since = None
