"""The runner's adaptive thread count (radixserve/cpu_load.py): the estimate of CPUs other processes keep busy from
fake /proc/stat files and own-CPU-time sequences, the thread count it asks for with its hysteresis, and a runner
given --num-threads keeping that count. No timing: a fake clock drives every read."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixserve.cpu_load import AdaptiveThreads, CpuTimes, ProcessTree, ProcStat, others_busy, threads_for

TICK = 0.01  # seconds per /proc/stat tick at 100 Hz, as the fakes below count


class FakeMachine:
    """Two CPUs' /proc/stat in a file and this process's CPU seconds, advanced by ``run``."""

    def __init__(self, path: Path, cpus: int = 2) -> None:
        self.path, self.cpus = path, cpus
        self.busy = [0] * cpus  # ticks of user time per CPU
        self.idle = [0] * cpus
        self.own = 0.0
        self.write()

    def run(self, seconds: float, ours: float, others: float) -> None:
        """``seconds`` pass with our threads on ``ours`` CPUs and other processes on ``others``."""
        ticks = round(seconds / TICK)
        used = min(self.cpus, ours + others)
        for c in range(self.cpus):
            share = min(1.0, max(0.0, used - c))
            self.busy[c] += round(ticks * share)
            self.idle[c] += ticks - round(ticks * share)
        self.own += ours * seconds * (min(self.cpus, ours + others) / (ours + others) if ours + others else 0)
        self.write()

    def write(self) -> None:
        total = f"cpu  {sum(self.busy)} 0 0 {sum(self.idle)} 0 0 0 0 0 0\n"
        per = "".join(f"cpu{c} {self.busy[c]} 0 0 {self.idle[c]} 0 0 0 0 0 0\n" for c in range(self.cpus))
        self.path.write_text(total + per + "intr 1 2 3\nprocs_running 1\n")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def governor(tmp_path: Path, cap: int = 2) -> tuple[AdaptiveThreads, FakeMachine, Clock]:
    machine = FakeMachine(tmp_path / "stat")
    stat = ProcStat(range(2), machine.path, own=lambda: machine.own)
    stat.tick = TICK
    clock = Clock()
    threads = AdaptiveThreads(cap, 2, stat.read, clock, interval=0.25, grow_after=1.0, stale=1.0, first=0.1)
    return threads, machine, clock


def steps(threads: AdaptiveThreads, machine: FakeMachine, clock: Clock, seconds: float, others: float) -> list[int]:
    """Decode for ``seconds`` in steps of 50 ms, our threads busy on as many CPUs as the count they run on."""
    seen = []
    for _ in range(round(seconds / 0.05)):
        n = threads.update()
        seen.append(n)
        machine.run(0.05, ours=n, others=others)
        clock.now += 0.05
    return seen


def test_proc_stat_sums_only_our_cpus_and_counts_steal_as_busy(tmp_path):
    path = tmp_path / "stat"
    path.write_text("cpu  900 0 0 900 0 0 0 0 0 0\n"
                    "cpu0 100 10 20 300 5 1 2 7 50 0\n"  # guest (50) is already inside user
                    "cpu1 800 0 0 100 0 0 0 0 0 0\n")
    stat = ProcStat([0], path, own=lambda: 1.5)
    stat.tick = TICK
    times = stat.read()
    assert times.busy == pytest.approx((100 + 10 + 20 + 1 + 2 + 7) * TICK)  # user nice system irq softirq steal
    assert times.idle == pytest.approx((300 + 5) * TICK) and times.own == 1.5  # idle and iowait
    assert ProcStat([5], path).read() is None  # none of our CPUs listed: no estimate, the count stays
    assert ProcStat([0], tmp_path / "missing").read() is None


def test_others_are_the_busy_time_that_is_not_ours():
    before = CpuTimes(busy=10.0, idle=10.0, own=4.0)
    # 1 s on 2 CPUs: both busy, 1 CPU-second of it ours -> others kept 1 CPU busy
    assert others_busy(before, CpuTimes(busy=12.0, idle=10.0, own=5.0), cpus=2) == pytest.approx(1.0)
    assert others_busy(before, CpuTimes(busy=11.0, idle=11.0, own=5.0), cpus=2) == pytest.approx(0.0)
    assert others_busy(before, before, cpus=2) == 0.0  # nothing elapsed
    assert others_busy(before, CpuTimes(busy=10.5, idle=11.5, own=5.0), cpus=2) == 0.0  # rounding: never < 0


def fake_proc(root: Path, tree: dict[int, list[int]], ticks: dict[int, int]) -> Path:
    """/proc with a stat file (utime = ``ticks``, stime 1) per pid and children listed on a second thread."""
    for pid, kids in tree.items():
        main, other = root / str(pid) / "task" / str(pid), root / str(pid) / "task" / str(pid + 1)
        main.mkdir(parents=True)
        other.mkdir()
        (main / "children").write_text("")
        (other / "children").write_text(" ".join(map(str, kids)) + (" " if kids else ""))
        fields = ["S"] + ["0"] * 10 + [str(ticks[pid]), "1"] + ["0"] * 30
        (root / str(pid) / "stat").write_text(f"{pid} (python (actor) x) " + " ".join(fields) + "\n")
    return root


def test_process_tree_counts_the_server_and_takes_this_process_from_process_time(tmp_path):
    """The launcher (10), its actors (20, 30) and an actor's child (40): ticks from stat, this process (30)
    from its own clock; a process gone between listing and reading counts nothing."""
    proc = fake_proc(tmp_path, {10: [20, 30], 20: [40], 30: [], 40: []}, {10: 100, 20: 50, 30: 999, 40: 9})
    tree = ProcessTree(10, proc=proc, me=30, own=lambda: 2.0)
    assert sorted(tree.pids()) == [10, 20, 30, 40]
    assert tree.seconds() == pytest.approx(2.0 + (101 + 51 + 10) * tree.tick)
    (proc / "40" / "stat").unlink()
    assert tree.seconds() == pytest.approx(2.0 + (101 + 51) * tree.tick)
    assert ProcessTree(77, proc=proc, me=30, own=lambda: 2.0).seconds() == 2.0  # no such root: only our own


def test_process_tree_of_this_process_counts_a_busy_child():
    tree = ProcessTree(os.getpid())
    before = tree.seconds()
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.6\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 60
        while tree.seconds() - before < 0.5 and time.monotonic() < deadline:  # its start-up and the loop
            time.sleep(0.05)
        assert child.pid in tree.pids() and tree.seconds() - before >= 0.5
    finally:
        child.kill()
        child.wait()


def test_threads_for_rounds_the_free_cpus_and_keeps_one():
    assert [threads_for(o, cpus=2, cap=2) for o in (0.0, 0.4, 0.6, 1.0, 2.0)] == [2, 2, 1, 1, 1]
    assert threads_for(0.0, cpus=8, cap=7) == 7 and threads_for(3.2, cpus=8, cap=7) == 5


def test_idle_machine_keeps_every_thread(tmp_path):
    threads, machine, clock = governor(tmp_path)
    assert set(steps(threads, machine, clock, 3.0, others=0.0)) == {2}
    assert threads.others == pytest.approx(0.0, abs=0.05)


def test_a_busy_neighbour_takes_a_thread_at_once_and_it_comes_back_only_after_it_left(tmp_path):
    threads, machine, clock = governor(tmp_path)
    steps(threads, machine, clock, 1.0, others=0.0)
    seen = steps(threads, machine, clock, 3.0, others=1.0)  # a neighbour starts, and stays
    first_one = seen.index(1)
    assert first_one <= 0.5 / 0.05 + 1 and set(seen[first_one:]) == {1}  # within two reads, and it stays down
    seen = steps(threads, machine, clock, 3.0, others=0.0)  # the neighbour ends
    assert seen[: round(1.0 / 0.05)] == [1] * round(1.0 / 0.05)  # not before grow_after
    assert seen[-1] == 2


def test_a_short_burst_drops_a_thread_but_a_flicker_does_not_add_one(tmp_path):
    threads, machine, clock = governor(tmp_path)
    steps(threads, machine, clock, 1.0, others=1.0)
    assert threads.threads == 1
    for _ in range(4):  # free for 0.5 s, busy for 0.5 s: never free for grow_after in a row
        assert set(steps(threads, machine, clock, 0.5, others=0.0)) == {1}
        steps(threads, machine, clock, 0.5, others=1.0)


def test_after_a_pause_it_starts_again_from_the_cap(tmp_path):
    threads, machine, clock = governor(tmp_path)
    steps(threads, machine, clock, 1.0, others=1.0)
    assert threads.threads == 1
    machine.run(5.0, ours=0, others=1.0)  # no requests for 5 s
    clock.now += 5.0
    assert threads.update() == 2
    assert steps(threads, machine, clock, 1.0, others=1.0)[-1] == 1  # still busy: down again after a read


def test_cap_bounds_the_count():
    with pytest.raises(ValueError, match="at least one thread"):
        AdaptiveThreads(0, 2, lambda: None)
    threads = AdaptiveThreads(1, 2, lambda: None)
    threads.observe(0.0, 0.0)
    threads.observe(10.0, 0.0)
    assert threads.update() == 1


def test_an_explicit_num_threads_is_never_changed(tiny_models, monkeypatch):
    import torch

    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import load_configs
    from radixserve.model.runner import ModelRunner

    path = tiny_models["llama"]
    cfg = ModelConfig.from_hf(*load_configs(path))
    before = torch.get_num_threads()
    try:
        runner = ModelRunner(cfg, path, dtype="float32", num_slots=64, num_threads=1)
        assert runner.threads.adaptive is None and torch.get_num_threads() == 1
        torch.set_num_threads(2)  # another caller's count: the step puts ours back, and nothing adapts it
        monkeypatch.setattr("radixserve.cpu_load.AdaptiveThreads.update", lambda self: pytest.fail("adapted"))
        runner.threads.apply()
        assert torch.get_num_threads() == 1

        adaptive = ModelRunner(cfg, path, dtype="float32", num_slots=64, max_threads=2)
        assert adaptive.threads.adaptive is not None and adaptive.threads.adaptive.cap == 2
        fixed = ModelRunner(cfg, path, dtype="float32", num_slots=600, max_threads=2, deterministic=True)
        assert fixed.threads.adaptive is None, "--deterministic keeps one thread count (its torch fallback needs it)"
    finally:
        torch.set_num_threads(before)


def test_an_engine_step_leaves_the_callers_thread_count_as_it_was(tiny_models, monkeypatch):
    """An Engine's steps run in the caller's thread on the runner's count (fewer while other processes keep CPUs
    busy); after each, the caller's own count is back: a test worker or a notebook beside a busy neighbour was
    otherwise left on one thread (and a native step sized for two threads ran on one's scratch)."""
    import torch

    from radixserve import Engine

    before = torch.get_num_threads()
    seen = []
    monkeypatch.setattr("radixserve.cpu_load.AdaptiveThreads.update", lambda self: 1)
    try:
        torch.set_num_threads(2)
        engine = Engine(str(tiny_models["llama"]), dtype="float32", max_total_tokens=200)
        real_forward = engine.runner.forward

        def forward(plan):  # (the runner sets the step's count as it starts)
            result = real_forward(plan)
            seen.append(torch.get_num_threads())
            return result

        engine.runner.forward = forward
        torch.set_num_threads(2)
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert len(out["output_ids"]) == 4
        assert seen and set(seen) == {1}, "the steps ran on the runner's count"
        assert torch.get_num_threads() == 2, "and the caller's is back"
        engine.shutdown()
    finally:
        torch.set_num_threads(before)
