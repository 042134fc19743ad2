"""What compiled decode (model/compiled.py) buys and costs, on one engine side by side: decode step time with the
compiled layers vs eager, alternating step by step on the same running batch (median per variant); the start-up
compile, cold (empty cache) and warm (a restart); and how often a greedy token flips because fused code rounds
differently from eager ops (same prompts, same engine, compiled on and off; bf16 and float32).

    python benchmarks/compile_cost.py [--repeats 3] [--quick]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from forward_speed import Ours, prompt_ids
from harness import stage_cli, write_json

from radixserve import Engine

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):", "The three laws of thermodynamics are", "My favourite recipe for pancakes:",
           "In 1969, the first humans", "Photosynthesis is the process by which", "Dear hiring manager,",
           "The quick brown fox", "A haiku about autumn:", "To install the package, run",
           "The main causes of the French Revolution were", "Water boils at", "List of prime numbers: 2, 3, 5,",
           "The best way to learn a language is", "import numpy as np\n"]
STARTUP = ("import json, time, sys; t = time.perf_counter(); from radixserve import Engine; "
           "e = Engine(sys.argv[1] or None, max_total_tokens=4096); "
           "print(json.dumps({'start_s': time.perf_counter() - t, 'compile_s': e.runner.compiled.compile_seconds}))")


def step_times(ours: Ours, batch: int, steps: int, seed: int) -> dict[str, float]:
    """Median seconds per decode step of ``batch`` requests (128-token prompts, no shared prefix), compiled and eager
    taking turns step by step: drifting load hits both alike."""
    runner = ours.runner
    compiled = runner.compiled
    for i in range(batch):
        ours._add(prompt_ids(128, seed + i), steps + 2)
    while len(ours.sched.running) < batch:
        ours.sched.process(runner.forward(ours.sched.schedule()))
    times: dict[str, list[float]] = {"compiled": [], "eager": []}
    for s in range(steps):
        name = "compiled" if s % 2 == 0 else "eager"
        runner.compiled = compiled if name == "compiled" else None
        plan = ours.sched.schedule()
        start = time.perf_counter()
        result = runner.forward(plan)
        times[name].append(time.perf_counter() - start)
        ours.sched.process(result)
    runner.compiled = compiled
    ours._drain()
    return {name: statistics.median(t) for name, t in times.items()}


def greedy(engine: Engine, prompts: list[str], max_new: int, compiled: bool, together: bool) -> list[list[int]]:
    keep = engine.runner.compiled
    engine.runner.compiled = keep if compiled else None
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    try:
        if together:
            return [r["output_ids"] for r in engine.generate(prompts, params)]
        out = []
        for p in prompts:
            engine.flush_cache()
            out.append(engine.generate(p, params)["output_ids"])
        return out
    finally:
        engine.runner.compiled = keep
        engine.flush_cache()


def flips(engine: Engine, prompts: list[str], max_new: int) -> list[dict]:
    """Greedy tokens with the compiled layers vs eager: prompts whose output differs, and where it first does."""
    rows = []
    for together in (False, True):
        a = greedy(engine, prompts, max_new, True, together)
        b = greedy(engine, prompts, max_new, False, together)
        first = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
        rows.append({"batch": len(prompts) if together else 1, "prompts": len(prompts), "tokens": max_new,
                     "differing_prompts": sum(f is not None for f in first),
                     "first_flip_positions": [f for f in first if f is not None],
                     "identical_tokens": sum(min(len(ra), f if f is not None else len(ra)) for ra, f in zip(a, first))
                     / sum(len(ra) for ra in a)})
    return rows


def startup(model_path: str | None, cache: str) -> dict:
    env = {**os.environ, "RADIXSERVE_CACHE": cache}
    env.pop("RADIXSERVE_DISABLE_COMPILE", None)
    proc = subprocess.run([sys.executable, "-c", STARTUP, model_path or ""], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(dtype: str = "bfloat16", repeats: int = 3, quick: bool = False, model_path: str | None = None) -> dict:
    res: dict = {"dtype": dtype, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="radixserve-compile-") as cache:
        # the model conversion cache is per RADIXSERVE_CACHE too: compile_s is the compile alone, start_s all of it
        res["startup"] = {"cold": startup(model_path, cache), "warm": startup(model_path, cache)}
    engine = Engine(model_path, dtype=dtype, max_total_tokens=20000, disable_compile=False)
    ours = Ours(engine)
    step_times(ours, 2, 6, 0)  # warm-up: oneDNN sets up its kernels on first use
    rows = []
    for batch in tqdm((1, 8, 32), desc="compiled vs eager", leave=False):
        runs = [step_times(ours, batch, 16 if quick else 40, 100 * r) for r in range(repeats)]
        c, e = (statistics.median(r[k] for r in runs) for k in ("compiled", "eager"))
        rows.append({"batch": batch, "compiled_tok_s": batch / c, "eager_tok_s": batch / e, "speedup": e / c})
    res["decode"] = rows
    n, max_new = (8, 24) if quick else (16, 48)
    res["flips"] = {dtype: flips(engine, PROMPTS[:n], max_new)}
    res["eager_batch_sizes"] = sorted(engine.runner.compiled.eager_sizes)
    engine.shutdown()
    exact = Engine(model_path, dtype="float32", max_total_tokens=4096, disable_compile=False)
    res["flips"]["float32"] = flips(exact, PROMPTS[: n // 2], max_new // 2)
    exact.shutdown()
    return res


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results/compile_cost.json")
    res = measure(args.dtype, args.repeats, args.quick, args.model_path)
    s = res["startup"]
    print(f"\ncompile at start-up: cold {s['cold']['compile_s']:.1f} s, warm (cached) {s['warm']['compile_s']:.1f} s")
    print(f"{'batch':>5} {'eager tok/s':>12} {'compiled tok/s':>15} {'speedup':>8}")
    for r in res["decode"]:
        print(f"{r['batch']:>5} {r['eager_tok_s']:>12.1f} {r['compiled_tok_s']:>15.1f} {r['speedup']:>7.2f}x")
    for dtype, rows in res["flips"].items():
        for r in rows:
            print(f"{dtype} batch {r['batch']}: {r['differing_prompts']}/{r['prompts']} prompts differ within "
                  f"{r['tokens']} tokens; first flips at {r['first_flip_positions']}")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
