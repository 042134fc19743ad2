"""The compare tool: workloads, traces, the simulator (the real scheduler on a simulated clock), the CLI, and
a live replay against a server."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from radixserve.lab import trace as trace_io
from radixserve.lab.simulate import CostModel, simulate
from radixserve.lab.workloads import KINDS, WorkloadSpec, build


@pytest.mark.parametrize("kind", KINDS)
def test_workloads_are_seeded_and_valid(kind, tmp_path):
    spec = WorkloadSpec(kind=kind, requests=40, groups=4, prefix_tokens=32, suffix_tokens=8, output_tokens=4, rate=5)
    a, b = build(spec), build(spec)
    assert a == b and len(a) >= 20
    assert build(WorkloadSpec(**{**spec.__dict__, "seed": 1})) != a
    path = tmp_path / "t.jsonl"
    trace_io.save(a, path)
    assert trace_io.load(path) == a


def test_sharing_structure_of_workloads():
    chat = build(WorkloadSpec(kind="multi-turn", requests=6, groups=2, prefix_tokens=10, suffix_tokens=3,
                              output_tokens=2))
    t0, t1 = chat[0], chat[1]
    assert t1.after == t0.id and t1.prompt[: len(t0.prompt) + 2] == t0.prompt + t0.output, "turn 2 quotes turn 1"
    tot = build(WorkloadSpec(kind="tree-of-thought", requests=8, groups=1, prefix_tokens=10, output_tokens=2))
    root = tot[0]
    assert all(r.prompt[: len(root.prompt)] == root.prompt for r in tot)


def test_trace_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": [1], "max_tokens": 2}\n{"id": "b", "prompt": [], "max_tokens": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: .*empty prompt"):
        trace_io.load(bad)
    bad.write_text('{"id": "a", "prompt": [1], "max_tokens": 2, "after": "zzz"}\n')
    with pytest.raises(ValueError, match="after 'zzz'"):
        trace_io.load(bad)


def test_simulator_runs_the_real_scheduler_and_lpm_beats_fcfs_when_the_cache_is_small():
    trace = build(WorkloadSpec(kind="shared-prefix", requests=300, groups=10, prefix_tokens=128, rate=0))
    kw = dict(cache_tokens=640, cost=CostModel(), max_running=16, check_invariants=True)
    fcfs, lpm = simulate(trace, "lru", "fcfs", **kw), simulate(trace, "lru", "lpm", **kw)
    assert fcfs.requests == lpm.requests == 300
    assert lpm.hit_rate > fcfs.hit_rate + 0.2
    assert simulate(trace, "lru", "lpm", **kw).hit_rate == lpm.hit_rate, "deterministic"
    big = simulate(trace, "lru", "fcfs", 1 << 15, CostModel(), max_running=16)
    assert big.hit_rate > fcfs.hit_rate and big.evicted_tokens == 0


def test_simulated_replicas_route_like_the_router():
    """Two replicas, each with a cache that holds about half the groups' prefixes: cache-aware routing keeps each
    group on one replica and hits far more than round-robin, which sends every group everywhere; both serve every
    request, and one replica with the same cache falls in between on hit rate."""
    trace = build(WorkloadSpec(kind="shared-prefix", requests=240, groups=12, prefix_tokens=200, rate=5))
    kw = dict(cache_tokens=1800, cost=CostModel(), max_running=16, check_invariants=True)
    aware = simulate(trace, "lru", "lpm", replicas=2, routing="cache-aware", **kw)
    rr = simulate(trace, "lru", "lpm", replicas=2, routing="round-robin", **kw)
    one = simulate(trace, "lru", "lpm", **kw)
    assert aware.requests == rr.requests == one.requests == 240
    assert aware.hit_rate > rr.hit_rate + 0.15 and aware.hit_rate > one.hit_rate
    assert (aware.replicas, aware.routing, one.replicas, one.routing) == (2, "cache-aware", 1, None)
    assert aware.makespan_s < one.makespan_s, "two replicas run in parallel"


def test_cli_simulates_and_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "radixserve", "compare", "--workload", "few-shot", "--requests",
                           "80", "--cache-sizes", "512,2048", "--eviction", "lru,gdsf", "--schedule", "fcfs,lpm",
                           "--out", str(out), "--save-trace", str(tmp_path / "t.jsonl"), "--simulate"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "hit rate" in proc.stdout and proc.stdout.count("\nsim ") == 8
    data = json.loads((out / "compare.json").read_text())
    assert len(data["results"]) == 8 and data["workload"]["kind"] == "few-shot"
    assert (out / "hit_rate_vs_cache.png").stat().st_size > 1000 and (out / "ttft.png").stat().st_size > 1000
    again = subprocess.run([sys.executable, "-m", "radixserve", "compare", "--trace", str(tmp_path / "t.jsonl"),
                            "--cache-sizes", "512", "--eviction", "lru", "--schedule", "lpm", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    routed = subprocess.run([sys.executable, "-m", "radixserve", "compare", "--trace", str(tmp_path / "t.jsonl"),
                             "--cache-sizes", "512", "--eviction", "lru", "--schedule", "lpm", "--replicas", "2",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert routed.returncode == 0, routed.stderr
    assert "cache-aware x2" in routed.stdout and "round-robin x2" in routed.stdout
    typo = subprocess.run([sys.executable, "-m", "radixserve", "compare", "--eviction", "lur"], capture_output=True,
                          text=True, timeout=300)
    assert typo.returncode == 2 and "unknown eviction policy 'lur'" in typo.stderr


def test_live_replay_against_a_server(tiny_server, tmp_path):
    import httpx

    out = tmp_path / "live"
    proc = subprocess.run([sys.executable, "-m", "radixserve", "compare", "--workload", "shared-prefix",
                           "--requests", "24", "--groups", "3", "--prefix-tokens", "64", "--output-tokens", "4",
                           "--rate", "50", "--vocab-high", "20000", "--eviction", "lru", "--schedule", "fcfs,lpm",
                           "--live", tiny_server.url, "--simulate", "--cache-sizes", "512", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "compare.json").read_text())
    live = [r for r in data["results"] if r["mode"] == "live"]
    assert len(live) == 2 and all(r["requests"] == 24 and r["hit_rate"] > 0 for r in live)
    assert all(r["server_epoch"]["requests"] == 24 for r in live), "each pair ran in an epoch of its own"
    assert set(data["ranking"]) == {"live", "sim", "same_order"}
    httpx.post(tiny_server.url + "/policies", json={"eviction": "lru", "schedule": "fcfs"})  # shared server: restore
