"""The native kernel's products, two builds side by side in one process: the sources at a git revision
(default HEAD) against the working tree's, on the same packed layers and inputs, taking turns round by round (the
order flipping each round), best of the rounds. For a kernel change whose gain is smaller than the machine's
run-to-run noise: both builds see the same noise. Random blocks of each GGUF format, or a dense bf16 / float32
layer (--kinds BF16,F32; benchmarks/kernel_layers.py), one layer cycled through 4 copies; also how far the two
builds' outputs are apart.

    python benchmarks/kernel_ab.py [--base HEAD] [--kinds Q4_K,Q5_K,Q6_K,BF16] [--rows 1,8,512] [--n 2048] [--k 2048]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kernel_layers import DENSE, packed  # noqa: E402

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
    here, flags = cpu_native.SOURCE, cpu_native.FLAGS
    # a revision before decode.cpp exported its rs_ functions by name needs every symbol visible; the working
    # tree's build keeps its own symbols hidden, so neither binds to the other's
    cpu_native.SOURCE = src / here.name
    cpu_native.FLAGS = tuple(f for f in flags if f != "-fvisibility=hidden")
    try:
        return cpu_native.load(work / "lib")
    finally:
        cpu_native.SOURCE, cpu_native.FLAGS = here, flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree's kernel with")
    ap.add_argument("--kinds", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", default="1,8,512")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    n, k = args.n, args.k
    with tempfile.TemporaryDirectory() as work:
        libs = {args.base: build_at(args.base, Path(work)), "working tree": cpu_native.load(Path(work) / "tree")}
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
                best = dict.fromkeys(libs, float("inf"))
                for r in range(ROUNDS):
                    for name, lib in list(libs.items())[:: 1 if r % 2 == 0 else -1]:
                        start = time.perf_counter()
                        for _ in range(reps):
                            for lin in lins:
                                cpu_native.product(lib, lin, x)
                        best[name] = min(best[name], (time.perf_counter() - start) / (reps * COPIES))
                base, tree = best[args.base], best["working tree"]
                print(f"| {kind} | {rows} | {base * 1e3:.3f} | {tree * 1e3:.3f} | {base / tree:.2f}x | {apart:.2e} |",
                      flush=True)


if __name__ == "__main__":
    main()
