"""Tensor parallelism on this machine: one rank vs ``--tp N`` ranks (gloo, local processes), same weights, side
by side in one run (alternating, median of repeats): greedy agreement in float32 (tokens identical to one rank's
on a fixed prompt set), then bf16 prefill and decode step times, and start-up.

On one CPU machine the ranks share its cores, so --tp buys no speed here (each step adds two all-reduces per
layer over local sockets): it is for a model that does not fit one process's memory, or one machine. When N cannot
split the model (SmolLM2's 9 heads at --tp 2), the stage says so and measures a random checkpoint of the same
shape with the nearest head counts N splits, so ``make bench ARGS="--tp 2"`` still measures --tp 2.

    python benchmarks/tp_cost.py [--tp 3] [--repeats 3] [--quick] [--model-path P]
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from forward_speed import Ours
from harness import stage_cli, write_json

from radixserve import Engine
from radixserve.model.config import ModelConfig
from radixserve.model.loader import load_configs, resolve_model
from radixserve.model.parallel import check_divisible

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain what a radix tree is.", "1, 2, 3, 4,", "The quick brown fox", "Translate 'cat' into French.",
           "Why is the sky blue?"]
AGREE_TOKENS = 32
PREFILL = (128, 512)
DECODE = (1, 8)


def smallest_tp(cfg: ModelConfig) -> int:
    """The smallest tp > 1 that splits the model (3 for SmolLM2), or 2 (then measured on a reshaped copy)."""
    for tp in range(2, cfg.num_heads + 1):
        try:
            check_divisible(tp, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
            return tp
        except ValueError:
            continue
    return 2


def splittable(path: Path, tp: int) -> tuple[Path, str | None]:
    """The checkpoint to measure at ``tp`` ranks: the model itself, or (with why not) a random one of its shape
    whose head counts ``tp`` splits."""
    cfg = ModelConfig.from_hf(*load_configs(path))
    try:
        check_divisible(tp, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
        return path, None
    except ValueError as exc:
        why = str(exc)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = cfg.hf_config
    heads = next(h for h in range(cfg.num_heads, 0, -1) if hf.hidden_size % h == 0 and h % tp == 0)
    kv = next(k for k in range(min(cfg.num_kv_heads, heads), 0, -1)
              if heads % k == 0 and (k % tp == 0 if tp <= k else tp % k == 0))
    check_divisible(tp, heads, kv, cfg.intermediate_size)  # the MLP width must split as it is
    shaped = hf.__class__(**{**hf.to_dict(), "num_attention_heads": heads, "num_key_value_heads": kv,
                             "head_dim": hf.hidden_size // heads})
    torch.manual_seed(0)
    out = Path(tempfile.mkdtemp(prefix="tp-shaped-"))
    AutoModelForCausalLM.from_config(shaped, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out, f"{why} -- measured instead: the same shape with {heads} heads / {kv} KV heads, random weights"


def agreement(path: Path, tp: int) -> dict:
    """float32: how many of the greedy tokens ``tp`` ranks give are one rank's (the same tokens, position by
    position, up to the first difference)."""
    outs = {}
    for n in (1, tp):
        with Engine(str(path), dtype="float32", tp=n, max_total_tokens=8192) as engine:
            outs[n] = [r["output_ids"] for r in engine.generate(
                PROMPTS, {"max_new_tokens": AGREE_TOKENS, "temperature": 0, "ignore_eos": True})]
    same = 0
    for a, b in zip(outs[1], outs[tp]):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return {"prompts": len(PROMPTS), "tokens": len(PROMPTS) * AGREE_TOKENS, "same_prefix_tokens": same,
            "identical_prompts": sum(a == b for a, b in zip(outs[1], outs[tp]))}


def measure(tp: int = 3, repeats: int = 3, quick: bool = False, model_path: str | None = None) -> dict:
    path, why = splittable(resolve_model(model_path).path, tp)
    agree = agreement(path, tp)
    systems, start_s = {}, {}
    for n in (1, tp):
        start = time.perf_counter()
        systems[n] = Ours(Engine(str(path), tp=n, max_total_tokens=40000, chunked_prefill_size=8192,
                                 decode_kernel="eager"))
        start_s[n] = time.perf_counter() - start
    for ours in systems.values():  # warm-up: oneDNN sets up a kernel per shape on first use
        ours.prefill(64, 0)
        ours.decode(2, 64, 4, 0)
    jobs = [("prefill", n) for n in (PREFILL[:1] if quick else PREFILL)] + [("decode", b) for b in DECODE]
    rows = []
    for kind, size in tqdm(jobs, desc=f"tp {tp}", leave=False):
        times: dict[int, list[float]] = {n: [] for n in systems}
        for r in range(repeats):  # alternate, so drifting machine load hits both alike
            for n, ours in (systems.items() if r % 2 == 0 else reversed(systems.items())):
                times[n].append(ours.prefill(size, r) if kind == "prefill" else ours.decode(size, 128, 8, 100 * r))
        med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        rows.append({"kind": kind, "size": size, "tp1_tok_s": size / med[1], "tpn_tok_s": size / med[tp],
                     "ratio": med[1] / med[tp]})
    for ours in systems.values():
        ours.engine.shutdown()
    if why:  # the reshaped random checkpoint
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    return {"tp": tp, "model": "bundled" if model_path is None else model_path, "measured_on": str(path),
            "substituted": why, "dtype": "bfloat16 (agreement: float32)", "agreement": agree, "rows": rows,
            "start_s": {str(n): s for n, s in start_s.items()}}


def main() -> None:
    import sys

    tp = 3
    if "--tp" in sys.argv:  # the stage's own flag, beside the common ones
        i = sys.argv.index("--tp")
        tp = int(sys.argv[i + 1])
        del sys.argv[i : i + 2]
    args = stage_cli(__doc__, "benchmarks/results/tp_cost.json")
    res = measure(tp, args.repeats, args.quick, args.model_path)
    if res["substituted"]:
        print(res["substituted"])
    a = res["agreement"]
    print(f"float32 greedy: {a['identical_prompts']}/{a['prompts']} prompts identical to one rank "
          f"({a['same_prefix_tokens']}/{a['tokens']} tokens before any difference)")
    print(f"\n{'':8} {'size':>5} {'tp 1 tok/s':>11} {f'tp {tp} tok/s':>11} {'tp/1':>6}")
    for r in res["rows"]:
        print(f"{r['kind']:8} {r['size']:>5} {r['tp1_tok_s']:>11.1f} {r['tpn_tok_s']:>11.1f} {r['ratio']:>6.2f}")
    write_json(res, args.out)


if __name__ == "__main__":
    main()
