"""Shadow policies on this machine: what they cost the server, and what --auto-policy gains.

1. Overhead. The same burst (unique prompts, every request sent at once) against a server without shadows and
   one with ``--shadow-policies all``, alternating, the cache flushed before each burst. Between bursts the
   shadow catches up (it simulates on idle CPU only); the time it takes is reported too.
2. Auto-switching. The ``phase-shift`` workload -- a scan over more prefixes than the pool holds (MRU and FILO
   keep some, LRU none), then a drifting hot prefix among one-offs (recency wins, MRU and FILO evict the hot one)
   -- replayed once per fixed policy (one server, switched and flushed between runs) and once against a server
   with ``--shadow-policies lru,mru,filo,lfu --auto-policy`` that starts at lru. The same comparison in the
   simulator, with the cost model the shadow fitted to the live server, shows whether the live gap is the policy's.

    python benchmarks/shadow_cost.py [--quick] [--model-path P]
"""
from __future__ import annotations

import random
import statistics
import time

import httpx
from tqdm import tqdm

from harness import radix_run, stage_cli, write_json

from radixserve.lab.auto_policy import AutoPolicy
from radixserve.lab.auto_sim import simulate_auto
from radixserve.lab.live import live
from radixserve.lab.simulate import CostModel, simulate
from radixserve.lab.workloads import WorkloadSpec, build
from radixserve.server_process import ServerProcess

PAIRS = [("lru", "fcfs"), ("mru", "fcfs"), ("filo", "fcfs"), ("lfu", "fcfs")]
POOL = 2150  # KV tokens: about four of phase-shift's 528-token prompts
AUTO_FLAGS = ["--auto-policy-hold", "3", "--auto-policy-cooldown", "10", "--shadow-window", "15"]
AUTO = dict(hold_s=3.0, cooldown_s=10.0)


def burst(rng: random.Random, n: int, tokens: int = 256) -> list[list[int]]:
    """Unique prompts: the same work in every round (no hit rate that varies with timing)."""
    return [[rng.randrange(1000, 30000) for _ in range(tokens)] for _ in range(n)]


