"""The sizes people serve, against llama.cpp's server: random-weight checkpoints of common 1-8B shapes (made here
with transformers, never downloaded; SmolLM2's tokenizer), each served by radixserve and by llama.cpp's
``llama-server`` (built natively, benchmarks/llama_cpp.py) from the same weights at three precisions, both on 2
threads, taking turns measurement by measurement:

- BF16: radixserve on the HF folder (bf16, its default decode kernel), llama.cpp on its own converter's BF16 file;
- Q8_0 and Q4_K_M: both on the very file ``llama-quantize`` makes from that BF16 one (radixserve with
  ``--quantization gguf``: every layer from its blocks).

Measured: decode tok/s at batch 1, 8 and 32 (that many different prompts at once, non-streamed, first 8 and then
8 + N new tokens each: the decode rate is the difference, so prefill and start-up cancel); prefill tok/s at 512
and 2048 tokens (one prompt of that many token ids, one new token, no prompt cache); and the fraction of the
machine's limits each reaches, measured in the same run (benchmarks/machine.py): decode at batch 1 against reading
the file's linear weights once per token at the memory's read bandwidth (machine.read_bandwidth: 512 MB read by
the best of torch's sum and a native reader of several runs a thread, just before and after each round of batch-1
measurements, the faster of the two: on a shared machine the memory's pace moves by a third within minutes, so
each round is set against its own; results from before the native reader hold torch's sum alone, which reads
slower than a decode step can, those from before it was sampled one figure for the run, and those from before it
was measured the copy bandwidth, read + written bytes/s, which a read-only stream exceeds), prefill against the
machine's matmul peak: the faster of torch's bf16 and float32 GEMMs (without AVX-512, oneDNN has no bf16 GEMM and
a bf16 model's prefill multiplies in float32, kernels/cpu_linear.py).

    python benchmarks/real_shapes.py [--quick] [--shapes llama-3.2-1b,qwen2.5-1.5b,llama-3.1-8b]
        [--precisions bf16,q8_0,q4_k_m] [--out DIR]

A shape runs where the disk holds its files and each precision where the memory holds both servers
(benchmarks/shape_models.py, which makes the files). llama.cpp's slots keep a context of their own each (2112
tokens x 32 slots: 8.3 GiB of KV for the 8B shape); where that does not fit but one shared pool does, it runs with
``--kv-unified`` and a context of 2112 + 32 x 64 tokens (recorded with the row). What does not fit is skipped,
with the reason, in the report.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

import llama_cpp
import machine
from cpu_peer import LlamaServer, Ours
from shape_models import PRECISIONS, SHAPES, checkpoint, files, linear_bytes, plan
from stage_results import load_stage, machine as machine_info, save_stage

from radixserve.model.config import ModelConfig
from radixserve.model.loader import load_configs, resolve_model

STAGE = "shapes"
DEFAULT_SHAPES = ("llama-3.2-1b", "qwen2.5-1.5b", "llama-3.1-8b")  # each precision where memory allows (plan)
BATCHES = (1, 8, 32)
PREFILLS = (512, 2048)
FIRST = 8  # new tokens of the short run; the long run adds the measured ones
LLAMA_SLOT_TOKENS = max(PREFILLS) + 64
# llama-server's -c: a context per slot for each of the slots (False), or one pool they share (True, --kv-unified)
LLAMA_CONTEXT = {False: LLAMA_SLOT_TOKENS * max(BATCHES), True: LLAMA_SLOT_TOKENS + max(BATCHES) * 64}
TARGETS = {"decode_1": 1.0, "decode_8": 1.5, "prefill_512": 1.2, "prefill_2048": 1.2, "bandwidth": 0.9}


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


def timed_batch(system, batch: list[list[int]], new: int) -> float:
    """Seconds until every prompt of ``batch`` (sent at once) has ``new`` tokens."""
    if isinstance(system, Ours):
        httpx.post(system.url + "/flush_cache", timeout=60)

    def one(ids: list[int]) -> None:
        body = system.body(ids, new, False)
        httpx.post(system.url + system.path, json=body, timeout=1800).raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        list(pool.map(one, batch))
    return time.perf_counter() - start


def decode_rate(system, batch: int, new: int, seed: int) -> float:
    """Decode tok/s of ``batch`` streams: the extra tokens of a long run over its extra time."""
    ids = prompts(batch, 16, seed)
    short, long = timed_batch(system, ids, FIRST), timed_batch(system, ids, FIRST + new)
    return batch * new / max(long - short, 1e-9)


def prefill_rate(system, length: int, seed: int) -> float:
    return length / timed_batch(system, prompts(1, length, seed), 1)


def measure_shape(name: str, quick: bool, repeats: int, precisions: dict[str, bool]) -> dict:
    """The shape at each of ``precisions`` (-> whether llama.cpp shares one KV pool among its slots, ``plan``)."""
    gguf = files(name)
    folder = checkpoint(name)
    cfg = ModelConfig.from_hf(*load_configs(folder))
    costs = machine.model_costs(cfg)
    new = {1: 32 if quick else 64, 8: 32 if quick else 64, 32: 16 if quick else 32}
    rows = []
    for precision in tqdm(precisions, desc=name, leave=False):
        ours_flags = (["--model-path", str(folder)] if precision == "bf16" else
                      ["--model-path", str(gguf[precision]), "--quantization", "gguf"])
        if precision != "bf16":
            resolve_model(str(gguf[precision]), blocks=True)  # its one-off conversion (for gguf), before the start
        systems = {"radixserve": Ours([*ours_flags, "--max-total-tokens", "8192"]),
                   "llama.cpp": LlamaServer(gguf[precision], slot_tokens=LLAMA_SLOT_TOKENS, slots=max(BATCHES),
                                            unified=LLAMA_CONTEXT[True] if precisions[precision] else None)}
        runs: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
        reads: list[float] = []  # the read bandwidth around each round of batch-1 measurements
        try:
            for system in systems.values():  # warm-up: first requests set up kernels and pools
                timed_batch(system, prompts(2, 16, 0), 4)
            for r in range(repeats):
                order = list(systems.items())[:: 1 if r % 2 == 0 else -1]
                for b in BATCHES:
                    around = [machine.read_bandwidth()] if b == 1 else []
                    for label, system in order:
                        runs[label].setdefault(f"decode_{b}", []).append(decode_rate(system, b, new[b], 10 * r + b))
                    if around:
                        reads.append(max(around + [machine.read_bandwidth()]))
                for length in PREFILLS:
                    for label, system in order:
                        runs[label].setdefault(f"prefill_{length}", []).append(prefill_rate(system, length, r))
        finally:
            for system in systems.values():
                system.stop()
        weight_bytes = linear_bytes(gguf[precision])
        for label, measured in runs.items():
            row = {"shape": name, "precision": precision, "system": label, "runs": measured,
                   "llama_kv": f"unified, {LLAMA_CONTEXT[True]} tokens" if precisions[precision] else "per slot",
                   **{k: statistics.median(v) for k, v in measured.items()}, "weight_bytes": weight_bytes}
            row["bandwidth_bytes_s"] = row["decode_1"] * weight_bytes
            row["read_bandwidth_bytes_s"] = reads
            row["bandwidth_share"] = round_shares(measured["decode_1"], reads, weight_bytes)
            row["prefill_flops_s"] = {str(n): row[f"prefill_{n}"] * machine.prefill_flops_per_token(costs, n)
                                      for n in PREFILLS}
            rows.append(row)
    return {"params": costs["linear_params"], "config": SHAPES[name][1], "rows": rows}


def limits_now() -> dict:
    """The machine's memory read and copy bandwidths and its matmul peak (the faster of bf16 and float32 GEMMs)."""
    return {"read_bandwidth_bytes_s": machine.read_bandwidth(), "copy_bandwidth_bytes_s": machine.copy_bandwidth(),
            "matmul_peak_flops_s": max(machine.matmul_peak(torch.bfloat16), machine.matmul_peak(torch.float32))}


