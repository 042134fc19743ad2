"""What structured output costs per decode step: the runner's step time with 0, 1 or all of B rows under a
grammar, side by side in one run (alternating, median of repeats), and the grammar's own share of it (llguidance's
mask fill + applying it to the logits + advancing the matcher, timed inside the runner). Two grammars: a JSON
schema (an array of at least 200 integers, so no row ends early) and a free-text regex that allows a large part
of the vocabulary at every step (the worst case for the mask fill). Also the one-off costs: llguidance's view of
the tokenizer (once per runner) and compiling a grammar (once per distinct schema, then cached).

    python benchmarks/grammar_cost.py [--dtype bfloat16] [--repeats 3] [--quick]
"""
from __future__ import annotations

import json
import statistics
import time

import torch
from tqdm import tqdm

from forward_speed import prompt_ids
from harness import stage_cli, write_json

from radixserve import Engine, SamplingParams
from radixserve.wire.plans import GrammarSpec

GRAMMARS = {
    "json schema": {"json_schema": json.dumps({"type": "object", "properties": {"values": {
        "type": "array", "items": {"type": "integer"}, "minItems": 200}}, "required": ["values"]})},
    "free-text regex": {"regex": r"[a-z ,.]{2000,}"},
}
BATCHES = (1, 8, 32)


class Timed:
    """Times the runner's Constraints where the time is spent: ``fill`` on its helper thread (overlapped with the
    model's forward), ``apply`` + ``advance`` in the step itself."""

    def __init__(self, constraints) -> None:
        self.inner, self.fill_s, self.serial_s = constraints, 0.0, 0.0
        constraints.fill = self._timed(constraints.fill, "fill_s")  # instance attributes: fill_async calls them
        constraints.apply = self._timed(constraints.apply, "serial_s")
        constraints.advance = self._timed(constraints.advance, "serial_s")

    def _timed(self, fn, total: str):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - start)
        return call

    def reset(self) -> None:
        self.fill_s = self.serial_s = 0.0


def decode_step(engine: Engine, timed: Timed, batch: int, constrained: int, grammar: dict, steps: int,
                seed: int) -> tuple[float, float, float]:
    """Median seconds per decode step of ``batch`` requests, ``constrained`` of them under ``grammar``, and the
    median seconds of that step spent filling masks (helper thread) and applying them + advancing (in the step)."""
    sched, runner = engine.scheduler, engine.runner
    for i in range(batch):
        extra = grammar if i < constrained else {"ignore_eos": True}
        sched.add_request(f"g{seed}-{i}", prompt_ids(64, seed + i),
                          SamplingParams(max_new_tokens=steps + 2, temperature=0, **extra))
    while len(sched.running) < batch:
        sched.process(runner.forward(sched.schedule()))
    total, fill, serial = [], [], []
    for _ in range(steps):
        plan = sched.schedule()
        timed.reset()
        start = time.perf_counter()
        result = runner.forward(plan)
        total.append(time.perf_counter() - start)
        fill.append(timed.fill_s)
        serial.append(timed.serial_s)
        sched.process(result)
    while sched.has_work:
        sched.process(runner.forward(sched.schedule()))
    engine.flush_cache()
    return statistics.median(total), statistics.median(fill), statistics.median(serial)


def one_off_costs(engine: Engine) -> dict:
    c = engine.runner.constraints
    start = time.perf_counter()
    c._llg_tokenizer()
    tokenizer_s = time.perf_counter() - start
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    start = time.perf_counter()
    c.update({"probe": spec}, [])
    first = time.perf_counter() - start
    start = time.perf_counter()
    c.update({"probe2": spec}, ["probe"])
    cached = time.perf_counter() - start
    c.update({}, ["probe2"])
    return {"tokenizer_s": tokenizer_s, "compile_s": first, "cached_start_s": cached}


def measure(dtype: str = "bfloat16", repeats: int = 3, quick: bool = False, model_path: str | None = None) -> dict:
    engine = Engine(model_path, dtype=dtype, max_total_tokens=20000)
    timed = Timed(engine.runner.constraints)
    one_off = one_off_costs(engine)
    steps = 8 if quick else 24
    decode_step(engine, timed, 2, 1, GRAMMARS["json schema"], 4, 0)  # warm-up (oneDNN kernels, grammar cache)
    rows = []
    jobs = [(name, b, k) for name in GRAMMARS for b in (BATCHES[:2] if quick else BATCHES) for k in sorted({1, b})]
    for name, batch, k in tqdm(jobs, desc="grammar cost", leave=False):
        free, constrained, fills, serials = [], [], [], []
        for r in range(repeats):  # alternate free and constrained, so drifting load hits both alike
            order = [0, k] if r % 2 == 0 else [k, 0]
            for n in order:
                step, fill_s, serial_s = decode_step(engine, timed, batch, n, GRAMMARS[name], steps, 1000 * r + n)
                (constrained if n else free).append(step)
                if n:
                    fills.append(fill_s)
                    serials.append(serial_s)
        f, c = statistics.median(free), statistics.median(constrained)
        fill, serial = statistics.median(fills), statistics.median(serials)
        rows.append({"grammar": name, "batch": batch, "constrained_rows": k, "free_ms": 1e3 * f,
                     "constrained_ms": 1e3 * c, "fill_ms": 1e3 * fill, "serial_ms": 1e3 * serial,
                     "slowdown": c / f, "fill_us_per_row": 1e6 * fill / k})
    engine.shutdown()
    return {"dtype": dtype, "threads": torch.get_num_threads(), "one_off": one_off, "rows": rows}


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results/grammar_cost.json")
    res = measure(args.dtype, args.repeats, args.quick, args.model_path)
    print(f"\n{'grammar':16} {'batch':>5} {'rows':>4} {'free ms':>8} {'constr. ms':>10} {'fill ms':>8} "
          f"{'serial ms':>9} {'fill us/row':>11} {'slowdown':>8}   ({res['dtype']}, {res['threads']} threads)")
    for r in res["rows"]:
        print(f"{r['grammar']:16} {r['batch']:>5} {r['constrained_rows']:>4} {r['free_ms']:>8.2f} "
              f"{r['constrained_ms']:>10.2f} {r['fill_ms']:>8.2f} {r['serial_ms']:>9.2f} "
              f"{r['fill_us_per_row']:>11.0f} {r['slowdown']:>7.2f}x")
    o = res["one_off"]
    print(f"one-off: tokenizer for llguidance {o['tokenizer_s']:.2f}s (once per runner), compile "
          f"{1e3 * o['compile_s']:.1f} ms (once per grammar), a cached grammar's start {1e3 * o['cached_start_s']:.2f} ms")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
