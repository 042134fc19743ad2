"""What --quantization buys and costs: the model runner with bf16, int8 and int4 weights on the same model, side by
side in one run -- decode tokens/s at batch 1 and 8 and prefill tokens/s (alternating, median of repeats), and
accuracy as the mean log-probability (and perplexity) of a fixed English text (benchmarks/data/perplexity.txt),
in windows of 256 tokens scoring the last 128: through prefill (the engine's prompt logprobs) and through
teacher-forced decode steps of the default decode kernel (benchmarks/decode_score.py).

    python benchmarks/quant_cost.py [--repeats 3] [--quick]
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from forward_speed import Ours
from decode_score import decode_logprobs
from harness import stage_cli, write_json

from radixserve import Engine

MODES = {"bf16": None, "int8": "int8", "int4": "int4"}
TEXT = Path(__file__).parent / "data" / "perplexity.txt"
WINDOW, SCORED = 256, 128


def mean_logprob(engine: Engine, ids: list[int]) -> tuple[float, int]:
    """Mean log-probability per token of ``ids`` in windows of WINDOW tokens, scoring the last SCORED of each
    (every scored token sees at least WINDOW - SCORED tokens of context)."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - WINDOW + 1, SCORED):
        window = ids[start : start + WINDOW]
        engine.flush_cache()
        out = engine.generate(input_ids=window, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=WINDOW - SCORED)
        lps = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
        total += sum(lps)
        count += len(lps)
    return total / count, count


def decode_mean_logprob(engine: Engine, ids: list[int]) -> float:
    """The same windows scored through teacher-forced decode steps (what generating computes)."""
    lps: list[float] = []
    for start in range(0, len(ids) - WINDOW + 1, SCORED):
        lps += decode_logprobs(engine, ids[start : start + WINDOW], WINDOW - SCORED)
    return sum(lps) / len(lps)


def measure(dtype: str = "bfloat16", repeats: int = 3, quick: bool = False, model_path: str | None = None) -> dict:
    engines = {}
    for name, q in MODES.items():
        start = time.perf_counter()
        engines[name] = (Engine(model_path, dtype=dtype, quantization=q, max_total_tokens=20000),
                         time.perf_counter() - start)
    ids = engines["bf16"][0].tokenizer.encode(TEXT.read_text())
    rows = {name: {"mode": name, "start_s": t} for name, (_, t) in engines.items()}
    for name, (engine, _) in tqdm(engines.items(), desc="accuracy", leave=False):
        lp, n = mean_logprob(engine, ids)
        dlp = decode_mean_logprob(engine, ids)
        rows[name].update(mean_logprob=lp, perplexity=math.exp(-lp), scored_tokens=n, decode_mean_logprob=dlp,
                          decode_perplexity=math.exp(-dlp), decode_kernel=engine.runner.decode_kernel)
    ours = {name: Ours(engine) for name, (engine, _) in engines.items()}
    for o in ours.values():  # warm-up: kernels set up on first use
        o.prefill(64, 0)
        o.decode(2, 64, 4, 0)
    jobs = [("decode", 1), ("decode", 8), ("prefill", 512)]
    for kind, size in tqdm(jobs, desc="quant speed", leave=False):
        times: dict[str, list[float]] = {name: [] for name in ours}
        for r in range(repeats):
            order = list(ours.items()) if r % 2 == 0 else list(reversed(ours.items()))
            for name, o in order:
                if kind == "decode":
                    times[name].append(o.decode(size, 128, 8 if quick else 16, 100 * r))
                else:
                    times[name].append(o.prefill(size, r))
        for name, t in times.items():
            rows[name][f"{kind}_{size}_tok_s"] = size / statistics.median(t)
    for engine, _ in engines.values():
        engine.shutdown()
    return {"dtype": dtype, "threads": torch.get_num_threads(), "text_tokens": len(ids), "rows": list(rows.values())}


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results/quant_cost.json")
    res = measure(args.dtype, args.repeats, args.quick, args.model_path)
    print(f"\n{'mode':6} {'decode b1':>10} {'decode b8':>10} {'prefill 512':>12} {'mean logprob':>13} {'ppl':>7} "
          f"{'ppl, decode':>12}")
    for r in res["rows"]:
        print(f"{r['mode']:6} {r['decode_1_tok_s']:>10.1f} {r['decode_8_tok_s']:>10.1f} {r['prefill_512_tok_s']:>12.0f} "
              f"{r['mean_logprob']:>13.4f} {r['perplexity']:>7.3f} {r['decode_perplexity']:>12.3f}")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
