"""What --quantization and --kv-cache-dtype buy and cost: the model runner with bf16, int8 and int4 weights, and with
bf16 weights over an 8-bit KV pool (int8, fp8_e4m3, fp8_e5m2 codes), on the same model, side by side in one run --
KV bytes per token and the pool's default size, decode tokens/s at batch 1 and 8 over 128 tokens of context and at
batch 8 over 1024, prefill tokens/s (alternating, median of repeats), and
accuracy as the mean log-probability (and perplexity) of a fixed English text (benchmarks/data/perplexity.txt),
in windows of 256 tokens scoring the last 128: through prefill (the engine's prompt logprobs) and through
teacher-forced decode steps of the default decode kernel (benchmarks/decode_score.py).

    python benchmarks/quant_cost.py [--repeats 3] [--quick]
"""
from __future__ import annotations

import dataclasses
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

# row -> (--quantization, --kv-cache-dtype)
MODES = {"bf16": (None, "auto"), "int8": ("int8", "auto"), "int4": ("int4", "auto"),
         "bf16, KV int8": (None, "int8"), "bf16, KV fp8_e4m3": (None, "fp8_e4m3"),
         "bf16, KV fp8_e5m2": (None, "fp8_e5m2")}
JOBS = (("decode", 1, 128), ("decode", 8, 128), ("decode", 8, 1024), ("prefill", 512, 0))
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


def default_pool_tokens(engine: Engine) -> int:
    """The KV pool's size in tokens when --max-total-tokens is not given (on this machine)."""
    cfg = engine.runner.cfg
    args = dataclasses.replace(engine.args, max_total_tokens=None)
    return args.resolved(cfg.kv_values_per_token, cfg.max_position_embeddings, head_dim=cfg.head_dim).max_total_tokens


def measure(dtype: str = "bfloat16", repeats: int = 3, quick: bool = False, model_path: str | None = None) -> dict:
    engines = {}
    for name, (q, kv) in MODES.items():
        start = time.perf_counter()
        engines[name] = (Engine(model_path, dtype=dtype, quantization=q, kv_cache_dtype=kv, max_total_tokens=20000),
                         time.perf_counter() - start)
    ids = engines["bf16"][0].tokenizer.encode(TEXT.read_text())
    rows = {name: {"mode": name, "kv_cache_dtype": MODES[name][1], "start_s": t,
                   "kv_bytes_per_token": engine.runner.kv.nbytes / engine.runner.kv.k.shape[1],
                   "default_pool_tokens": default_pool_tokens(engine)} for name, (engine, t) in engines.items()}
    for name, (engine, _) in tqdm(engines.items(), desc="accuracy", leave=False):
        lp, n = mean_logprob(engine, ids)
        dlp = decode_mean_logprob(engine, ids)
        rows[name].update(mean_logprob=lp, perplexity=math.exp(-lp), scored_tokens=n, decode_mean_logprob=dlp,
                          decode_perplexity=math.exp(-dlp), decode_kernel=engine.runner.decode_kernel)
    ours = {name: Ours(engine) for name, (engine, _) in engines.items()}
    for o in ours.values():  # warm-up: kernels set up on first use
        o.prefill(64, 0)
        o.decode(2, 64, 4, 0)
    for kind, size, context in tqdm(JOBS, desc="quant speed", leave=False):
        times: dict[str, list[float]] = {name: [] for name in ours}
        for r in range(repeats):
            order = list(ours.items()) if r % 2 == 0 else list(reversed(ours.items()))
            for name, o in order:
                if kind == "decode":
                    times[name].append(o.decode(size, context, 8 if quick else 16, 100 * r))
                else:
                    times[name].append(o.prefill(size, r))
        key = f"decode_{size}_tok_s" if context == 128 else f"{kind}_{size}_{context}_tok_s" if context else \
            f"{kind}_{size}_tok_s"
        for name, t in times.items():
            rows[name][key] = size / statistics.median(t)
    for engine, _ in engines.values():
        engine.shutdown()
    return {"dtype": dtype, "threads": torch.get_num_threads(), "text_tokens": len(ids), "rows": list(rows.values())}


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results/quant_cost.json")
    res = measure(args.dtype, args.repeats, args.quick, args.model_path)
    print(f"\n{'mode':18} {'KV B/token':>10} {'pool':>7} {'decode b1':>10} {'decode b8':>10} {'b8, 1024':>9} "
          f"{'prefill 512':>12} {'mean logprob':>13} {'ppl':>7} {'ppl, decode':>12}")
    for r in res["rows"]:
        print(f"{r['mode']:18} {r['kv_bytes_per_token']:>10.0f} {r['default_pool_tokens']:>7} "
              f"{r['decode_1_tok_s']:>10.1f} {r['decode_8_tok_s']:>10.1f} {r['decode_8_1024_tok_s']:>9.1f} "
              f"{r['prefill_512_tok_s']:>12.0f} {r['mean_logprob']:>13.4f} {r['perplexity']:>7.3f} "
              f"{r['decode_perplexity']:>12.3f}")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
