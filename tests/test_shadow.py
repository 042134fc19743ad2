"""Shadow policies and --auto-policy: the ShadowLab on hand-made feeds, its agreement with the simulator, the
hysteresis of AutoPolicy, auto-switching on a workload whose best policy changes halfway, the starvation numbers
(the server's shadow process: test_shadow_server.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from radixserve.actors.scheduler import SchedulerConfig
from radixserve.lab.auto_policy import AutoPolicy
from radixserve.lab.auto_sim import simulate_auto
from radixserve.lab.shadow import MAX_LAG_S, ShadowLab, fit_cost, resolve_pairs
from radixserve.lab.simulate import CostModel, simulate
from radixserve.lab.workloads import WorkloadSpec, build
from radixserve.policies import available
from radixserve.wire.messages import ShadowArrival, ShadowEnd, ShadowFeed, StepTiming

COST = CostModel(prefill_per_token=0.001, decode_per_step=0.012, decode_per_seq=0.001, step_overhead=0.001)
CONFIG = SchedulerConfig(context_length=4096, vocab_size=50000, eos_ids=frozenset(), chunked_prefill_size=512)


def test_resolve_pairs():
    live = ("lru", "fcfs")
    assert resolve_pairs("lru,lfu,lpm", live) == [("lru", "fcfs"), ("lru", "lpm"), ("lfu", "lpm")]
    assert resolve_pairs("mru", live) == [("lru", "fcfs"), ("mru", "fcfs")], "the live schedule stands in"
    assert resolve_pairs("gdsf:lpm, lru", live) == [("lru", "fcfs"), ("gdsf", "lpm")]
    assert ("priority", "priority") in resolve_pairs("priority", live), "a name of both kinds counts as both"
    everything = resolve_pairs("all", live)
    assert everything[0] == live and len(everything) == len(available("eviction")) * len(available("schedule"))
    with pytest.raises(ValueError, match="neither an eviction policy"):
        resolve_pairs("lru,nope", live)
    with pytest.raises(ValueError, match="unknown schedule policy 'nope'"):
        resolve_pairs("lru:nope", live)


def test_fit_cost_recovers_the_step_costs():
    rng = np.random.default_rng(0)
    samples = [("extend", int(t), 1, COST.step_overhead + COST.prefill_per_token * int(t)) for t in
               rng.integers(16, 2048, 40)]
    samples += [("decode", int(b), int(b), COST.step_overhead + COST.decode_per_step + COST.decode_per_seq * int(b))
                for b in rng.integers(1, 32, 40)]
    fitted = fit_cost(samples, CostModel())
    for name in ("prefill_per_token", "decode_per_step", "decode_per_seq", "step_overhead"):
        assert getattr(fitted, name) == pytest.approx(getattr(COST, name), rel=1e-6, abs=1e-9), name
    assert fit_cost(samples[:3], COST) == COST, "too few samples keep the model it had"


def feed(now, arrivals=(), ends=(), steps=(), pair=("lru", "fcfs"), capacity=2000) -> ShadowFeed:
    return ShadowFeed(now, *pair, capacity, list(arrivals), list(ends), list(steps))


def arrival(rid: str, at: float, prompt: list[int], max_new: int = 4) -> ShadowArrival:
    return ShadowArrival(rid, at, np.asarray(prompt, dtype=np.int32), max_new)


def end(rid: str, output: list[int], at: float = 0.0, admitted: bool = True) -> ShadowEnd:
    return ShadowEnd(rid, at, np.asarray(output, dtype=np.int32), admitted)


def test_the_horizon_waits_for_the_oldest_live_request():
    lab = ShadowLab([("lru", "fcfs"), ("mru", "fcfs")], CONFIG, window_s=100, cost=COST, calibrated=True)
    system = list(range(100, 400))
    lab.feed(feed(0.0, [arrival("a", 0.0, system + [1]), arrival("b", 0.5, system + [2])]), wall=0.0)
    assert lab.horizon == 0.0 and not lab.released, "nothing ended: nothing may be simulated"
    lab.feed(feed(1.0, ends=[end("b", [7, 7, 7, 7], at=0.5)]), wall=1.0)
    assert lab.horizon == 0.0 and not lab.released, "b ended, but a (older) is still live"
    lab.feed(feed(2.0, ends=[end("a", [5, 5, 5, 5])]), wall=2.0)
    assert [e.rid for e in lab.released] == ["a", "b"] and lab.horizon == 2.0
    lab.advance(float("inf"))
    for row in lab.pair_stats():
        assert row["requests"] == 2 and row["cached_tokens"] == 300, "b reuses a's 300-token system prompt"
        assert row["live"] == (row["eviction"] == "lru") and row["error"] is None
    lab.feed(feed(3.0, [arrival("c", 3.0, [9] * 50)]), wall=3.0)
    lab.feed(feed(4.0), wall=3.0 + MAX_LAG_S + 1)
    assert lab.released[-1].rid == "c" and lab.released[-1].output == [0] * 4, \
        "a request live for longer than MAX_LAG_S is released with its budget as its output"


def test_nothing_is_simulated_before_the_cost_model_is_fitted():
    lab = ShadowLab([("lru", "fcfs")], CONFIG)  # starts from the default cost model, not this server's
    lab.feed(feed(0.0, [arrival("a", 0.0, [5] * 40)]), wall=0.0)
    lab.feed(feed(1.0, ends=[end("a", [1, 2, 3, 4])], steps=[StepTiming("extend", 40, 1, 0.05)]), wall=1.0)
    assert not lab.advance(float("inf"), wall=1.0) and lab.sims[("lru", "fcfs")].cursor == 0
    steps = [StepTiming("extend", 16 * (i + 1), 1, 0.001 * (i + 1)) for i in range(8)]
    steps += [StepTiming("decode", i + 1, i + 1, 0.01 + 0.001 * i) for i in range(8)]
    lab.feed(feed(2.0, steps=steps), wall=2.0)
    lab.advance(float("inf"), wall=2.0)
    assert lab.calibrated and lab.cost.decode_per_seq == pytest.approx(0.001)
    assert lab.pair_stats()[0]["requests"] == 1
    late = ShadowLab([("lru", "fcfs")], CONFIG)
    late.feed(feed(0.0), wall=0.0)
    assert not late.ready(1.0) and late.ready(MAX_LAG_S + 1), "traffic that never decodes waits MAX_LAG_S at most"


def test_a_pair_that_fails_is_stopped_and_the_others_go_on(monkeypatch):
    lab = ShadowLab([("lru", "fcfs"), ("lfu", "fcfs")], CONFIG, cost=COST, calibrated=True)
    lab.feed(feed(0.0, [arrival("a", 0.0, [5] * 40)]), wall=0.0)
    monkeypatch.setattr(lab.sims[("lfu", "fcfs")].sched, "schedule", lambda: 1 / 0)
    lab.feed(feed(1.0, ends=[end("a", [1, 2, 3, 4])]), wall=1.0)
    lab.advance(float("inf"))
    rows = {r["eviction"]: r for r in lab.pair_stats()}
    assert "ZeroDivisionError" in rows["lfu"]["error"] and rows["lru"]["requests"] == 1


def test_a_pair_switched_to_by_hand_is_shadowed_from_then_on():
    lab = ShadowLab([("lru", "fcfs")], CONFIG, cost=COST, calibrated=True)
    lab.feed(feed(0.0, [arrival("a", 0.0, [5] * 40)]), wall=0.0)
    lab.feed(feed(1.0, ends=[end("a", [1])], pair=("gdsf", "lpm")), wall=1.0)
    assert ("gdsf", "lpm") in lab.sims and lab.sims[("gdsf", "lpm")].started == 1.0
    lab.advance(float("inf"))
    rows = {(r["eviction"], r["schedule"]): r for r in lab.pair_stats()}
    assert rows[("gdsf", "lpm")]["live"] and rows[("gdsf", "lpm")]["requests"] == 1, \
        "it starts with the first request not yet released when it joined"
    assert AutoPolicy(min_requests=0).leader(list(rows.values()))["eviction"] == "lru", \
        "a pair that joined late is never the leader: its numbers cover less of the trace"


def test_a_policy_that_cannot_load_or_raises_stops_its_pair_only(monkeypatch):
    import radixserve.lab.shadow as shadow

    class Boom:
        name = "boom"

        def key(self, node, now):
            raise RuntimeError("boom")

    real = shadow.load_eviction_policy

    def load(name):
        if name == "nope":
            raise ValueError("eviction policy 'nope' failed to load")
        return Boom() if name == "boom" else real(name)

    monkeypatch.setattr(shadow, "load_eviction_policy", load)
    lab = ShadowLab([("lru", "fcfs"), ("nope", "fcfs"), ("boom", "fcfs")], CONFIG, cost=COST, calibrated=True)
    system = list(range(100, 400))
    lab.feed(feed(0.0, [arrival(f"r{i}", i, system + [i]) for i in range(6)]), wall=0.0)
    lab.feed(feed(9.0, ends=[end(f"r{i}", [1, 2, 3, 4], at=i) for i in range(6)], capacity=400), wall=9.0)
    lab.feed(feed(10.0, pair=("nope", "fcfs")), wall=10.0)  # switched by hand to it: still refused, never fatal
    lab.advance(float("inf"))
    report = lab.report()
    assert [p["eviction"] for p in report["failed_pairs"]] == ["nope"] and ("nope", "fcfs") not in lab.sims
    rows = {r["eviction"]: r for r in report["pairs"]}
    assert rows["lru"]["requests"] == 6 and rows["lru"]["error"] is None
    assert "boom" in rows["boom"]["error"], "its numbers are the fallback's: marked, so it is never the leader"
    assert AutoPolicy(min_requests=1).leader(report["pairs"])["eviction"] == "lru"


def test_a_reused_rid_and_requests_that_never_ran():
    lab = ShadowLab([("lru", "fcfs")], CONFIG, cost=COST, calibrated=True)
    lab.feed(feed(0.0, [arrival("x", 0.0, [5] * 40)]), wall=0.0)
    lab.feed(feed(1.0, [arrival("x", 1.0, [6] * 40), arrival("gone", 1.0, [7] * 40)],
                  ends=[end("x", [1, 1], at=0.0)]), wall=1.0)
    lab.feed(feed(2.0, ends=[end("x", [2, 2, 2], at=1.0), end("gone", [], at=1.0, admitted=False)]), wall=2.0)
    assert [(e.rid, e.output) for e in lab.released] == [("x", [1, 1]), ("x", [2, 2, 2])], \
        "each x keeps its own answer; the one aborted before it ran is not replayed"
    assert not lab.pending and not lab.by_rid and lab.horizon == 2.0


def test_the_tap_is_bounded_and_a_gap_restarts_the_pending_trace(monkeypatch):
    import radixserve.actors.scheduler.shadow_tap as tap_module
    from radixserve.actors.scheduler.shadow_tap import ShadowTap

    monkeypatch.setattr(tap_module, "MAX_KEPT", 10)

    class FakeReq:
        def __init__(self, i):
            self.rid, self.arrival, self.prompt_ids, self.max_new_tokens, self.priority = f"r{i}", i, [1, 2], 2, 0
            self.output_ids, self.cached_tokens = [3], 0

    tap = ShadowTap()
    for i in range(25):
        tap.arrived(FakeReq(i))
    assert len(tap.arrivals) <= 10 and tap.dropped > 0
    from types import SimpleNamespace as Ns

    live = Ns(clock=lambda: 30.0, policy=Ns(name="fcfs"), cache=Ns(eviction_policy=Ns(name="lru"), capacity=2000))
    msg = tap.feed(live)
    lab = ShadowLab([("lru", "fcfs")], CONFIG, cost=COST, calibrated=True)
    lab.feed(feed(0.0, [arrival("old", 0.0, [5] * 40)]), wall=0.0)
    lab.feed(msg, wall=30.0)
    assert lab.gaps == 1 and all(e.rid != "old" for e in lab.pending), "what was pending before the gap is gone"
    tap.sent(30.0)
    assert not tap.pending and tap.dropped == 0


def test_adopting_the_running_pair_changes_nothing():
    from radixserve.actors.scheduler import Scheduler
    from radixserve.cache import CacheManager
    from radixserve.policies import load_eviction_policy, load_schedule_policy

    sched = Scheduler(CONFIG, CacheManager(100, load_eviction_policy("gdsf")), load_schedule_policy("fcfs"))
    policy = sched.cache.eviction_policy
    sched.policies.adopt("gdsf", "fcfs", reason="auto-policy: test")
    assert len(sched.policies.epochs) == 1
    sched.policies.adopt("gdsf", "lpm", reason="auto-policy: test")
    assert sched.cache.eviction_policy is policy and sched.policies.policy.name == "lpm", "gdsf keeps its clock"
    assert sched.policies.epochs[-1].reason == "auto-policy: test"


def test_auto_policy_respects_a_hand_switch_for_a_cooldown():
    auto = AutoPolicy(margin=0.1, hold_s=0, cooldown_s=20, min_requests=1)
    assert auto.decide(0, ("lru", "fcfs"), [row("lru", 1.0), row("mru", 1.0)]) is None
    assert auto.decide(5, ("lfu", "fcfs"), [row("lfu", 1.0), row("mru", 0.5)]) is None, "switched by hand at 5"
    assert auto.decide(24, ("lfu", "fcfs"), [row("lfu", 1.0), row("mru", 0.5)]) is None
    assert auto.decide(25, ("lfu", "fcfs"), [row("lfu", 1.0), row("mru", 0.5)]).new == ("mru", "fcfs")
    late = {**row("gdsf", 1.0), "started": 30.0}
    assert auto.decide(60, ("gdsf", "fcfs"), [late, row("mru", 0.5)]) is None, \
        "a live pair shadowed only since a hand switch is no fair baseline"


def row(ev: str, ttft: float, requests: int = 20) -> dict:
    return {"eviction": ev, "schedule": "fcfs", "requests": requests, "ttft_mean_s": ttft, "error": None,
            "started": None}


def test_auto_policy_hysteresis():
    auto = AutoPolicy(margin=0.1, hold_s=5, cooldown_s=20, min_requests=8)
    live = ("lru", "fcfs")
    assert auto.decide(0, live, [row("lru", 1.0), row("mru", 0.95)]) is None, "5% better: inside the margin"
    assert auto.decide(1, live, [row("lru", 1.0), row("mru", 0.5)]) is None, "leads, but not yet for hold_s"
    assert auto.decide(4, live, [row("lru", 1.0), row("mru", 0.5)]) is None
    assert auto.decide(5, live, [row("lru", 1.0), row("mru", 0.95)]) is None, "the lead was lost: start again"
    assert auto.decide(9, live, [row("lru", 1.0), row("mru", 0.5)]) is None
    assert auto.decide(13, live, [row("lru", 1.0), row("mru", 0.5, requests=3)]) is None, "too few requests"
    switch = auto.decide(15, live, [row("lru", 1.0), row("mru", 0.5)])
    assert switch is None, "the lead restarted at 15 (the sample before had too few requests)"
    switch = auto.decide(20, live, [row("lru", 1.0), row("mru", 0.5)])
    assert switch is not None and switch.new == ("mru", "fcfs") and switch.old == live
    assert "ttft_mean_s 0.5 vs live lru/fcfs 1" in switch.reason and "50% better" in switch.reason
    live = switch.new
    assert auto.decide(30, live, [row("lru", 0.2), row("mru", 0.5)]) is None
    assert auto.decide(36, live, [row("lru", 0.2), row("mru", 0.5)]) is None, "inside the cooldown"
    assert auto.decide(40, live, [row("lru", 0.2), row("mru", 0.5)]).new == ("lru", "fcfs")
    with pytest.raises(ValueError, match="choose one of"):
        AutoPolicy(metric="speed")


def test_hit_rate_metric_prefers_larger():
    auto = AutoPolicy(metric="hit_rate", hold_s=0, cooldown_s=0, min_requests=1)
    rows = [{**row("lru", 1.0), "hit_rate": 0.2}, {**row("mru", 1.0), "hit_rate": 0.6}]
    assert auto.decide(0, ("lru", "fcfs"), rows).new == ("mru", "fcfs")


PHASES = WorkloadSpec(kind="phase-shift", requests=300, groups=5, prefix_tokens=256, suffix_tokens=16,
                      output_tokens=8, rate=1.5)
CACHE = 1160


def test_the_live_pairs_shadow_agrees_with_the_simulated_server():
    """The shadow of the pair the (simulated) server runs replays what the server did: same requests, same
    hits -- the trace, the release rule and the fitted cost model lose nothing."""
    trace = build(WorkloadSpec(kind="shared-prefix", requests=120, groups=4, rate=4.0))
    result, switches, obs = simulate_auto(trace, [("lru", "fcfs"), ("mru", "fcfs")], 1500, COST, None, window_s=1e9)
    obs.lab.advance(float("inf"))
    rows = {r["eviction"]: r for r in obs.lab.pair_stats()}
    assert not switches and rows["lru"]["live"]
    assert rows["lru"]["requests"] == result.requests == 120
    assert rows["lru"]["cached_tokens"] == result.cached_tokens
    assert rows["lru"]["ttft_mean_s"] == pytest.approx(result.ttft_mean_s, rel=0.05)


def test_auto_policy_beats_every_fixed_policy_when_the_best_one_changes():
    trace = build(PHASES)
    pairs = [("lru", "fcfs"), ("mru", "fcfs"), ("filo", "fcfs"), ("lfu", "fcfs")]
    auto = AutoPolicy(hold_s=3, cooldown_s=10, min_requests=5)
    result, switches, obs = simulate_auto(trace, pairs, CACHE, COST, auto, window_s=15)
    fixed = {ev: simulate(trace, ev, sc, CACHE, COST) for ev, sc in pairs}
    for ev, r in fixed.items():
        assert result.ttft_mean_s < r.ttft_mean_s, f"auto {result.ttft_mean_s:.3f} vs fixed {ev} {r.ttft_mean_s:.3f}"
        assert result.hit_rate > r.hit_rate, ev
    assert switches[0].old == ("lru", "fcfs") and switches[0].new[0] in ("mru", "filo"), "the scan: away from lru"
    assert switches[-1].new == ("lru", "fcfs"), "the drifting hot prefix: back to recency"
    epochs = obs.live.policies.epochs
    assert len(epochs) == len(switches) + 1 and all(e.reason.startswith("auto-policy: ") for e in epochs[1:])


# -- starvation numbers ---------------------------------------------------------------------------------------
def test_latency_summary_by_hand():
    from radixserve.actors.scheduler.stats import latency_summary

    ttft = [1.0] * 19 + [81.0]  # one request in twenty carries 81 of the 100 seconds
    s = latency_summary(ttft, cold_ttft=[1.0, 81.0], waits=[0.5, 7.0, 2.0])
    assert s["slowest5_ttft_share"] == pytest.approx(0.81) and s["ttft_mean_s"] == pytest.approx(5.0)
    assert s["cold_requests"] == 2 and s["cold_ttft_p99_s"] == 81.0 and s["max_queue_wait_s"] == 7.0
    assert s["ttft_p50_s"] == 1.0
    even = latency_summary([2.0] * 40, [], [])
    assert even["slowest5_ttft_share"] == pytest.approx(0.05) and even["cold_ttft_p99_s"] is None
    assert latency_summary([], [], [])["slowest5_ttft_share"] is None


def test_lpm_concentrates_ttft_on_few_requests():
    """What SGLang users report of LPM under load, in the simulator's numbers: its slowest 5% carry a far larger
    share of all TTFT than FCFS's do."""
    trace = build(WorkloadSpec(kind="few-shot", requests=400, rate=8, groups=4, prefix_tokens=256, noise=0.3))
    slow = CostModel(prefill_per_token=0.002, decode_per_step=0.035, decode_per_seq=0.003)  # more than it serves
    fcfs, lpm = (simulate(trace, "lru", sc, 4096, slow) for sc in ("fcfs", "lpm"))
    assert lpm.slowest5_ttft_share > 1.4 * fcfs.slowest5_ttft_share
    assert fcfs.max_queue_wait_s > 0 and lpm.cold_ttft_p99_s is not None


