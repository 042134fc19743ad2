"""What the logit adjustments cost: one Engine on the bundled model generating for a batch with no penalties,
then for the same batch with frequency + presence + repetition penalties and a logit_bias on every request,
alternating rounds (ABAB...), median tokens/s of each (generated tokens / wall time, prefill included); plus the
penalties alone on [batch, vocab] logits (apply + count per step, the logits' clone and argmax included).

    python benchmarks/penalty_cost.py [--dtype bfloat16] [--repeats 3] [--quick]
"""
from __future__ import annotations

import statistics
import time

import matplotlib
import torch
from tqdm import tqdm

from harness import stage_cli, write_json

from radixserve import Engine, SamplingParams
from radixserve.model.penalties import Penalties
from radixserve.wire.plans import PenaltySpec

matplotlib.use("Agg")
BATCHES = (1, 8, 32)
NEW_TOKENS = 64
PENALIZED = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1, logit_bias={"28": -5.0})


def decode_rate(engine: Engine, batch: int, penalized: bool) -> float:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            **(PENALIZED if penalized else {}))
    prompts = [f"Request {i}: tell me a story about the number {i}." for i in range(batch)]
    engine.flush_cache()
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(o["meta_info"]["completion_tokens"] for o in out) / (time.perf_counter() - start)


def apply_time(batch: int, vocab: int = 49152, steps: int = 50) -> float:
    """Seconds per step for Penalties.apply + count on [batch, vocab] logits (every row penalized)."""
    pen = Penalties(vocab, torch.device("cpu"))
    rids = [f"r{i}" for i in range(batch)]
    pen.update({r: PenaltySpec(0.5, 0.3, 1.1, 0, [], [28], [-5.0]) for r in rids}, [])
    logits = torch.randn(batch, vocab)
    start = time.perf_counter()
    for step in range(steps):
        x = logits.clone()
        pen.apply(x, rids, [step] * batch)
        pen.count(rids, x.argmax(-1).tolist())
    return (time.perf_counter() - start) / steps


def measure(dtype: str = "bfloat16", repeats: int = 3, quick: bool = False, model_path: str | None = None) -> dict:
    engine = Engine(model_path, dtype=dtype, max_total_tokens=16384)
    decode_rate(engine, 2, False)  # warm-up
    decode_rate(engine, 2, True)
    rows = []
    for batch in tqdm(BATCHES[:2] if quick else BATCHES, desc="penalty cost", leave=False):
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for penalized in (False, True):
                rates[penalized].append(decode_rate(engine, batch, penalized))
        plain, pen = statistics.median(rates[False]), statistics.median(rates[True])
        rows.append({"batch": batch, "plain_tok_s": plain, "penalized_tok_s": pen, "ratio": pen / plain,
                     "apply_ms": apply_time(batch) * 1e3, "rounds": repeats})
    engine.shutdown()
    return {"dtype": dtype, "new_tokens": NEW_TOKENS, "rows": rows}


def plot(res: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["plain_tok_s"] for r in rows], 0.4, label="no penalties")
    ax.bar([x + 0.2 for x in xs], [r["penalized_tok_s"] for r in rows], 0.4, label="penalties + logit_bias")
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("generated tok/s (prefill included)")
    ax.set_title(f"logit adjustments, {res['dtype']} (median of {rows[0]['rounds']} ABAB rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    args = stage_cli(__doc__, "benchmarks/results/penalty_cost.json")
    res = measure(args.dtype, args.repeats, args.quick, args.model_path)
    print(f"{'batch':>5} {'plain tok/s':>12} {'penalized':>10} {'ratio':>6} {'apply ms':>9}")
    for r in res["rows"]:
        print(f"{r['batch']:>5} {r['plain_tok_s']:>12.1f} {r['penalized_tok_s']:>10.1f} {r['ratio']:>6.3f} "
              f"{r['apply_ms']:>9.2f}")
    write_json(res, args.out)
    plot(res, args.out.replace(".json", ".png"))
