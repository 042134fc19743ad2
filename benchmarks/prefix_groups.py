"""Shared prefixes in groups, radixserve against llama.cpp (``make bench ARGS="--only groups"``): G system prompts
of ~860 tokens each (G = 1, 2, 4, 8), 32 different questions spread over them round-robin (so each decode batch
mixes the groups' rows), all sent at once, 32 new tokens each, greedy, bf16, 2 threads each. Each round a new set
of prompts neither server has seen (the first pass), then the same 32 requests again (the repeat: their prefixes
cached). The systems take turns, the order flipping each round; medians over the rounds. ``--neighbour``: all of
it beside a busy neighbour (``python -c "while True: pass"``, started before the servers' warm-up, killed after).

llama.cpp: its server built natively (benchmarks/llama_cpp.py) on the BF16 GGUF of the same weights, its prompt
cache on (``cache_prompt``), 8 slots: a slot keeps the last prompt it ran, so a request whose slot last held the
same system prompt prefills only its question, and more slots mean more cold slots prefilling the whole system
prompt (32 slots: every request prefills all of it). 8 is its best here: one group, 4 / 8 / 16 slots gave
23.5 / 25.3 / 13.3 tok/s on the first pass and 38.0 / 55.2 / 45.8 on the repeat (Zen 3, 2 threads).

Output tok/s = completion tokens / wall time of the 32 requests. Results go to
``benchmarks/results/prefix_groups/results.json`` (committed) and a PNG; REPORT.md's section is built from them,
with the CPU, the instruction set of radixserve's kernel and whether it had AMX tiles.

    python benchmarks/prefix_groups.py [--quick] [--rounds N] [--groups 1,2,4,8] [--neighbour]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

from tqdm import tqdm

import cpu_peer
import llama_cpp
import shared_cpu
from harness import llama_run, radix_run
from scenarios import chat_ids, questions, text
from stage_results import load_stage, machine, save_stage

from radixserve.server_process import ServerProcess

STAGE = "prefix_groups"
GROUPS = (1, 2, 4, 8)
REQUESTS, MAX_NEW = 32, 32
SYSTEM_WORDS = 760  # ~860 tokens with the chat template
LLAMA_SLOTS = 8
TARGET = 10.0  # radixserve / llama.cpp output tok/s, first pass and repeat (issue 32)
PASSES = ("first", "repeat")


def workload(tok, groups: int, seed: int) -> tuple[list[list[int]], int]:
    """The 32 prompts (question i on system prompt i mod groups) and the shortest system prompt's tokens."""
    rng = random.Random(seed)
    systems = [f"You are assistant {seed}-{g} of a large company. Here is the handbook. " + text(rng, SYSTEM_WORDS)
               for g in range(groups)]
    prompts = [chat_ids(tok, systems[i % groups], q) for i, q in enumerate(questions(rng, REQUESTS))]
    shortest = min(len(tok.apply_chat_template([{"role": "system", "content": s}], False)) for s in systems)
    return prompts, shortest


def kernel() -> dict:
    """What radixserve's native step runs on here: its instruction set and whether AMX tiles are granted."""
    from radixserve.kernels import cpu_native

    try:
        lib = cpu_native.load(cpu_native.default_cache_dir())
    except cpu_native.NativeUnavailable as exc:
        return {"isa": None, "amx": False, "why": str(exc)}
    return {"isa": cpu_native.isa(lib), "amx": lib.rs_request_amx() == 1}


def measure(quick: bool = False, rounds: int = 3, groups: tuple[int, ...] = GROUPS, busy: bool = False) -> dict:
    from radixserve.actors.tokenizer import TokenizerCore
    from radixserve.model.loader import resolve_model

    files = resolve_model(None)
    tok = TokenizerCore(files.path)
    rounds = 1 if quick else rounds
    ours = ServerProcess("--num-threads", "2", "--max-total-tokens", "40000")
    try:
        llama = cpu_peer.LlamaServer(llama_cpp.gguf_files(files.path)["bf16"], slot_tokens=2048, slots=LLAMA_SLOTS)
        why_not = None
    except (llama_cpp.Unavailable, RuntimeError) as exc:
        llama, why_not = None, str(exc)
    systems = {"radixserve": (ours.url, radix_run)}
    if llama is not None:
        systems["llama.cpp"] = (llama.url, llama_run)
    runs = {str(g): {name: {p: [] for p in PASSES} for name in systems} for g in groups}
    system_tokens = {}
    try:
        with shared_cpu.neighbour() if busy else nullcontext():
            warm, _ = workload(tok, 2, seed=-1)  # first requests pay oneDNN's and llama.cpp's set-up
            for name, (url, run) in systems.items():
                run(name, url, warm[:8], 8)
            with tqdm(total=rounds * len(groups), desc="prefix groups") as bar:
                for r in range(rounds):
                    for g in groups:
                        prompts, system_tokens[str(g)] = workload(tok, g, seed=100 * g + r)
                        order = list(systems) if r % 2 == 0 else list(reversed(systems))
                        for name in order:
                            url, run = systems[name]
                            for p in PASSES:  # the same prompts twice: cold, then cached
                                runs[str(g)][name][p].append(run(name, url, prompts, MAX_NEW).throughput)
                        bar.update()
    finally:
        ours.stop()
        if llama is not None:
            llama.stop()
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "kernel": kernel(),
            "quick": quick, "rounds": rounds, "neighbour": busy, "requests": REQUESTS, "max_new": MAX_NEW,
            "llama_slots": LLAMA_SLOTS,
            "llama_cpp_missing": why_not, "system_prompt_tokens": system_tokens, "runs_tok_s": runs,
            "median_tok_s": {g: {n: {p: statistics.median(v) for p, v in ps.items()} for n, ps in ns.items()}
                             for g, ns in runs.items()}}


