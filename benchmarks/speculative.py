"""Speculative decoding on the bundled model: one stream (and 8 at once) with and without drafts, on workloads where
drafting should pay (the answer copies the prompt or an earlier answer) and on open chat, against llama.cpp's
server with its n-gram speculation. bf16, 2 threads, every system measured in one run, taking turns.

    python benchmarks/speculative.py [--quick] [--out benchmarks/results]     (or: make bench ARGS="--only speculative")

Every round asks each workload in a new variant (another code file, document, poem, tool output, topic), so no
system answers a request it has seen: what a draft policy learned from earlier requests helps only as far as the
variants share text. tok/s is the decode rate a client sees: output tokens after the first over the time from the
first to the last; at batch 8, all output tokens over the wall time of the 8 requests sent at once.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_tiers import LlamaCpp, llama_gguf  # noqa: E402
from scenarios import stream_chat  # noqa: E402
from stage_results import load_stage, machine, save_stage  # noqa: E402

from radixserve.server_process import ServerProcess  # noqa: E402

STAGE = "speculative"
DRAFTING_TARGET = 1.8  # suffix drafts vs no drafts, one stream, each workload where drafting should pay
SLOWER_TARGET = 0.97  # any draft policy vs no drafts, every workload, one stream and 8 at once
LLAMA_TARGET = 1.3  # suffix drafts vs llama.cpp's best n-gram speculation, one stream, drafting workloads
OURS = ("none", "ngram", "suffix")
LLAMA_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")  # llama.cpp's model-free drafting (--spec-type)
POLICY = "radixserve, suffix"  # the one the targets are for
DRAFT_TOKENS = 8
MAX_NEW = 128
BATCH_ROUNDS = 3  # rounds of 8 requests at once (not with --quick)

WORDS = ("path", "limit", "items", "count", "table", "frame", "block", "token", "river", "cache", "queue", "index")
SENTENCES = (
    "The river town kept its old mill long after the trains came.",
    "Every spring the water rose to the second step of the church.",
    "Every spring the baker moved his ovens upstairs.",
    "The children counted the boats that passed, and the teacher wrote the numbers on the board.",
    "In the summer the mill stood still, and the town slept through the long afternoons.",
    "A ferry crossed twice a day, carrying milk, letters and the priest.",
    "The old bridge was closed in the year of the great flood.",
    "Nobody remembered who had planted the row of poplars along the road.",
    "On market days the square filled with carts before sunrise.",
    "The station master kept a garden of roses beside the tracks.",
    "In winter the river froze, and the boys skated to the next village.",
    "The mill's wheel was painted red once, and never again.",
)
POEMS = (
    "The sea is wide, the sea is deep,\nit sings the sailors off to sleep;\nit keeps the moon, it keeps the sun,\n"
    "and waits for every boat to come.",
    "The hills are green, the hills are high,\nthey hold the clouds against the sky;\nthey keep the rain, they keep "
    "the snow,\nand watch the rivers come and go.",
    "The road is long, the road is grey,\nit takes the travellers away;\nit keeps the dust, it keeps the stone,\n"
    "and brings them back again alone.",
    "The night is still, the night is cold,\nit hears the stories we have told;\nit keeps the stars, it keeps the "
    "dark,\nand waits for morning's little spark.",
)
CITIES = ("Paris", "Lisbon", "Oslo", "Vienna", "Quebec", "Lima", "Kyoto", "Dakar")
TOPICS = ("dragons", "the deep ocean", "volcanoes", "ancient libraries", "honey bees", "comets", "deserts",
          "lighthouses")


def workloads(variant: int) -> dict[str, tuple[list[dict], bool]]:
    """name: (messages, whether drafting should pay), the ``variant``-th of each."""
    rng = random.Random(variant)
    names = rng.sample(WORDS, 8)
    code = "\n".join(
        f"def load_{n}(source, limit={rng.randrange(10, 99)}):\n    \"\"\"Read one {n} from source.\"\"\"\n"
        f"    with open(source) as f:\n        data = f.read()[:limit]\n    return data.strip().split(\",\")"
        f"[{rng.randrange(3)}]\n" for n in names)
    doc = " ".join(rng.sample(SENTENCES, 8))
    tool = {"city": CITIES[variant % len(CITIES)], "temperature": rng.randrange(5, 30),
            "conditions": rng.choice(["sunny", "cloudy", "rain"]),
            "wind": {"speed": rng.randrange(2, 30), "direction": rng.choice(["west", "north", "east"])},
            "forecast": [{"day": d, "high": rng.randrange(15, 30), "low": rng.randrange(0, 15)} for d in range(4)]}
    return {
        "code edit": ([{"role": "user", "content": "Here is a Python file:\n\n" + code + "\nRewrite the whole file "
                        "with every `source` renamed to `path`. Output only the code."}], True),
        "document": ([{"role": "user", "content": doc + "\n\nCopy the text above exactly, word for word."}], True),
        "repeat answer": ([{"role": "user", "content": "Write a short poem."},
                           {"role": "assistant", "content": POEMS[variant % len(POEMS)]},
                           {"role": "user", "content": "Say your poem again, exactly as before."}], True),
        "agent loop": ([{"role": "user", "content": "The tool returned:\n" + json.dumps(tool, indent=2)
                         + "\nRepeat the tool's JSON exactly."}], True),
        "open chat": ([{"role": "user", "content": f"Tell me something interesting about "
                        f"{TOPICS[variant % len(TOPICS)]}."}], False),
    }


WORKLOADS = list(workloads(0))


async def one(url: str, messages: list[dict], max_new: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        ttft, answer, usage = await stream_chat(session, url, {"model": "m", "messages": messages, "temperature": 0,
                                                                "max_tokens": max_new})
        total = time.perf_counter() - start
    n = (usage or {}).get("completion_tokens", 0)
    return {"tokens": n, "tok_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0, "answer": answer}


async def at_once(url: str, messages: list[dict], max_new: int, n: int) -> float:
    start = time.perf_counter()
    outs = await asyncio.gather(*(one(url, messages, max_new) for _ in range(n)))
    return sum(o["tokens"] for o in outs) / (time.perf_counter() - start)


def spec_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/cache/stats", timeout=30) as resp:
        return json.loads(resp.read()).get("speculative", {})


def measure(quick: bool = False, rounds: int = 5, llama_cpp: bool = True) -> dict:
    systems = {f"radixserve, {a}": (lambda a=a: ServerProcess(
        "--num-threads", "2", "--served-model-name", "m", "--max-total-tokens", "16384",
        *([] if a == "none" else ["--speculative-algorithm", a, "--speculative-num-draft-tokens",
                                  str(DRAFT_TOKENS)]))) for a in OURS}
    gguf, why_not = llama_gguf() if llama_cpp else (None, "left out (--no-llama-cpp)")
    if gguf is not None:  # 8 slots, for the 8 requests at once; one stream uses one of them
        systems["llama.cpp, none"] = lambda: LlamaCpp(gguf, 16384, None, 8)
        for t in LLAMA_TYPES:
            systems[f"llama.cpp, {t}"] = lambda t=t: LlamaCpp(gguf, 16384, None, 8, [
                "--spec-type", t, "--spec-draft-n-max", str(DRAFT_TOKENS)])
    running = {name: make() for name, make in tqdm(systems.items(), desc="starting servers")}
    names = list(running)
    runs: dict[str, dict[str, list]] = {name: {w: [] for w in WORKLOADS} for name in names}
    batched: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    same: dict[str, dict[str, list[bool]]] = {name: {w: [] for w in WORKLOADS} for name in names
                                               if name.startswith("radixserve") and name != "radixserve, none"}
    stats = {}
    try:
        for name in names:  # first requests warm each server up, alone and 8 at once (not measured)
            asyncio.run(one(running[name].url, workloads(-1)["open chat"][0], 16))
            if not quick:
                asyncio.run(at_once(running[name].url, workloads(-1)["code edit"][0], 16, 8))
        for r in tqdm(range(1 if quick else rounds), desc="rounds, one stream"):
            for w, (messages, _) in workloads(r).items():
                answers = {}
                for name in names[r % len(names):] + names[: r % len(names)]:  # taking turns, each round rotated
                    out = asyncio.run(one(running[name].url, messages, MAX_NEW))
                    runs[name][w].append(out["tok_s"])
                    answers[name] = out["answer"]
                for name in same:
                    same[name][w].append(answers[name] == answers["radixserve, none"])
        for r in tqdm(range(0 if quick else BATCH_ROUNDS), desc="rounds, 8 at once"):
            for w, (messages, _) in workloads(100 + r).items():
                for name in names[r % len(names):] + names[: r % len(names)]:
                    batched[name].setdefault(w, []).append(
                        asyncio.run(at_once(running[name].url, messages, MAX_NEW, 8)))
        stats = {name: spec_stats(running[name].url) for name in names if name in same}
    finally:
        for system in running.values():
            system.stop()
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "max_new": MAX_NEW,
            "draft_tokens": DRAFT_TOKENS, "rounds": 1 if quick else rounds, "llama_cpp_missing": why_not,
            "median_tok_s": {name: {w: statistics.median(v) for w, v in ws.items()} for name, ws in runs.items()},
            "runs_tok_s": runs,
            "batch8_tok_s": {name: {w: statistics.median(v) for w, v in ws.items()} for name, ws in batched.items()},
            "batch8_runs_tok_s": batched, "same_text_as_none": same, "speculative_stats": stats,
            "drafting": {w: pays for w, (_, pays) in workloads(0).items()}}


def best_llama(res: dict, w: str) -> tuple[str | None, float]:
    """llama.cpp's fastest n-gram speculation on workload ``w`` (one stream)."""
    rows = {n: v[w] for n, v in res["median_tok_s"].items() if n.startswith("llama.cpp") and n != "llama.cpp, none"}
    if not rows:
        return None, 0.0
    name = max(rows, key=rows.get)
    return name, rows[name]


