"""``radixserve compare``: one workload, several policy pairs, in the simulator and/or against a live server.

    radixserve compare --workload shared-prefix --requests 2000 --eviction lru,lfu,gdsf --schedule fcfs,lpm \\
        --simulate --cache-sizes 1024,2048,4096,8192
    radixserve compare --trace my.jsonl --live http://127.0.0.1:30000 --simulate   # side by side, same trace
    radixserve compare --workload few-shot --save-trace few-shot.jsonl            # just write the trace
    radixserve compare --workload phase-shift --eviction lru,mru,filo --schedule fcfs --simulate --auto-policy
    radixserve compare --trace outputs.jsonl --draft-policies none,ngram,suffix,radix --draft-tokens 8
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

from tqdm import tqdm

from radixserve.lab import report, trace as trace_io
from radixserve.lab.auto_policy import METRICS, AutoPolicy
from radixserve.lab.auto_sim import simulate_auto
from radixserve.lab.sim_tiers import TierSpec
from radixserve.lab.simulate import CostModel, simulate
from radixserve.lab.workloads import KINDS, WorkloadSpec, build


def add_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload (built in, seeded) or --trace")
    w.add_argument("--workload", default="shared-prefix", choices=KINDS)
    for f in dataclasses.fields(WorkloadSpec):
        if f.name != "kind":
            w.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    w.add_argument("--trace", help="a JSONL trace file instead of a built-in workload (format: radixserve.lab.trace)")
    w.add_argument("--save-trace", help="write the workload as a JSONL trace here")
    p.add_argument("--eviction", default="lru,lfu,gdsf", help="comma-separated eviction policies")
    p.add_argument("--schedule", default="fcfs,lpm", help="comma-separated schedule policies")
    s = p.add_argument_group("simulator")
    s.add_argument("--simulate", action="store_true", help="run the cost-model simulator")
    s.add_argument("--cache-sizes", default="2048,4096,8192,16384", help="KV cache sizes (tokens) to sweep")
    s.add_argument("--max-running", type=int, default=64)
    s.add_argument("--chunk", type=int, default=2048, help="chunked prefill size")
    s.add_argument("--replicas", type=int, default=1,
                   help="simulate this many --dp replicas (each with the cache size), requests routed by --routing")
    s.add_argument("--routing", default="cache-aware,round-robin",
                   help="comma-separated routing policies to compare, with --replicas > 1")
    s.add_argument("--auto-policy", action="store_true",
                   help="also simulate a server that starts with the first pair and switches among all the pairs "
                        "with --auto-policy (shadows replaying the trace beside it); its rows read auto/auto")
    s.add_argument("--auto-policy-metric", default="ttft_mean_s", choices=sorted(METRICS))
    s.add_argument("--auto-policy-margin", type=float, default=0.1)
    s.add_argument("--auto-policy-hold", type=float, default=10.0, help="seconds of trace")
    s.add_argument("--auto-policy-cooldown", type=float, default=30.0, help="seconds of trace")
    s.add_argument("--shadow-window", type=float, default=60.0, help="seconds of trace the shadows' statistics cover")
    cost = CostModel()
    s.add_argument("--prefill-cost", type=float, default=cost.prefill_per_token, help="seconds per prompt token")
    s.add_argument("--decode-step-cost", type=float, default=cost.decode_per_step, help="seconds per decode step")
    s.add_argument("--decode-seq-cost", type=float, default=cost.decode_per_seq, help="seconds per sequence in it")
    s.add_argument("--step-overhead", type=float, default=cost.step_overhead, help="seconds per step")
    s.add_argument("--calibrate", metavar="URL", help="fit the four costs to a running server first")
    t = p.add_argument_group("KV tiers below the pool (simulated: --enable-hierarchical-cache)")
    t.add_argument("--write-policies", default="", help="comma-separated write policies to compare, each with the "
                   "tiers below (write_through, write_through_selective, write_back, plugins'), or none (no tiers: "
                   "the baseline); empty: no tiers")
    spec = TierSpec()
    t.add_argument("--prefetch-policy", default=spec.prefetch)
    t.add_argument("--page-size", type=int, default=spec.page_size, help="tokens per page below the pool")
    t.add_argument("--host-pages", type=int, default=spec.host_pages, help="pages host memory (L2) holds")
    t.add_argument("--storage-pages", type=int, default=spec.storage_pages, help="pages storage (L3) holds (0: none)")
    t.add_argument("--load-cost", type=float, default=spec.load_per_token, help="seconds per token read back")
    d = p.add_argument_group("speculative decoding's draft policies (acceptance on the trace's recorded outputs)")
    d.add_argument("--draft-policies", default="", help="comma-separated draft policies: each runs over the "
                   "requests that carry an output, in trace order, and the table says how many tokens a greedy "
                   "verifier would have accepted (a built-in workload's outputs are random tokens)")
    d.add_argument("--draft-tokens", type=int, default=8, help="tokens a draft may have (k)")
    d.add_argument("--draft-width", type=int, default=3, help="children a draft token may have, for a policy that "
                   "drafts trees (suffix), as the server's --speculative-draft-width; 1: chains")
    live = p.add_argument_group("live")
    live.add_argument("--live", metavar="URL", help="replay against a running server, once per policy pair")
    live.add_argument("--time-scale", type=float, default=1.0, help="stretch (>1) or squeeze arrival times")
    p.add_argument("--out", default="compare-results", help="folder for the JSON and PNG files")


def simulate_auto_row(args: argparse.Namespace, requests, pairs, size: int, cost: CostModel, bar) -> dict:
    """The simulated --auto-policy server's result, with the switches it made."""
    if args.replicas > 1:
        raise SystemExit("--auto-policy simulates one replica: drop --replicas")
    auto = AutoPolicy(args.auto_policy_metric, args.auto_policy_margin, args.auto_policy_hold,
                      args.auto_policy_cooldown)
    result, switches, _ = simulate_auto(requests, pairs, size, cost, auto, args.shadow_window,
                                        max_running=args.max_running, chunk=args.chunk, progress=bar)
    return {**result.to_dict(), "switches": [s.to_dict() for s in switches]}


