"""The native kernel's products, two builds side by side in one process: the sources at a git revision
(default HEAD) against the working tree's, on the same packed layers and inputs, taking turns round by round (the
order flipping each round), best of the rounds. For a kernel change whose gain is smaller than the machine's
run-to-run noise: both builds see the same noise. Random blocks of each GGUF format, or a dense bf16 / float32
layer (--kinds BF16,F32; benchmarks/kernel_layers.py), one layer cycled through 4 copies; also how far the two
builds' outputs are apart. With --shape, the products of a whole decode step of a real shape instead
(benchmarks/real_shapes.py's: every layer's q/k/v, o, gate/up and down, each layer its own copy, and the output
projection), one pass timed, with the GB/s it reads and the memory's read bandwidth measured in the same run.
With --model-path, whole native decode steps of a model instead (a GGUF file, or an HF folder in --dtype): the
engine's own step (norms, RoPE, attention, barriers and all), the two builds taking turns on it, the median step of
each round, with the GB/s of the weights it reads.

    python benchmarks/kernel_ab.py [--base HEAD] [--kinds Q4_K,Q5_K,Q6_K,BF16] [--rows 1,8,512] [--n 2048] [--k 2048]
    python benchmarks/kernel_ab.py --shape llama-3.2-1b --kinds Q8_0,Q4_K --rows 1,8
    python benchmarks/kernel_ab.py --model-path model-q4_k_m.gguf --rows 1,8
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kernel_layers import DENSE, Packed, packed  # noqa: E402

from radixserve.kernels import cpu_native  # noqa: E402

ROUNDS, COPIES = 6, 4


def build_at(rev: str, work: Path):
    """The kernel library built from ``kernels/native`` as it is at git revision ``rev``."""
    src = work / "native"
    src.mkdir()
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "kernels/native/"],
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"], capture_output=True, text=True,
                              check=True).stdout
        (src / Path(name).name).write_text(text)
    here, flags, abi = cpu_native.SOURCE, cpu_native.FLAGS, cpu_native.ABI_VERSION
    # a revision before decode.cpp exported its rs_ functions by name needs every symbol visible; the working
    # tree's build keeps its own symbols hidden, so neither binds to the other's
    cpu_native.SOURCE = src / here.name
    cpu_native.FLAGS = tuple(f for f in flags if f != "-fvisibility=hidden")
    cpu_native.ABI_VERSION = int(re.search(r"rs_abi_version\(\) \{ return (\d+);", cpu_native.SOURCE.read_text())[1])
    try:
        return cpu_native.load(work / "lib")
    finally:
        cpu_native.SOURCE, cpu_native.FLAGS, cpu_native.ABI_VERSION = here, flags, abi


def step_layers(shape: str, kind: str) -> list[Packed]:
    """The products of one decode step of ``shape`` in ``kind``, each layer's weights a copy of their own."""
    from shape_models import SHAPES, products_of

    out = []
    for n, k, times in products_of(SHAPES[shape][1], 49152):  # SmolLM2's vocabulary, as real_shapes' checkpoints
        one = packed(kind, n, k, 1)[0]
        out += [one] + [Packed(one.lin.format, tuple(None if t is None else t.clone() for t in one.tensors), n, k)
                        for _ in range(times - 1)]
    return out


def wall(run):
    """``seconds(lib)``: how long ``run(lib)`` takes by the clock."""
    def seconds(lib) -> float:
        start = time.perf_counter()
        run(lib)
        return time.perf_counter() - start
    return seconds


def best_of_rounds(libs: dict, seconds, between=None) -> dict[str, float]:
    """``seconds(lib)`` for each build, best of ROUNDS rounds taken in turn (the order flipping each round);
    ``between()`` before each round."""
    best = dict.fromkeys(libs, float("inf"))
    for r in range(ROUNDS):
        if between is not None:
            between()
        for name, lib in list(libs.items())[:: 1 if r % 2 == 0 else -1]:
            best[name] = min(best[name], seconds(lib))
    return best


def compare_step(libs: dict, base: str, shape: str, kinds: list[str], rows_list: list[int]) -> None:
    from machine import read_bandwidth

    print(f"| format | rows | {base} ms | working tree ms | {base} / working tree | GB/s ({base} / tree) | "
          f"read bandwidth GB/s |  ({cpu_native.isa(libs['working tree'])}, {shape}'s step, "
          f"{torch.get_num_threads()} threads)")
    print("|---|---|---|---|---|---|---|")
    for kind in kinds:
        layers = step_layers(shape, kind)
        nbytes = sum(p.nbytes for p in layers)
        for rows in rows_list:
            xs = {k: torch.randn(rows, k, dtype=DENSE.get(kind, torch.float32)) for k in {p.lin.k for p in layers}}
            reads = []
            best = best_of_rounds(libs, wall(lambda lib: [cpu_native.product(lib, p.lin, xs[p.lin.k]) for p in layers]),
                                  lambda: reads.append(read_bandwidth()))
            b, t = best[base], best["working tree"]
            print(f"| {kind} | {rows} | {b * 1e3:.1f} | {t * 1e3:.1f} | {b / t:.2f}x | {nbytes / b / 1e9:.1f} / "
                  f"{nbytes / t / 1e9:.1f} | {max(reads) / 1e9:.1f} |", flush=True)