def table(res: dict, key: str = "median_tok_s") -> str:
    names = list(res[key])
    head = f"{'workload':14}" + "".join(f"{n[-22:]:>24}" for n in names)
    lines = [head, "-" * len(head)]
    for w in WORKLOADS:
        lines.append(f"{w:14}" + "".join(f"{res[key][n].get(w, 0.0):>24.1f}" for n in names))
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("median_tok_s", "one stream: tok/s")] + ([("batch8_tok_s", "8 at once: output tok/s")]
                                                         if any(res["batch8_tok_s"].values()) else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4.2 * len(panels)), squeeze=False)
    for ax, (key, label) in zip(axes[:, 0], panels):
        names = [n for n in res[key] if res[key][n]]
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            ax.bar([x + i * width for x in range(len(WORKLOADS))], [res[key][n].get(w, 0.0) for w in WORKLOADS],
                   width, label=n)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(WORKLOADS))], WORKLOADS)
        ax.set(ylabel=label, title=f"speculative decoding, bundled model (bf16, 2 threads, {DRAFT_TOKENS} draft "
                                   "tokens at most)")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load(results_dir: Path) -> dict | None:
    return load_stage(results_dir, STAGE)


def save(res: dict, results_dir: Path) -> None:
    save_stage(res, results_dir, STAGE)
    plot(res, results_dir / "speculative.png")