def measure(quick: bool = False, shapes: tuple[str, ...] = DEFAULT_SHAPES, repeats: int = 2,
            precisions: tuple[str, ...] = PRECISIONS) -> dict:
    try:
        llama_cpp.build()
    except llama_cpp.Unavailable as exc:
        return {"skipped": str(exc)}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    info = machine_info()
    limits = limits_now()
    res = {"started": started, "machine": info, "quick": quick, "repeats": 1 if quick else repeats,
           "limits": limits, "read_probe": machine.read_probe(), "shapes": {}, "skipped_shapes": {},
           "skipped_precisions": {}}
    for name in tqdm(shapes, desc="shapes"):
        runs, skipped = plan(name, precisions, LLAMA_CONTEXT)
        res["skipped_precisions"].update({f"{name} {p}": why for p, why in skipped.items()})
        if not runs:
            continue
        try:
            res["shapes"][name] = measure_shape(name, quick, res["repeats"], runs)
        except llama_cpp.Unavailable as exc:
            res["skipped_shapes"][name] = str(exc)
    again = limits_now()
    res["limits"] = {k: max(limits[k], again[k]) for k in limits}  # the best of the run's start and end
    return res


def bandwidth_limit(res: dict) -> tuple[float, str, str]:
    """Decode's limit in a run's results, what it is and its name in a target: the read bandwidth, or in a run from
    before it was measured, the copy bandwidth."""
    limits = res["limits"]
    if "read_bandwidth_bytes_s" in limits:
        return limits["read_bandwidth_bytes_s"], "memory read", "read"
    return (limits["copy_bandwidth_bytes_s"], "memory copy (read + written bytes; a read-only stream exceeds it)",
            "copy (read + written bytes)")