def run(args: argparse.Namespace) -> int:
    if args.trace:
        requests = trace_io.load(args.trace)
        spec = {"trace": args.trace}
    else:
        ws = WorkloadSpec(kind=args.workload, **{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadSpec)
                                                 if f.name != "kind"})
        requests = build(ws)
        spec = dataclasses.asdict(ws)
    print(f"workload: {len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt tokens", file=sys.stderr)
    if args.save_trace:
        trace_io.save(requests, args.save_trace)
        print(f"wrote {args.save_trace}", file=sys.stderr)
        if not (args.simulate or args.live):
            return 0
    if args.draft_policies:
        return run_drafts(args, requests, spec)
    pairs = list(itertools.product(args.eviction.split(","), args.schedule.split(",")))
    from radixserve.policies import load_eviction_policy, load_schedule_policy

    for ev, sc in pairs:  # fail fast on a typo, before minutes of work
        load_eviction_policy(ev), load_schedule_policy(sc)
    writes = [w for w in args.write_policies.split(",") if w]
    if writes:
        from radixserve.policies import load_prefetch_policy, load_write_policy

        for w in writes:
            if w != "none":
                load_write_policy(w)
        load_prefetch_policy(args.prefetch_policy)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    payload: dict = {"workload": spec, "pairs": pairs}
    live_results = []
    if args.live:
        from radixserve.lab.live import live

        live_results = live(args.live, requests, pairs, args.time_scale,
                            progress_factory=lambda d: tqdm(total=len(requests), desc=d, leave=False))
        rows += [{"mode": "live", **r.to_dict()} for r in live_results]
    if args.simulate or not args.live:
        cost = CostModel(args.prefill_cost, args.decode_step_cost, args.decode_seq_cost, args.step_overhead)
        if args.calibrate:
            from radixserve.lab.live import calibrate

            cost = calibrate(args.calibrate)
            print(f"calibrated: {cost}", file=sys.stderr)
        payload["cost_model"] = dataclasses.asdict(cost)
        sizes = sorted({int(x) for x in args.cache_sizes.split(",")} | {r.cache_tokens for r in live_results})
        routings = args.routing.split(",") if args.replicas > 1 else ["-"]
        if args.replicas > 1:
            from radixserve.actors.router.policies import load_routing_policy

            for name in routings:  # fail fast on a typo
                load_routing_policy(name)
        tier_specs = [None if w == "none" else TierSpec(w, args.prefetch_policy, args.page_size, args.host_pages,
                                                         args.storage_pages, args.load_cost) for w in writes] or [None]
        jobs = [(ev, sc, size, routing, tiers) for size in sizes for ev, sc in pairs for routing in routings
                for tiers in tier_specs]
        autos = sizes if args.auto_policy else []
        with tqdm(total=(len(jobs) + len(autos)) * len(requests), desc="simulating", unit="req") as bar:
            for ev, sc, size, routing, tiers in jobs:
                result = simulate(requests, ev, sc, size, cost, args.max_running, args.chunk, progress=bar,
                                  replicas=args.replicas, routing=routing, tiers=tiers)
                rows.append({"mode": "sim", **result.to_dict()})
            for size in autos:
                rows.append({"mode": "sim", **simulate_auto_row(args, requests, pairs, size, cost, bar)})
    payload["results"] = rows
    print(report.table(rows))
    if live_results:
        size = live_results[0].cache_tokens
        sim_same = [r for r in rows if r["mode"] == "sim" and r["cache_tokens"] == size]
        live_rows = [r for r in rows if r["mode"] == "live"]
        payload["ranking"] = {
            "live": report.ranking(live_rows), "sim": report.ranking(sim_same),
            "same_order": report.ranking(live_rows) == report.ranking(sim_same),
        }
        print(f"\nby hit rate at {size} tokens -- live: {' > '.join(payload['ranking']['live'])}")
        print(f"                       simulated: {' > '.join(payload['ranking']['sim'])}")
    report.write_json(out / "compare.json", payload)
    name = spec.get("kind", "trace")
    written = [out / "compare.json"]
    sim_rows = [r for r in rows if r["mode"] == "sim"]
    if sim_rows:
        report.plot_hit_rate_vs_cache(sim_rows, out / "hit_rate_vs_cache.png", f"{name}: hit rate vs cache size")
        written.append(out / "hit_rate_vs_cache.png")
    largest = max((r["cache_tokens"] for r in sim_rows), default=None)
    ttft_rows = [r for r in rows if r["mode"] == "live"]
    if live_results:
        ttft_rows += [r for r in sim_rows if r["cache_tokens"] == live_results[0].cache_tokens]
    else:
        ttft_rows += [r for r in sim_rows if r["cache_tokens"] == largest]
    report.plot_ttft(ttft_rows, out / "ttft.png", f"{name}: TTFT")
    written.append(out / "ttft.png")
    print(f"\nwrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0


def run_drafts(args: argparse.Namespace, requests, spec: dict) -> int:
    """--draft-policies: each policy's acceptance over the requests' recorded outputs (radixserve/lab/
    sim_drafts.py), a table, compare.json and drafts.png."""
    from radixserve.lab import sim_drafts
    from radixserve.policies import load_draft_policy

    names = [n for n in args.draft_policies.split(",") if n]
    for name in names:  # fail fast on a typo
        load_draft_policy(name)
    if args.draft_tokens < 1 or args.draft_width < 1:
        raise SystemExit("--draft-tokens and --draft-width must be >= 1")
    traces = [(r.prompt, r.output) for r in requests if r.output]
    if not traces:
        raise SystemExit("no request in this workload carries an output: drafts are measured against recorded "
                         "outputs (a trace's \"output\" field)")
    stats = [sim_drafts.simulate_drafts(name, tqdm(traces, desc=name, unit="req", leave=False), args.draft_tokens,
                                        args.draft_width) for name in names]
    print(sim_drafts.table(stats, args.draft_tokens))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "compare.json", {"workload": spec, "draft_tokens": args.draft_tokens,
                                             "draft_width": args.draft_width,
                                             "drafts": [s.as_dict() for s in stats]})
    sim_drafts.plot(stats, out / "drafts.png", f"{spec.get('kind', 'trace')}: draft policies, k = {args.draft_tokens}")
    print(f"\nwrote {out / 'compare.json'}, {out / 'drafts.png'}", file=sys.stderr)
    return 0