def section(res: dict, targets: list[str], check) -> list[str]:
    med, b8, m = res["median_tok_s"], res["batch8_tok_s"], res["machine"]
    base = med["radixserve, none"]
    for w, pays in res["drafting"].items():
        ratio = med[POLICY][w] / base[w]
        if pays:
            targets.append(check(f"speculative, {w}: suffix / no drafts, one stream", ratio,
                                 ratio >= DRAFTING_TARGET, f">= {DRAFTING_TARGET:.1f}x"))
            name, best = best_llama(res, w)
            if name is not None:
                r = med[POLICY][w] / best
                targets.append(check(f"speculative, {w}: suffix / {name} (its best n-gram)", r, r >= LLAMA_TARGET,
                                     f">= {LLAMA_TARGET:.1f}x"))
    for name in (n for n in med if n.startswith("radixserve") and n != "radixserve, none"):
        worst = min(med[name][w] / base[w] for w in WORKLOADS)
        targets.append(check(f"speculative, {name.split(', ')[1]}: slowest workload / no drafts, one stream", worst,
                             worst >= SLOWER_TARGET, f">= {SLOWER_TARGET:.2f}x"))
        if b8.get(name):
            worst8 = min(b8[name][w] / b8["radixserve, none"][w] for w in WORKLOADS)
            targets.append(check(f"speculative, {name.split(', ')[1]}: slowest workload / no drafts, 8 at once",
                                 worst8, worst8 >= SLOWER_TARGET, f">= {SLOWER_TARGET:.2f}x"))

    def rows(key: str) -> list[str]:
        names = [n for n in res[key] if res[key][n]]
        return [f"| workload | {' | '.join(names)} |", "|---|" + "---|" * len(names),
                *[f"| {w} | " + " | ".join(f"{res[key][n][w]:.1f}" for n in names) + " |" for w in WORKLOADS]]

    stats = res.get("speculative_stats", {})
    L = ["## Speculative decoding (--speculative-algorithm)", "",
         f"Measured {res['started']} on commit {m['commit']}, {m['cpu']}, {m['cpus_in_mask']} CPUs "
         f"(`python benchmarks/speculative.py`; bf16, 2 threads each, the bundled model, greedy, {res['max_new']} new "
         f"tokens, drafts of at most {res['draft_tokens']} tokens; llama.cpp's server on the BF16 GGUF of the same "
         "weights, `--spec-type` each of its model-free types, `--spec-draft-n-max 8`). Systems take turns request "
         f"by request; {res['rounds']} round(s) (1: `--quick`, no batch of 8), each a new variant of every "
         "workload (another file, document, poem, tool output, topic), medians. Workloads where drafting should pay: rewriting a given code file, copying "
         "a given document, repeating an earlier answer, repeating a tool's output; and open chat, where it should "
         "not.", "", "One stream, decode tok/s (output tokens after the first over the time from the first to the "
         "last):", "", *rows("median_tok_s"), ""]
    if any(b8.values()):
        L += [f"8 identical requests at once, output tok/s over the wall time (medians of {BATCH_ROUNDS} rounds, "
              "taking turns as above; each server first warmed up by 8 short requests at once):", "",
              *rows("batch8_tok_s"), ""]
    if stats:
        L += ["Draft statistics over the whole run: " + "; ".join(
            f"{n.split(', ')[1]}: {s.get('acceptance_rate', 0):.0%} of {s.get('drafted', 0)} draft tokens kept, "
            f"{s.get('mean_accepted', 0):.2f} a draft" for n, s in stats.items()) + ".", ""]
    differ = {n: [w for w, v in ws.items() if not all(v)] for n, ws in res["same_text_as_none"].items()}
    if any(differ.values()):
        L += ["Answers that differ from the run without drafts (bf16 without `--deterministic`: a checking step "
              "multiplies matrices of another shape than a decode step and rounds differently, so a near-tie can "
              "go the other way; in float32 and under `--deterministic` the tokens are the same, "
              "tests/test_speculative.py): " + "; ".join(f"{n.split(', ')[1]}: {', '.join(ws)}"
                                                         for n, ws in differ.items() if ws) + ".", ""]
    L += ["![speculative](speculative.png)", ""]
    return L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5, help="one-stream rounds")
    ap.add_argument("--no-llama-cpp", action="store_true", help="radixserve's systems only (e.g. to measure an AVX2 "
                    "build on an AVX-512 machine: RADIXSERVE_MARCH=x86-64-v3, with --out elsewhere)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    res = measure(args.quick, args.rounds, not args.no_llama_cpp)
    save(res, Path(args.out))
    print(table(res))
    if any(res["batch8_tok_s"].values()):
        print(table(res, "batch8_tok_s"))


if __name__ == "__main__":
    main()