def ratios(res: dict) -> dict[str, dict[str, float]]:
    """radixserve / llama.cpp per group count and pass (empty without llama.cpp)."""
    med = res["median_tok_s"]
    return {g: {p: ns["radixserve"][p] / ns["llama.cpp"][p] for p in PASSES} for g, ns in med.items()
            if "llama.cpp" in ns}


def table(res: dict) -> str:
    r = ratios(res)
    lines = [f"{'groups':>6} {'pass':>7} {'radixserve':>11} {'llama.cpp':>10} {'ratio':>7}"]
    for g, ns in res["median_tok_s"].items():
        for p in PASSES:
            theirs = ns.get("llama.cpp", {}).get(p)
            lines.append(f"{g:>6} {p:>7} {ns['radixserve'][p]:>11.1f} {theirs or 0:>10.1f} "
                         f"{r[g][p] if g in r else 0:>6.2f}x")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    from report import plot_bars  # report imports this module: imported when called

    med = res["median_tok_s"]
    series = {f"{n}, {p}": [med[g][n][p] for g in med] for n in ("radixserve", "llama.cpp") for p in PASSES
              if all(n in med[g] for g in med)}
    plot_bars([f"{g} group(s)" for g in med], series, "output tok/s", f"{res['requests']} requests at once on "
              f"shared system prompts, {res['max_new']} tokens each (bf16, 2 threads)", path)


def load(results_dir: Path) -> dict | None:
    return load_stage(results_dir, STAGE)


def save(res: dict, results_dir: Path) -> None:
    save_stage(res, results_dir, STAGE)
    plot(res, results_dir / "prefix_groups.png")


def section(res: dict, targets: list[str], check) -> list[str]:
    m, k, r = res["machine"], res["kernel"], ratios(res)
    for g, by_pass in r.items():
        for p, ratio in by_pass.items():
            targets.append(check(f"prefix groups, {g} group(s), {p} pass: radixserve / llama.cpp", ratio,
                                 ratio >= TARGET, f">= {TARGET:.0f}x"))
    med = res["median_tok_s"]
    rows = [f"| {g} | {res['system_prompt_tokens'][g]} | " + " | ".join(
        f"{med[g]['radixserve'][p]:.1f} / {med[g]['llama.cpp'][p]:.1f} ({r[g][p]:.2f}x)" if g in r else
        f"{med[g]['radixserve'][p]:.1f} / -" for p in PASSES) + " |" for g in med]
    amx = "AMX tiles" if k.get("amx") else f"no AMX ({k.get('isa') or 'no native kernel'})"
    busy = ", **beside a busy neighbour** (one process spinning on a CPU)" if res.get("neighbour") else ""
    return ["## Shared prefixes in groups (issue 32)", "",
            f"Measured {res['started']} on commit {m['commit']}, {m['cpu']}, {m['cpus_in_mask']} CPUs, radixserve's "
            f"kernel: {amx} (`python benchmarks/prefix_groups.py`). {res['requests']} requests at once, question i "
            f"on system prompt i mod G, {res['max_new']} new tokens each, greedy, bf16, 2 threads each; each round "
            "new prompts (first pass), then the same requests again (repeat); systems taking turns, "
            f"{res['rounds']} round(s), medians{busy}. llama.cpp: its server on the BF16 GGUF of the same weights, "
            f"{res['llama_slots']} slots, prompt cache on." +
            (f" llama.cpp missing: {res['llama_cpp_missing']}." if res.get("llama_cpp_missing") else ""), "",
            "| groups | system prompt tokens (shortest) | first pass tok/s, ours / llama.cpp | repeat |", "|---|---|---|---|",
            *rows, "", "![prefix groups](prefix_groups.png)", ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", default=",".join(map(str, GROUPS)))
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--neighbour", action="store_true", help="beside a process spinning on a CPU")
    args = ap.parse_args()
    res = measure(args.quick, args.rounds, tuple(int(g) for g in args.groups.split(",")), args.neighbour)
    save(res, Path(args.out))
    print(table(res))


if __name__ == "__main__":
    main()