def probe_words(res: dict) -> str:
    """How a run's read bandwidth was read, for the report (none where it measured the copy bandwidth)."""
    if "read_bandwidth_bytes_s" not in res["limits"]:
        return ""
    before = "torch's sum alone, which reads slower than a decode step can"  # a run from before the native reader
    return f" (read by {res.get('read_probe', before)})"


def round_shares(rates: list[float], reads: list[float], weight_bytes: int) -> float:
    """Batch 1's share of the read bandwidth: the median over rounds of the weights' bytes/s at each round's rate
    against the bandwidth sampled around that round."""
    return statistics.median(rate * weight_bytes / read for rate, read in zip(rates, reads, strict=True))


def share(row: dict, limit: float) -> float:
    """A system's batch-1 share of the read bandwidth: the median over rounds, each against the bandwidth sampled
    around it; in a run from before those samples, against the run's one ``limit``."""
    return row.get("bandwidth_share", row["bandwidth_bytes_s"] / limit)


def ratios(res: dict) -> list[dict]:
    """Per shape and precision: radixserve / llama.cpp for every measure, and each one's limit fractions."""
    out = []
    bw, peak = bandwidth_limit(res)[0], res["limits"]["matmul_peak_flops_s"]
    for name, shape in res["shapes"].items():
        for precision in PRECISIONS:
            pair = {r["system"]: r for r in shape["rows"] if r["precision"] == precision}
            if len(pair) < 2:
                continue
            ours, theirs = pair["radixserve"], pair["llama.cpp"]
            row = {"shape": name, "precision": precision}
            for key in [f"decode_{b}" for b in BATCHES] + [f"prefill_{n}" for n in PREFILLS]:
                row[key] = ours[key] / theirs[key]
            for label, r in pair.items():
                row[f"{label} bandwidth"] = share(r, bw)
                row[f"{label} matmul"] = max(r["prefill_flops_s"].values()) / peak
            out.append(row)
    return out


