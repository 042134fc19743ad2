"""Speculative decoding on the bundled model: one stream (and 8 at once) with and without drafts, on workloads where
drafting should pay (the answer copies the prompt or an earlier answer) and on open chat, against llama.cpp's
server with its n-gram speculation. bf16, 2 threads, every system measured in one run, taking turns.

    python benchmarks/speculative.py [--quick] [--out benchmarks/results]

tok/s is the decode rate a client sees: output tokens after the first over the time from the first to the last.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_tiers import LlamaCpp, llama_gguf  # noqa: E402
from scenarios import stream_chat  # noqa: E402
from stage_results import machine  # noqa: E402

from radixserve.server_process import ServerProcess  # noqa: E402

CODE = "\n".join(
    f"def load_{i}(path, limit={i * 10}):\n    \"\"\"Read item {i} from path.\"\"\"\n    with open(path) as f:\n"
    f"        data = f.read()[:limit]\n    return data.strip().split(\",\")[{i % 3}]\n" for i in range(8))
DOC = ("The river town kept its old mill long after the trains came. Every spring the water rose to the second "
       "step of the church, and every spring the baker moved his ovens upstairs. The children counted the boats "
       "that passed, and the teacher wrote the numbers on the board. In the summer the mill stood still, and the "
       "town slept through the long afternoons. ") * 3
WORKLOADS = {  # name: (messages, whether drafting should pay)
    "code edit": ([{"role": "user", "content": "Here is a Python file:\n\n" + CODE + "\nRewrite the whole file with "
                    "every `path` renamed to `source`. Output only the code."}], True),
    "document": ([{"role": "user", "content": DOC + "\n\nCopy the text above exactly, word for word."}], True),
    "repeat answer": ([{"role": "user", "content": "Write a short poem about the sea."},
                       {"role": "assistant", "content": "The sea is wide, the sea is deep,\nit sings the sailors "
                        "off to sleep;\nit keeps the moon, it keeps the sun,\nand waits for every boat to come."},
                       {"role": "user", "content": "Say your poem again, exactly as before."}], True),
    "agent loop": ([{"role": "user", "content": "The tool returned:\n" + json.dumps(
        {"city": "Paris", "temperature": 21, "conditions": "sunny", "wind": {"speed": 12, "direction": "west"},
         "forecast": [{"day": d, "high": 20 + d, "low": 10 + d} for d in range(4)]}, indent=2)
        + "\nRepeat the tool's JSON exactly."}], True),
    "open chat": ([{"role": "user", "content": "Tell me something interesting about dragons."}], False),
}
OURS = ("none", "ngram", "suffix")
LLAMA_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")  # its n-gram drafting; the best of them is compared


async def one(url: str, messages: list[dict], max_new: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        ttft, answer, usage = await stream_chat(session, url, {"model": "m", "messages": messages, "temperature": 0,
                                                                "max_tokens": max_new})
        total = time.perf_counter() - start
    n = (usage or {}).get("completion_tokens", 0)
    return {"tokens": n, "tok_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0, "answer": answer}


async def batch(url: str, messages: list[dict], max_new: int, n: int) -> float:
    start = time.perf_counter()
    outs = await asyncio.gather(*(one(url, messages, max_new) for _ in range(n)))
    return sum(o["tokens"] for o in outs) / (time.perf_counter() - start)


def measure(quick: bool = False, rounds: int = 3, max_new: int = 128) -> dict:
    systems = {f"radixserve, {a}": (lambda a=a: ServerProcess(
        "--num-threads", "2", "--served-model-name", "m", "--max-total-tokens", "16384",
        *([] if a == "none" else ["--speculative-algorithm", a, "--speculative-num-draft-tokens", "8"]))) for a in OURS}
    gguf, why_not = llama_gguf()
    if gguf is not None:
        for t in LLAMA_TYPES[:1] if quick else LLAMA_TYPES:
            systems[f"llama.cpp, {t}"] = lambda t=t: LlamaCpp(gguf, 16384, None, 1, ["--spec-type", t,
                                                                                  "--spec-draft-n-max", "8"])
        systems["llama.cpp, none"] = lambda: LlamaCpp(gguf, 16384, None, 1)
    running = {name: make() for name, make in tqdm(systems.items(), desc="starting servers")}
    runs: dict[str, dict[str, list]] = {name: {w: [] for w in WORKLOADS} for name in running}
    batched: dict[str, dict[str, float]] = {name: {} for name in running}
    answers: dict[str, dict[str, str]] = {name: {} for name in running}
    try:
        for _ in tqdm(range(1 if quick else rounds), desc="rounds"):
            for w, (messages, _) in WORKLOADS.items():
                for name, system in running.items():  # taking turns
                    out = asyncio.run(one(system.url, messages, max_new))
                    runs[name][w].append(out["tok_s"])
                    answers[name][w] = out["answer"]
        if not quick:
            for w, (messages, _) in tqdm(WORKLOADS.items(), desc="8 at once"):
                for name, system in running.items():
                    batched[name][w] = asyncio.run(batch(system.url, messages, max_new, 8))
    finally:
        for system in running.values():
            system.stop()
    med = {name: {w: statistics.median(v) for w, v in ws.items()} for name, ws in runs.items()}
    same = {name: {w: answers[name][w] == answers["radixserve, none"][w] for w in WORKLOADS}
            for name in running if name.startswith("radixserve")}
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "max_new": max_new,
            "llama_cpp_missing": why_not, "median_tok_s": med, "batch8_tok_s": batched, "same_text_as_none": same,
            "drafting": {w: pays for w, (_, pays) in WORKLOADS.items()}}


def table(res: dict) -> str:
    names = list(res["median_tok_s"])
    head = f"{'workload':14}" + "".join(f"{n[:22]:>24}" for n in names)
    lines = [head, "-" * len(head)]
    for w in WORKLOADS:
        lines.append(f"{w:14}" + "".join(f"{res['median_tok_s'][n][w]:>24.1f}" for n in names))
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, ws = list(res["median_tok_s"]), list(WORKLOADS)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([x + i * width for x in range(len(ws))], [res["median_tok_s"][n][w] for w in ws], width, label=n)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(ws))], ws)
    ax.set(ylabel="tok/s, one stream", title="speculative decoding on the bundled model (bf16, 2 threads)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    res = measure(args.quick)
    out = Path(args.out) / "speculative"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "speculative.png")
    print(table(res))
    print(json.dumps(res["same_text_as_none"], indent=1))


if __name__ == "__main__":
    main()