def wait_caught_up(url: str, timeout: float = 600.0) -> float:
    """Seconds until the shadow has simulated everything it was fed."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        body = httpx.get(url + "/policies/shadow", timeout=30).json()
        if body.get("pairs") and not body.get("behind") and not body.get("pending"):
            return time.perf_counter() - start
        time.sleep(0.5)
    return float("nan")


def overhead(model: list[str], rounds: int, n: int, max_new: int) -> dict:
    prompts = burst(random.Random(0), n)
    plain = ServerProcess(*model)
    shadowed = ServerProcess(*model, "--shadow-policies", "all")
    runs: dict[str, list[dict]] = {"plain": [], "shadow": []}
    catch_up = []
    try:
        for server in (plain, shadowed):  # the first requests pay oneDNN's kernel set-up
            radix_run("warm-up", server.url, prompts[:4], 4)
        wait_caught_up(shadowed.url)
        for i in tqdm(range(rounds), desc="shadow overhead", leave=False):
            order = (("plain", plain), ("shadow", shadowed))
            for name, server in order if i % 2 == 0 else order[::-1]:  # ABBA: neither always goes first
                httpx.post(server.url + "/flush_cache", json={}, timeout=60)
                runs[name].append(radix_run(name, server.url, prompts, max_new).summary())
                if name == "shadow":
                    catch_up.append(wait_caught_up(server.url))
        pairs = len(httpx.get(shadowed.url + "/policies/shadow", timeout=30).json()["pairs"])
    finally:
        plain.stop()
        shadowed.stop()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("throughput_tok_s", "ttft_p50_s", "e2e_mean_s")}
           for name, rs in runs.items()}
    paired = [q["throughput_tok_s"] / p["throughput_tok_s"] for p, q in zip(runs["plain"], runs["shadow"])]
    return {"requests": len(prompts), "max_new": max_new, "rounds": rounds, "shadow_pairs": pairs, "runs": runs,
            "median": med, "round_ratios": paired,
            "throughput_ratio": statistics.median(paired),  # each round's pair side by side: drift cancels
            "e2e_ratio": statistics.median(q["e2e_mean_s"] / p["e2e_mean_s"]
                                           for p, q in zip(runs["plain"], runs["shadow"])),
            "catch_up_s": catch_up}


def row(r) -> dict:
    return {"policy": r.eviction, "hit_rate": r.hit_rate, "ttft_mean_s": r.ttft_mean_s, "ttft_p50_s": r.ttft_p50_s,
            "ttft_p99_s": r.ttft_p99_s, "makespan_s": r.makespan_s}


def auto_switching(model: list[str], spec: WorkloadSpec) -> dict:
    trace = build(spec)
    fixed_server = ServerProcess(*model, "--max-total-tokens", str(POOL))
    try:
        radix_run("warm-up", fixed_server.url, [r.prompt for r in trace[:4]], 4)
        fixed = [row(r) for r in live(fixed_server.url, trace, PAIRS)]
    finally:
        fixed_server.stop()
    auto_server = ServerProcess(*model, "--max-total-tokens", str(POOL), "--shadow-policies",
                                ",".join(ev for ev, _ in PAIRS), "--auto-policy", *AUTO_FLAGS)
    try:
        radix_run("warm-up", auto_server.url, [r.prompt for r in trace[:4]], 4)
        auto = row(live(auto_server.url, trace, None)[0])
        auto["policy"] = "auto"
        report = httpx.get(auto_server.url + "/policies/shadow", timeout=30).json()
        epochs = httpx.get(auto_server.url + "/cache/stats", timeout=30).json()["epochs"]
    finally:
        auto_server.stop()
    cost = CostModel(**report["cost_model"])  # the shadow's own fit to this server
    sim_fixed = [row(simulate(trace, ev, sc, POOL, cost)) for ev, sc in PAIRS]
    sim_auto, switches, _ = simulate_auto(trace, PAIRS, POOL, cost, AutoPolicy(**AUTO), window_s=15.0)
    best = min(fixed, key=lambda r: r["ttft_mean_s"])
    return {"workload": spec.__dict__, "pool_tokens": POOL, "pairs": PAIRS, "live": fixed + [auto],
            "switches": report["switches"], "epochs": [{k: e[k] for k in ("eviction", "schedule", "requests",
                                                                            "hit_rate", "reason")} for e in epochs],
            "cost_model": report["cost_model"], "simulated": sim_fixed + [{**row(sim_auto), "policy": "auto"}],
            "simulated_switches": [s.to_dict() for s in switches],
            "auto_vs_best_fixed_ttft": auto["ttft_mean_s"] / best["ttft_mean_s"], "best_fixed": best["policy"],
            "auto_beats_every_fixed": all(auto["ttft_mean_s"] < r["ttft_mean_s"] for r in fixed)}


def measure(quick: bool = False, model_path: str | None = None) -> dict:
    model = ["--model-path", model_path] if model_path else []
    spec = WorkloadSpec(kind="phase-shift", requests=160 if quick else 240, groups=5, prefix_tokens=512,
                        suffix_tokens=16, output_tokens=8, rate=1.5)
    return {"overhead": overhead(model, 2 if quick else 6, 32 if quick else 64, 32),
            "auto": auto_switching(model, spec)}


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results/shadow_cost.json")
    res = measure(args.quick, args.model_path)
    o = res["overhead"]
    print(f"\noverhead ({o['requests']} requests x {o['rounds']} rounds, {o['shadow_pairs']} shadow pairs): "
          f"throughput {o['throughput_ratio']:.3f}x, mean latency {o['e2e_ratio']:.3f}x; the shadow caught up in "
          f"{', '.join(f'{s:.1f}' for s in o['catch_up_s'])} s")
    a = res["auto"]
    print(f"{'policy':30} {'hit rate':>9} {'TTFT mean':>10} {'p99':>8}   simulated: {'hit':>6} {'TTFT mean':>10}")
    for live_row, sim_row in zip(a["live"], a["simulated"]):
        print(f"{live_row['policy']:30} {100 * live_row['hit_rate']:>8.1f}% {1e3 * live_row['ttft_mean_s']:>8.0f}ms "
              f"{1e3 * live_row['ttft_p99_s']:>6.0f}ms   {100 * sim_row['hit_rate']:>15.1f}% "
              f"{1e3 * sim_row['ttft_mean_s']:>8.0f}ms")
    for s in a["switches"]:
        print(f"  switch at {s['at']:.1f}: {s['reason']}")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
