"""The native kernel's quantized products, two builds side by side in one process: the sources at a git revision
(default HEAD) against the working tree's, on the same packed layers and inputs, taking turns round by round (the
order flipping each round), best of the rounds. For a kernel change whose gain is smaller than the machine's
run-to-run noise: both builds see the same noise. Random blocks of each GGUF format (tests/conftest.py's
``random_blocks``), one layer cycled through 4 copies; also how far the two builds' outputs are apart.

    python benchmarks/kernel_ab.py [--base HEAD] [--kinds Q4_K,Q5_K,Q6_K] [--rows 1,8,512] [--n 2048] [--k 2048]
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
sys.path.insert(0, str(ROOT / "tests"))
from conftest import random_blocks  # noqa: E402

from radixserve.kernels import cpu_native  # noqa: E402
from radixserve.model.gguf_quant import _as_layer, decode_blocks  # noqa: E402
from radixserve.model.native_decode import pack_gguf  # noqa: E402

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
    here = cpu_native.SOURCE
    cpu_native.SOURCE = src / here.name
    try:
        return cpu_native.load(work / "lib")
    finally:
        cpu_native.SOURCE = here


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
            layer = _as_layer([decode_blocks(random_blocks(kind, n, k, seed=1), kind)], torch.float32)
            q = layer.q if layer.bits == 8 else torch.stack([layer.nibbles & 15, layer.nibbles >> 4], -1).view(n, k)
            packs = [pack_gguf(q, layer.file_blocks[0]) for _ in range(COPIES)]
            lins = [cpu_native.Linear(form, n, k, 0, *[None if t is None else t.data_ptr() for t in tensors][:3],
                                      None, *[None if t is None else t.data_ptr() for t in tensors][3:])
                    for form, tensors in packs]
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k)
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