def test_epochs_record_cold_requests_and_queue_waits():
    from radixserve.actors.scheduler import Scheduler
    from radixserve.cache import CacheManager
    from radixserve.lab.simulate import CostModelRunner, SimClock
    from radixserve.policies import load_eviction_policy, load_schedule_policy
    from radixserve.sampling_params import SamplingParams

    clock = SimClock()
    sched = Scheduler(CONFIG, CacheManager(4000, load_eviction_policy("lru"), clock=clock),
                      load_schedule_policy("lpm"), clock=clock)
    outputs = {f"r{i}": [1, 2] for i in range(3)}
    runner = CostModelRunner(COST, clock, outputs)
    system = list(range(100, 400))
    for i in range(3):
        sched.add_request(f"r{i}", system + [i], SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))
    while sched.has_work:
        sched.process(runner.forward(sched.schedule(), sched.inflight))
    epoch = sched.policies.cache_stats()["epochs"][-1]
    assert epoch["requests"] == 3 and epoch["cold_requests"] == 1, "the first computes the system prompt ..."
    first_step = COST.step_overhead + COST.prefill_per_token * 301
    assert epoch["max_queue_wait_s"] == pytest.approx(first_step), "... the others wait one step and reuse it"
    assert 0.05 < epoch["slowest5_ttft_share"] <= 1.0 and epoch["cold_ttft_p99_s"] > 0


