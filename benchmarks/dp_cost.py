"""Data parallelism on this machine: prefix groups that do not all fit one replica's KV pool, served by one
replica, by ``--dp 2`` (cache-aware, round-robin) and by ``radixserve router`` over two separate servers
(cache-aware at SGLang's defaults and at other thresholds, round-robin): cache hit rate, throughput and TTFT.

Each round sends one question per group, all at once; the groups' system prompts together need about 1.3-1.6x one
replica's pool, so one replica keeps evicting them while two replicas can hold them all -- if each group keeps
going to the same one. Every system gets the machine's 2 cores (one replica: 2 threads; two: 1 thread each).

    python benchmarks/dp_cost.py [--quick] [--model-path P]
"""
from __future__ import annotations

import os
import random

from tqdm import tqdm

from harness import RunResult, radix_run, stage_cli, write_json
from scenarios import chat_ids, questions, text

from radixserve.actors.tokenizer import TokenizerCore
from radixserve.model.loader import resolve_model
from radixserve.server_process import ServerProcess

POOL = 3000  # KV tokens per replica


def workload(tok, groups: int, rounds: int, seed: int = 0) -> list[list[list[int]]]:
    """``rounds`` rounds of one question per group; group g's system prompt is its own ~530 tokens."""
    rng = random.Random(seed)
    systems = [f"You are assistant {g} of team {g}. Your handbook: " + text(rng, 400) for g in range(groups)]
    return [[chat_ids(tok, systems[g], q) for g, q in enumerate(questions(rng, groups))] for _ in range(rounds)]


def run(label: str, url: str, rounds: list[list[list[int]]], max_new: int) -> dict:
    parts = [radix_run(label, url, prompts, max_new) for prompts in rounds]
    total = RunResult(label, [t for p in parts for t in p.ttft], [e for p in parts for e in p.e2e],
                      sum(p.makespan for p in parts), sum(p.generated for p in parts),
                      sum(p.prompt_tokens for p in parts), sum(p.cached_tokens for p in parts))
    return total.summary()


def measure(quick: bool = False, model_path: str | None = None) -> dict:
    files = resolve_model(model_path)
    tok = TokenizerCore(files.path)
    # an odd number of groups, so that round-robin does not keep each group on one replica by accident
    groups, n_rounds, max_new = (7, 3, 8) if quick else (9, 4, 16)
    rounds = workload(tok, groups, n_rounds)
    cores = str(len(os.sched_getaffinity(0)))
    common = ["--max-total-tokens", str(POOL), "--schedule-policy", "lpm"] + (
        ["--model-path", model_path] if model_path else [])
    half = str(max(1, int(cores) // 2))
    systems = [
        ("one replica", ["serve", *common, "--num-threads", cores]),
        ("--dp 2, cache-aware", ["serve", *common, "--dp", "2"]),
        ("--dp 2, round-robin", ["serve", *common, "--dp", "2", "--routing-policy", "round-robin"]),
        ("router, cache-aware (0.3 / 64 / 1.5)", ["router"]),
        ("router, cache-aware (0.5 / 8 / 1.2)", ["router", "--cache-threshold", "0.5", "--balance-abs-threshold",
                                                  "8", "--balance-rel-threshold", "1.2"]),
        ("router, round-robin", ["router", "--policy", "round-robin"]),
    ]
    rows = []
    for label, (command, *flags) in tqdm(systems, desc="data parallelism", leave=False):
        started: list[ServerProcess] = []
        try:
            if command == "serve":
                started.append(ServerProcess(*flags))
            else:  # two separate servers, a thread each, and the router in front
                started += [ServerProcess(*common, "--num-threads", half) for _ in range(2)]
                started.append(ServerProcess(*flags, "--worker-urls", *(s.url for s in started), command="router"))
            warm = workload(tok, 2, 1, seed=99)[0]  # first requests pay oneDNN's kernel set-up
            radix_run("warm-up", started[-1].url, warm, 2)
            rows.append(run(label, started[-1].url, rounds, max_new))
        finally:
            for s in started:
                s.stop()
    prompt_tokens = sum(len(p) for p in rounds[0])
    return {"groups": groups, "rounds": n_rounds, "pool_tokens": POOL, "first_round_prompt_tokens": prompt_tokens,
            "max_new": max_new, "rows": rows}


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results/dp_cost.json")
    res = measure(args.quick, args.model_path)
    print(f"\n{res['groups']} groups x {res['rounds']} rounds, pool {res['pool_tokens']} tokens per replica")
    print(f"{'system':40} {'hit rate':>9} {'tok/s':>8} {'TTFT p50':>9}")
    for r in res["rows"]:
        print(f"{r['system']:40} {100 * r['hit_rate']:>8.1f}% {r['throughput_tok_s']:>8.1f} "
              f"{1e3 * r['ttft_p50_s']:>7.0f}ms")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