def compare_model(libs: dict, base: str, model_path: str, dtype: str, rows_list: list[int], steps: int) -> None:
    """Whole decode steps of the model at ``model_path`` through each build (the engine's NativeDecode handed the
    build's library in turn: both take the same structures), median step of each round, best of the rounds."""
    from forward_speed import Ours
    from machine import read_bandwidth

    from radixserve import Engine

    gguf = model_path.endswith(".gguf")
    engine = Engine(model_path, **(dict(quantization="gguf") if gguf else dict(dtype=dtype)),
                    max_total_tokens=max(rows_list) * (steps + 64) + 4096)
    native = engine.runner.native
    if native is None:
        sys.exit("the native decode step does not run here")
    nbytes = sum(t.numel() * t.element_size() for t in native._keep if isinstance(t, torch.Tensor))
    ours = Ours(engine)
    print(f"| rows | {base} ms | working tree ms | {base} / working tree | weights GB/s ({base} / tree) | read "
          f"bandwidth GB/s |  ({native.isa}, {Path(model_path).name}, {nbytes / 1e9:.2f} GB of weights, "
          f"{torch.get_num_threads()} threads)")
    print("|---|---|---|---|---|---|")
    for rows in rows_list:
        reads = []

        def median_step(lib) -> float:
            native.lib = lib
            return ours.decode(rows, 16, steps, seed=rows)

        ours.decode(rows, 16, 2, seed=rows)  # warm-up
        best = best_of_rounds(libs, median_step, lambda: reads.append(read_bandwidth()))
        b, t = best[base], best["working tree"]
        print(f"| {rows} | {b * 1e3:.1f} | {t * 1e3:.1f} | {b / t:.2f}x | {nbytes / b / 1e9:.1f} / "
              f"{nbytes / t / 1e9:.1f} | {max(reads) / 1e9:.1f} |", flush=True)
    engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree's kernel with")
    ap.add_argument("--kinds", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", default="1,8,512")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--shape", default=None, help="a real shape's whole step (benchmarks/real_shapes.py's SHAPES) "
                    "instead of one layer of --n x --k")
    ap.add_argument("--model-path", default=None, help="whole decode steps of this model (a GGUF file or an HF "
                    "folder) instead of products")
    ap.add_argument("--dtype", default="bfloat16", help="an HF folder's dtype (--model-path)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps a round (--model-path)")
    args = ap.parse_args()
    n, k = args.n, args.k
    with tempfile.TemporaryDirectory() as work:
        libs = {args.base: build_at(args.base, Path(work)), "working tree": cpu_native.load(Path(work) / "tree")}
        if args.model_path:
            compare_model(libs, args.base, args.model_path, args.dtype, list(map(int, args.rows.split(","))),
                          args.steps)
            return
        if args.shape:
            compare_step(libs, args.base, args.shape, args.kinds.split(","), list(map(int, args.rows.split(","))))
            return
        print(f"| format | rows | {args.base} ms | working tree ms | {args.base} / working tree | outputs apart |  "
              f"({cpu_native.isa(libs['working tree'])}, {n} x {k}, {torch.get_num_threads()} threads)")
        print("|---|---|---|---|---|---|")
        for kind in args.kinds.split(","):
            packs = packed(kind, n, k, COPIES)
            lins = [p.lin for p in packs]
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k, dtype=DENSE.get(kind, torch.float32))
                a, b = (cpu_native.product(lib, lins[0], x) for lib in libs.values())
                apart = float((a - b).norm() / a.norm())
                reps = max(1, 64 // rows)
                best = best_of_rounds(libs, wall(lambda lib: [cpu_native.product(lib, lin, x) for _ in range(reps)
                                                              for lin in lins]))
                base, tree = (best[name] / (reps * COPIES) for name in (args.base, "working tree"))
                print(f"| {kind} | {rows} | {base * 1e3:.3f} | {tree * 1e3:.3f} | {base / tree:.2f}x | {apart:.2e} |",
                      flush=True)


if __name__ == "__main__":
    main()
