"""What ``--deterministic`` costs: the model runner in its default mode vs batch-invariant mode, same weights and
dtype, side by side in one run (alternating, median of repeats): prefill by prompt length, decode by batch size,
and decode over a shared prefix (where the default mode gathers each shared K/V row once for the whole batch).

    python benchmarks/deterministic_cost.py [--dtype bfloat16] [--repeats 3] [--quick]

Results: benchmarks/results/deterministic/results.json (committed; the report's section reads it).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from forward_speed import Ours
from harness import stage_cli
from stage_results import load_stage, machine, save_stage

from radixserve import Engine

PREFILL = (128, 512, 2048)
DECODE = (1, 8, 32, 64)
SHARED = (32, 512)  # batch, shared prefix tokens


def build(deterministic: bool, dtype: str, model_path: str | None) -> tuple[Ours, float]:
    start = time.perf_counter()
    engine = Engine(model_path, dtype=dtype, deterministic=deterministic, max_total_tokens=40000,
                    chunked_prefill_size=8192)
    return Ours(engine), time.perf_counter() - start


STAGE = "deterministic"  # benchmarks/results/deterministic/results.json


def measure(dtype: str = "bfloat16", repeats: int = 3, quick: bool = False, model_path: str | None = None) -> dict:
    started, where = time.strftime("%Y-%m-%d %H:%M:%S"), machine()
    systems = {"default": build(False, dtype, model_path), "deterministic": build(True, dtype, model_path)}
    for ours, _ in systems.values():  # warm-up: oneDNN sets up a kernel per shape on first use
        ours.prefill(64, 0)
        ours.decode(2, 64, 4, 0)
    jobs = [("prefill", n) for n in (PREFILL[:2] if quick else PREFILL)] + [("decode", b) for b in DECODE] + \
        [("decode, shared prefix", SHARED[0])]
    rows = []
    for kind, size in tqdm(jobs, desc="deterministic cost", leave=False):
        times: dict[str, list[float]] = {name: [] for name in systems}
        for r in range(repeats):  # alternate, so drifting machine load hits both alike
            for name, (ours, _) in (systems.items() if r % 2 == 0 else reversed(systems.items())):
                if kind == "prefill":
                    times[name].append(ours.prefill(size, r))
                else:
                    shared = SHARED[1] if kind.endswith("shared prefix") else 0
                    times[name].append(ours.decode(size, 128, 8 if quick else 16, 100 * r, shared_prefix=shared))
        med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        rows.append({"kind": kind, "size": size, "default_tok_s": size / med["default"],
                     "deterministic_tok_s": size / med["deterministic"],
                     "slowdown": med["deterministic"] / med["default"]})
    return {"started": started, "machine": where, "dtype": dtype, "threads": torch.get_num_threads(),
            "kernels": {name: ours.engine.runner.attn.ops.name if name == "deterministic" else
                        ours.engine.runner.decode_kernel for name, (ours, _) in systems.items()},
            "rows": rows, "start_s": {name: t for name, (_, t) in systems.items()}}


def load(results_dir: Path) -> dict | None:
    return load_stage(results_dir, STAGE)


def save(res: dict, results_dir: Path) -> Path:
    return save_stage(res, results_dir, STAGE)


def main() -> None:
    args = stage_cli(__doc__, "benchmarks/results")
    res = measure(args.dtype, args.repeats, args.quick, args.model_path)
    print(f"\n{'':22} {'size':>5} {'default tok/s':>14} {'deterministic':>14} {'slowdown':>9}   ({res['dtype']}, "
          f"{res['threads']} threads)")
    for r in res["rows"]:
        print(f"{r['kind']:22} {r['size']:>5} {r['default_tok_s']:>14.1f} {r['deterministic_tok_s']:>14.1f} "
              f"{r['slowdown']:>8.2f}x")
    print(f"start-up: default {res['start_s']['default']:.1f}s, deterministic {res['start_s']['deterministic']:.1f}s"
          " (includes the batch-invariance check)")
    print(f"wrote {save(res, Path(args.out))}")


if __name__ == "__main__":
    main()
