"""The runner's CPU budget (radixserve/cpu_budget.py): threads from the affinity mask and the cgroup CPU quota
(v2 cpu.max, v1 cfs files, read from fake cgroup trees), explicit overrides, and OpenMP's wait policy left as
libgomp's default or the user's setting -- checked in the runner's own process, as libgomp itself reports it
(OMP_DISPLAY_ENV)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from radixserve.cpu_budget import CpuBudget, cgroup_quota, read_budget, wait_policy
from radixserve.server_process import ServerProcess

SPINS_AT_BARRIERS = "GOMP_SPINCOUNT = '300000'"  # libgomp's default, as OMP_DISPLAY_ENV=VERBOSE prints it


def fake_v2(tmp_path: Path, cpu_max: dict[str, str], own: str = "/app.slice/server") -> tuple[Path, Path]:
    """A cgroup v2 mount with ``cpu.max`` files at the given paths, and /proc/self/cgroup naming ``own``."""
    root = tmp_path / "cgroup"
    (root / own.strip("/")).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for path, text in cpu_max.items():
        (root / path.strip("/") / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(f"0::{own}\n")
    return proc, root


def fake_v1(tmp_path: Path, quota: str, period: str = "100000", controllers: str = "cpu,cpuacct",
            own: str = "/docker/abc") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    folder = root / controllers / own.strip("/")
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text(quota + "\n")
    (folder / "cpu.cfs_period_us").write_text(period + "\n")
    (root / "unified").mkdir()  # hybrid: a v2 mount without the cpu controller
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(f"12:memory:{own}\n4:{controllers}:{own}\n0::{own}\n")
    return proc, root


def test_affinity_alone_sets_the_threads():
    budget = CpuBudget(affinity=6)
    assert budget.cpus == 6 and budget.threads() == 6
    assert budget.threads(ranks=4) == 1 and budget.threads(ranks=8) == 1  # never 0
    assert read_budget(Path("/nonexistent"), Path("/nonexistent"), affinity=3) == CpuBudget(3, None)


def test_cgroup_v2_max_is_no_limit_and_a_quota_is_rounded_down(tmp_path):
    proc, root = fake_v2(tmp_path, {"/app.slice/server": "max 100000"})
    assert cgroup_quota(proc, root) is None
    assert read_budget(proc, root, affinity=2).threads() == 2

    proc, root = fake_v2(tmp_path / "b", {"/app.slice/server": "150000 100000"})
    assert cgroup_quota(proc, root) == 1.5
    budget = read_budget(proc, root, affinity=2)
    assert budget.cpus == 1 and budget.threads() == 1  # 2 threads on 1.5 CPUs would be throttled mid-barrier


def test_cgroup_v2_takes_the_tightest_ancestor_and_a_namespaced_root(tmp_path):
    proc, root = fake_v2(tmp_path, {"/app.slice": "400000 100000", "/app.slice/server": "max 100000"})
    assert cgroup_quota(proc, root) == 4.0
    assert read_budget(proc, root, affinity=16).threads() == 4
    # a container sees its own cgroup as the mount's root while /proc/self/cgroup names the host's path
    proc, root = fake_v2(tmp_path / "ns", {"/": "250000 100000"}, own="/")
    (proc / "cgroup").write_text("0::/kubepods/pod1/ctr\n")
    assert cgroup_quota(proc, root) == 2.5


def test_cgroup_v1_quota_and_unlimited(tmp_path):
    proc, root = fake_v1(tmp_path, "300000")
    assert cgroup_quota(proc, root) == 3.0
    assert read_budget(proc, root, affinity=8).threads() == 3
    proc, root = fake_v1(tmp_path / "b", "-1")
    assert cgroup_quota(proc, root) is None
    proc, root = fake_v1(tmp_path / "c", "50000", controllers="cpu")  # half a CPU: still one thread
    assert cgroup_quota(proc, root) == 0.5 and read_budget(proc, root, affinity=4).threads() == 1


def test_unreadable_cgroup_files_mean_no_limit(tmp_path):
    proc, root = fake_v2(tmp_path, {"/app.slice/server": "garbage"})
    assert cgroup_quota(proc, root) is None
    assert cgroup_quota(tmp_path / "missing", root) is None


def test_one_cpu_is_left_to_the_other_actors_only_on_a_large_machine():
    assert CpuBudget(2).threads(actors_beside=True) == 2
    assert CpuBudget(4).threads(actors_beside=True) == 4
    assert CpuBudget(16).threads(actors_beside=True) == 15
    assert CpuBudget(16).threads(ranks=2, actors_beside=True) == 7
    assert CpuBudget(64, quota=8.0).threads(actors_beside=True) == 7
    with pytest.raises(ValueError, match="ranks=0"):
        CpuBudget(4).threads(ranks=0)
    with pytest.raises(ValueError, match="at least one CPU"):
        CpuBudget(0)


def test_wait_policy_names_the_users_setting_or_libgomps_default():
    assert wait_policy({}).startswith("libgomp's default")
    assert wait_policy({"OMP_WAIT_POLICY": "PASSIVE"}) == "OMP_WAIT_POLICY=PASSIVE"
    assert wait_policy({"GOMP_SPINCOUNT": "10000", "PATH": "/bin"}) == "GOMP_SPINCOUNT=10000"


def _without_wait_settings(monkeypatch) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")  # libgomp prints its settings when it loads


def test_engine_keeps_libgomps_spin_and_adapts_its_threads(tiny_models, monkeypatch):
    """A fresh interpreter: the Engine leaves libgomp's default spin alone (fewer threads, not shorter spins, keep
    a neighbour from collapsing decode: benchmarks/shared_cpu.py), and the runner starts on the budget's threads,
    adaptive."""
    _without_wait_settings(monkeypatch)
    code = ("import json, os, sys\n"
            "from radixserve import Engine\n"
            f"engine = Engine({str(tiny_models['llama'])!r}, dtype='float32', max_total_tokens=512)\n"
            "import torch\n"
            "from radixserve.cpu_budget import read_budget\n"
            "print(json.dumps({'threads': torch.get_num_threads(), 'budget': read_budget().threads(),\n"
            "                  'policy': os.environ.get('GOMP_SPINCOUNT'),\n"
            "                  'adaptive': engine.runner.threads.adaptive is not None}))\n"
            "engine.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["threads"] == seen["budget"] and seen["policy"] is None and seen["adaptive"]
    assert SPINS_AT_BARRIERS in done.stderr


def test_server_runner_keeps_libgomps_spin_and_the_user_overrides_win(tiny_models, monkeypatch):
    _without_wait_settings(monkeypatch)
    model = ("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens", "512")
    server = ServerProcess(*model)
    try:
        runner = httpx.get(server.url + "/get_server_info").json()["actors"]["runner"]
        log = server.output()
    finally:
        server.stop()
    assert runner["threads"] == read_budget().threads(1, actors_beside=True)
    assert runner["omp_wait"].startswith("libgomp's default") and runner["adaptive_threads"]
    assert SPINS_AT_BARRIERS in log  # libgomp's own word

    server = ServerProcess(*model, "--num-threads", "1", env={"OMP_WAIT_POLICY": "ACTIVE"})
    try:
        runner = httpx.get(server.url + "/get_server_info").json()["actors"]["runner"]
        log = server.output()
    finally:
        server.stop()
    assert runner["threads"] == 1 and runner["omp_wait"] == "OMP_WAIT_POLICY=ACTIVE"
    assert runner["adaptive_threads"] is False  # an explicit count is the count
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in log and "OMP_WAIT_POLICY = 'PASSIVE'" not in log


def test_report_judges_the_shared_cpu_stage_from_its_committed_file(tmp_path):
    """benchmarks/report.py adds the stage's section and targets from benchmarks/results/shared_cpu/results.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import report
    import shared_cpu

    labels = ["server, now", "server, before", "Engine, now", "Engine, before"]
    idle = {"server, now": 50.0, "server, before": 10.0, "Engine, now": 60.0, "Engine, before": 90.0}
    busy = {"server, now": 30.0, "server, before": 2.0, "Engine, now": 20.0, "Engine, before": 1.0}
    rounds = [{"order": labels, "load_average": 0.5, "idle": idle, "busy": busy}]
    res = {"started": "2026-12-01 22:00:00", "idle_tokens": 96, "busy_tokens": 48, "neighbour": "python -c ...",
           "machine": {"cpu": "test CPU", "cpus_in_mask": 2, "commit": "abc1234", "load_average_at_start": 0.5},
           "systems": {label: {"threads": 2, "omp_wait": "x"} for label in labels}, "rounds": rounds,
           "summary": shared_cpu.summary(rounds, labels)}
    shared_cpu.save(res, tmp_path)
    report.write({"started": "2026-12-01 22:00:00", "quick": False, "threads": 2, "model": "m", "dtype": "bfloat16"},
                 tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    assert "## One stream on a shared CPU" in text and "abc1234" in text
    assert "| server, one stream with a busy neighbour / idle | 0.6 | >= 0.40 | met |" in text
    assert "| server, one stream idle: now / before | 5 | >= 0.95 | met |" in text
    assert "| Engine, one stream with a busy neighbour / idle | 0.333 | >= 0.40 | **not met** |" in text
    assert "| Engine, one stream idle: now / before | 0.667 | >= 0.95 | **not met** |" in text