def test_compare_cli_simulates_auto_policy(tmp_path):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "radixserve", "compare", "--workload", "phase-shift", "--requests",
                           "240", "--groups", "5", "--prefix-tokens", "256", "--suffix-tokens", "16",
                           "--output-tokens", "8", "--rate", "1.5", "--eviction", "lru,mru,filo", "--schedule", "fcfs",
                           "--simulate", "--cache-sizes", "1160", "--auto-policy", "--auto-policy-hold", "3",
                           "--auto-policy-cooldown", "10", "--shadow-window", "15", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "auto             auto" in proc.stdout and "cold p99" in proc.stdout
    rows = json.loads((tmp_path / "compare.json").read_text())["results"]
    auto = next(r for r in rows if r["eviction"] == "auto")
    assert auto["switches"] and auto["switches"][0]["to"]["eviction"] in ("mru", "filo")
    assert all(auto["hit_rate"] > r["hit_rate"] for r in rows if r is not auto)


def test_with_kv_tiers_every_pair_is_shadowed_with_them_and_each_write_policy_is_compared():
    """A server with --enable-hierarchical-cache: its pairs are simulated with its tiers below their pools, and
    the live pair once more under every other write policy (report()["writes"])."""
    from radixserve.lab.sim_tiers import TierSpec

    lab = ShadowLab([("lru", "fcfs")], CONFIG, window_s=1e9, cost=COST, calibrated=True,
                    tiers=TierSpec("write_back", page_size=16, host_pages=64))
    prompts = {name: [100 + i + 1000 * k for i in range(300)] for k, name in enumerate("abcd")}
    order = ["a", "b", "c", "d", "a"]  # a is pushed out of a 1000-token pool by b, c, d, then comes back
    arrivals = [arrival(f"{n}{i}", float(i), prompts[n]) for i, n in enumerate(order)]
    lab.feed(feed(0.0, arrivals, capacity=1000), wall=0.0)
    lab.feed(feed(9.0, ends=[end(f"{n}{i}", [1, 2, 3, 4], at=float(i)) for i, n in enumerate(order)],
                  capacity=1000), wall=9.0)
    lab.advance(float("inf"))
    live = lab.pair_stats()[0]
    assert live["write"] == "write_back" and live["tier_hit_rates"]["L2"] > 0, live
    writes = {r["write"]: r for r in lab.report()["writes"]}
    assert set(writes) == set(available("write")), "the live pair under every write policy"
    assert writes["write_through_selective"]["tier_hit_rates"]["L2"] == 0, "a was never reused before it left"
    assert writes["write_through"]["cached_tokens"] == live["cached_tokens"] > 0