def table(res: dict) -> str:
    keys = [f"decode_{b}" for b in BATCHES] + [f"prefill_{n}" for n in PREFILLS]
    head = f"{'shape':14} {'precision':9} {'system':11}" + "".join(f"{k:>14}" for k in keys) + f"{'bandwidth':>11}"
    lines = [head, "-" * len(head)]
    bw = bandwidth_limit(res)[0]
    for name, shape in res["shapes"].items():
        for r in shape["rows"]:
            lines.append(f"{name:14} {r['precision']:9} {r['system']:11}" + "".join(f"{r[k]:>14.1f}" for k in keys)
                         + f"{share(r, bw):>10.0%}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ratios(res)
    keys = [f"decode_{b}" for b in BATCHES] + [f"prefill_{n}" for n in PREFILLS]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    labels = [f"{r['shape']}\n{r['precision']}" for r in rows]
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ax.bar([x + i * width for x in range(len(rows))], [r[key] for r in rows], width, label=key.replace("_", " "))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, fontsize=8)
    ax.set(ylabel="radixserve / llama.cpp (tok/s)",
           title=f"real shapes vs llama.cpp's server (2 threads each; {res['machine'].get('cpu', '')})")
    ax.legend(fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load(results_dir: Path) -> dict | None:
    return load_stage(results_dir, STAGE)


def save(res: dict, results_dir: Path) -> None:
    save_stage(res, results_dir, STAGE)
    if res.get("shapes"):
        plot(res, results_dir / "real_shapes.png")


def section(res: dict, targets: list[str], check) -> list[str]:
    m = res["machine"]
    bw, what_bw, limit = bandwidth_limit(res)
    L = ["## Real shapes vs llama.cpp (1-8B, random weights)", "",
         f"Measured {res['started']} on commit {m['commit']}, {m['cpu']}, {m['cpus_in_mask']} CPUs "
         "(`python benchmarks/real_shapes.py`; 2 threads each, taking turns measurement by measurement, medians of "
         f"{res['repeats']} run(s)). Random-weight checkpoints of each shape with SmolLM2's tokenizer; BF16: "
         "radixserve on the HF folder, llama.cpp on its converter's BF16 file; Q8_0 and Q4_K_M: both on the file "
         "llama-quantize makes (radixserve `--quantization gguf`). Decode: N prompts at once, the rate from the "
         "difference of two lengths; prefill: one prompt, no prompt cache. Limits measured in the run: "
         f"{what_bw} {bw / 1e9:.1f} GB/s{probe_words(res)}, matmul (the faster of torch's bf16 and float32 "
         f"GEMMs) {res['limits']['matmul_peak_flops_s'] / 1e9:.0f} GFLOP/s.", ""]
    sampled = [x for shape in res["shapes"].values() for r in shape["rows"] for x in r.get("read_bandwidth_bytes_s", [])]
    if sampled:
        L[-2] += (f" Batch 1's share: the median over rounds, each against the read bandwidth sampled around it "
                  f"({min(sampled) / 1e9:.1f}-{max(sampled) / 1e9:.1f} GB/s in this run).")
    for name, why in {**res.get("skipped_shapes", {}), **res.get("skipped_precisions", {})}.items():
        L.append(f"- {name}: not run: {why}")
    for name, shape in res["shapes"].items():
        for r in shape["rows"]:
            if r["system"] == "llama.cpp" and r.get("llama_kv", "per slot") != "per slot":
                L.append(f"- {name} {r['precision']}: llama.cpp with one KV pool for its slots (--kv-unified, "
                         f"{r['llama_kv'].split(', ')[1]}): a context per slot would not fit the memory")
    keys = [f"decode_{b}" for b in BATCHES] + [f"prefill_{n}" for n in PREFILLS]
    L += ["", "tok/s (and radixserve / llama.cpp):", "",
          "| shape | precision | " + " | ".join(k.replace("_", " ") for k in keys)
          + " | batch 1 share of the bandwidth (ours / theirs) | best prefill share of the matmul peak (ours / theirs) |",
          "|---|---|" + "---|" * (len(keys) + 2)]
    for r in ratios(res):
        pair = {x["system"]: x for x in res["shapes"][r["shape"]]["rows"] if x["precision"] == r["precision"]}
        cells = [f"{pair['radixserve'][k]:.1f} / {pair['llama.cpp'][k]:.1f} ({r[k]:.2f}x)" for k in keys]
        L.append(f"| {r['shape']} | {r['precision']} | " + " | ".join(cells)
                 + f" | {r['radixserve bandwidth']:.0%} / {r['llama.cpp bandwidth']:.0%}"
                 + f" | {r['radixserve matmul']:.0%} / {r['llama.cpp matmul']:.0%} |")
        what = f"shapes, {r['shape']} {r['precision']}"
        targets.append(check(f"{what}: batch 1 vs llama.cpp", r["decode_1"], r["decode_1"] >= TARGETS["decode_1"],
                             ">= 1.0x"))
        targets.append(check(f"{what}: batch 1 share of the {limit} bandwidth", r["radixserve bandwidth"],
                             r["radixserve bandwidth"] >= TARGETS["bandwidth"], ">= 90%"))
        targets.append(check(f"{what}: batch 8 vs llama.cpp", r["decode_8"], r["decode_8"] >= TARGETS["decode_8"],
                             ">= 1.5x"))
        for n in PREFILLS:
            targets.append(check(f"{what}: prefill {n} vs llama.cpp", r[f"prefill_{n}"],
                                 r[f"prefill_{n}"] >= TARGETS[f"prefill_{n}"], ">= 1.2x"))
    return L + ["", "![real shapes](real_shapes.png)", ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help=f"of {', '.join(PRECISIONS)}")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    precisions = tuple(args.precisions.split(","))
    if unknown := set(precisions) - set(PRECISIONS):
        ap.error(f"--precisions: {', '.join(sorted(unknown))} not among {', '.join(PRECISIONS)}")
    res = measure(args.quick, tuple(args.shapes.split(",")), args.repeats, precisions)
    if "skipped" in res:
        raise SystemExit(f"llama.cpp unavailable: {res['skipped']}")
    print(table(res))
    save(res, Path(args.out))


if __name__ == "__main__":
    main()
