"""The decode kernels side by side on one engine: the native step (kernels/native/), the torch.compile'd
layers (model/compiled.py) and eager, alternating step by step on the same running batch (median per kernel); what
each costs at start-up, cold (empty cache) and warm (a restart); how often a greedy token differs from eager's
(same prompts, same engine; bf16 and float32) because the native and fused code round in other places; and which
kernel's bf16 tokens stay closer to the float32 model's.

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
from radixserve.model.compiled import CompiledDecode
from radixserve.trusted_cache import cache_root

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):", "The three laws of thermodynamics are", "My favourite recipe for pancakes:",
           "In 1969, the first humans", "Photosynthesis is the process by which", "Dear hiring manager,",
           "The quick brown fox", "A haiku about autumn:", "To install the package, run",
           "The main causes of the French Revolution were", "Water boils at", "List of prime numbers: 2, 3, 5,",
           "The best way to learn a language is", "import numpy as np\n"]
KERNELS = ("native", "compiled", "eager")
STARTUP = ("import json, time, sys; t = time.perf_counter(); from radixserve import Engine; "
           "e = Engine(sys.argv[1] or None, max_total_tokens=4096, decode_kernel=sys.argv[2]); "
           "c = e.runner.compiled; print(json.dumps({'start_s': time.perf_counter() - t, "
           "'compile_s': c.compile_seconds if c else e.runner.native_build_seconds}))")


class Kernels:
    """One runner with both fast paths attached; ``use(name)`` leaves it the one asked for (or neither)."""

    def __init__(self, engine: Engine) -> None:
        runner = self.runner = engine.runner
        self.native = runner.native
        self.compiled = CompiledDecode(runner.model, runner.kv, runner.rope, cache_root() / "inductor")
        self.compiled.warm_up(runner.attn, runner.dtype, runner.device, runner._group, 64)

    def use(self, name: str) -> None:
        self.runner.native = self.native if name == "native" else None
        self.runner.compiled = self.compiled if name == "compiled" else None


def step_times(ours: Ours, kernels: Kernels, batch: int, steps: int, seed: int) -> dict[str, float]:
    """Median seconds per decode step of ``batch`` requests (128-token prompts, no shared prefix), the kernels
    taking turns step by step: drifting load hits all alike."""
    for i in range(batch):
        ours._add(prompt_ids(128, seed + i), steps + 2)
    while len(ours.sched.running) < batch:
        ours.sched.process(ours.runner.forward(ours.sched.schedule()))
    times: dict[str, list[float]] = {name: [] for name in KERNELS}
    for s in range(steps):
        name = KERNELS[s % len(KERNELS)]
        kernels.use(name)
        plan = ours.sched.schedule()
        start = time.perf_counter()
        result = ours.runner.forward(plan)
        times[name].append(time.perf_counter() - start)
        ours.sched.process(result)
    kernels.use("native")
    ours._drain()
    return {name: statistics.median(t) for name, t in times.items()}


def greedy(engine: Engine, kernels: Kernels, prompts: list[str], max_new: int, kernel: str,
           together: bool) -> list[list[int]]:
    kernels.use(kernel)
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
        kernels.use("native")
        engine.flush_cache()


def flips(engine: Engine, kernels: Kernels, prompts: list[str], max_new: int) -> list[dict]:
    """Greedy tokens of the native and compiled kernels vs eager's: prompts whose output differs, where it first
    does, and the share of tokens before the first difference."""
    rows = []
    for together in (False, True):
        want = greedy(engine, kernels, prompts, max_new, "eager", together)
        for kernel in ("native", "compiled"):
            got = greedy(engine, kernels, prompts, max_new, kernel, together)
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, want)]
            rows.append({"kernel": kernel, "batch": len(prompts) if together else 1, "prompts": len(prompts),
                         "tokens": max_new, "differing_prompts": sum(f is not None for f in first),
                         "first_flip_positions": [f for f in first if f is not None],
                         "identical_tokens": sum(min(len(a), f if f is not None else len(a))
                                                 for a, f in zip(got, first)) / sum(len(a) for a in got)})
    return rows


def agreement(engine: Engine, kernels: Kernels, prompts: list[str], max_new: int,
              reference: list[list[int]]) -> list[dict]:
    """Each kernel's greedy tokens (one prompt at a time) against ``reference`` (the float32 model's): which of two
    kernels that round differently is the more faithful one."""
    rows = []
    for kernel in KERNELS:
        got = greedy(engine, kernels, prompts, max_new, kernel, False)
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, reference)]
        rows.append({"kernel": kernel, "prompts": len(prompts), "tokens": max_new,
                     "identical_prompts": sum(f is None for f in first),
                     "tokens_before_difference": sum(max_new if f is None else f for f in first)})
    return rows


def startup(model_path: str | None, cache: str, kernel: str) -> dict:
    env = {**os.environ, "RADIXSERVE_CACHE": cache}
    env.pop("RADIXSERVE_DISABLE_COMPILE", None)
    proc = subprocess.run([sys.executable, "-c", STARTUP, model_path or "", kernel], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(dtype: str = "bfloat16", repeats: int = 3, quick: bool = False, model_path: str | None = None) -> dict:
    res: dict = {"dtype": dtype, "threads": torch.get_num_threads(), "startup": {}}
    for kernel in ("native", "compiled"):
        with tempfile.TemporaryDirectory(prefix="radixserve-compile-") as cache:
            # the model conversion cache is per RADIXSERVE_CACHE too: compile_s is the build alone, start_s all of it
            res["startup"][kernel] = {"cold": startup(model_path, cache, kernel),
                                      "warm": startup(model_path, cache, kernel)}
    n, max_new = (8, 24) if quick else (16, 48)
    exact = Engine(model_path, dtype="float32", max_total_tokens=4096, decode_kernel="native")
    exact_kernels = Kernels(exact)
    reference = greedy(exact, exact_kernels, PROMPTS[:n], max_new, "eager", False)
    res["flips"] = {"float32": flips(exact, exact_kernels, PROMPTS[: n // 2], max_new // 2)}
    exact.shutdown()
    engine = Engine(model_path, dtype=dtype, max_total_tokens=20000, decode_kernel="native")
    ours, kernels = Ours(engine), Kernels(engine)
    step_times(ours, kernels, 2, 6, 0)  # warm-up: oneDNN sets up its kernels on first use
    rows = []
    for batch in tqdm((1, 8, 32), desc="decode kernels", leave=False):
        runs = [step_times(ours, kernels, batch, 18 if quick else 45, 100 * r) for r in range(repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in KERNELS}
        rows.append({"batch": batch, **{f"{k}_tok_s": batch / med[k] for k in KERNELS},
                     "native_vs_eager": med["eager"] / med["native"], "compiled_vs_eager": med["eager"] / med["compiled"]})
    res["decode"] = rows
    res["flips"] = {dtype: flips(engine, kernels, PROMPTS[:n], max_new), **res["flips"]}
    res["vs_float32"] = {"dtype": dtype, "rows": agreement(engine, kernels, PROMPTS[:n], max_new, reference)}
    res["eager_batch_sizes"] = sorted(kernels.compiled.eager_sizes)
    engine.shutdown()
    return res


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results/compile_cost.json")
    res = measure(args.dtype, args.repeats, args.quick, args.model_path)
    for kernel, s in res["startup"].items():
        print(f"{kernel} at start-up: cold {s['cold']['compile_s']:.1f} s, warm (cached) {s['warm']['compile_s']:.1f} s")
    print(f"{'batch':>5} {'eager tok/s':>12} {'compiled tok/s':>15} {'native tok/s':>13} {'native/eager':>13}")
    for r in res["decode"]:
        print(f"{r['batch']:>5} {r['eager_tok_s']:>12.1f} {r['compiled_tok_s']:>15.1f} {r['native_tok_s']:>13.1f} "
              f"{r['native_vs_eager']:>12.2f}x")
    for dtype, rows in res["flips"].items():
        for r in rows:
            print(f"{dtype} {r['kernel']} batch {r['batch']}: {r['differing_prompts']}/{r['prompts']} prompts differ "
                  f"from eager within {r['tokens']} tokens; first at {r['first_flip_positions']}")
    for r in res["vs_float32"]["rows"]:
        print(f"{res['vs_float32']['dtype']} {r['kernel']}: {r['identical_prompts']}/{r['prompts']} prompts as the "
              f"float32 model's, {r['tokens_before_difference']}/{r['prompts'] * r['tokens']} tokens before a difference")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