def test_with_speculation_every_draft_policy_is_measured_on_the_live_greedy_requests():
    """A server that drafts: each greedy request that ended goes through every installed draft policy (but
    draft-model: a second model per request) as the simulator runs them; a sampled request is not measured (its
    output is not the argmax); each policy's figures equal the simulator's on the same requests."""
    import dataclasses

    from radixserve.lab.sim_drafts import simulate_drafts

    lab = ShadowLab([("lru", "fcfs")], dataclasses.replace(CONFIG, draft_policy="suffix", draft_tokens=4),
                    cost=COST, calibrated=True)
    phrase = list(range(100, 140))
    greedy = [(phrase * 2 + [i], phrase[:30]) for i in range(3)]
    for i, (prompt, _) in enumerate(greedy):
        lab.feed(feed(float(i), [arrival(f"g{i}", float(i), prompt, 30)]), wall=float(i))
    lab.feed(feed(3.0, [arrival("s", 3.0, phrase * 2, 30)]), wall=3.0)
    lab.feed(feed(4.0, ends=[end(f"g{i}", out, at=float(i)) for i, (_, out) in enumerate(greedy)]
                  + [ShadowEnd("s", 3.0, np.asarray(phrase[:30], dtype=np.int32), True, False)]), wall=4.0)
    drafts = {row["policy"]: row for row in lab.report()["drafts"]}
    assert set(drafts) == set(available("draft")) - {"none", "draft-model"}
    for name, row in drafts.items():
        assert row == simulate_drafts(name, greedy, 4).as_dict(), name
    assert drafts["suffix"]["requests"] == 3 and drafts["suffix"]["accepted"] > 0
    assert "drafts" not in ShadowLab([("lru", "fcfs")], CONFIG, cost=COST).report()
