"""One GGUF layer's product through the native kernel, per block format, at batch 1: milliseconds, bits a weight
the kernel reads (scales included) and the GB/s that makes; the Q5 formats also in the layout they took before
they had their own (8-bit bytes with a float32 scale and offset per 32 weights). Random blocks of each format
(tests/conftest.py's ``random_blocks``), a layer of 8192 x 2048 cycled through 6 copies so that every product
reads from memory, best of 5 rounds of 10 passes; and the product's error against the exact one on the file's
weights (relative, 16 rows of Gaussian activations, and of activations with 1% of them 20x larger): the cost of
quantizing the activations to 8 bits.

    python benchmarks/gguf_layers.py [--rows 1] [--n 8192] [--k 2048] [--kinds Q4_K,Q6_K]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_layers import Packed, codes, gguf_layer  # noqa: E402

from radixserve.kernels import cpu_native  # noqa: E402
from radixserve.model.native_decode import _blocks, pack_gguf, pack_q8  # noqa: E402

KINDS = ("Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
COPIES = 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--kinds", default=",".join(KINDS), help="the block formats, comma-separated")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if set(kinds) - set(KINDS):
        ap.error(f"--kinds: {', '.join(sorted(set(kinds) - set(KINDS)))} not among {', '.join(KINDS)}")
    n, k = args.n, args.k
    lib = cpu_native.load(cpu_native.default_cache_dir())
    x = torch.randn(args.rows, k)
    print(f"| format | layout | ms | bits a weight | GB/s | error: Gaussian x | error: 1% outliers |  "
          f"({cpu_native.isa(lib)}, {args.rows} row(s), {n} x {k})")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    probes = [torch.randn(16, k, generator=g),  # and the same with 1% of the values 20x larger
              torch.randn(16, k, generator=g) * torch.where(torch.rand(16, k, generator=g) < 0.01, 20.0, 1.0)]
    for kind in kinds:
        layer = gguf_layer(kind, n, k)
        w = layer.dequantized().double()  # the product's exact value on the file's weights: the error is the
        # activations' rounding to 8 bits (per 32 values; per 256 for K-quants)
        q = codes(layer, n, k)
        layouts = {"its own bits": lambda: pack_gguf(q, layer.file_blocks[0])}
        if kind.startswith("Q5"):
            layouts["8-bit bytes + fp32 scale, offset"] = lambda: (
                cpu_native.Q8, (*pack_q8(q, layer.scale), _blocks(layer.offset, (n + 15) // 16 * 16), None, None))
        for name, pack in layouts.items():
            packs = [Packed(*pack(), n=n, k=k) for _ in range(COPIES)]
            lins = [p.lin for p in packs]
            nbytes = packs[0].nbytes
            for lin in lins:
                cpu_native.product(lib, lin, x)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    for lin in lins:
                        cpu_native.product(lib, lin, x)
                best = min(best, (time.perf_counter() - start) / (10 * COPIES))
            errors = [relative_error(cpu_native.product(lib, lins[0], probe), probe.double() @ w.T)
                      for probe in probes]
            print(f"| {kind} | {name} | {best * 1e3:.3f} | {nbytes * 8 / (n * k):.2f} | {nbytes / best / 1e9:.1f} | "
                  + " | ".join(f"{e:.2%}" for e in errors) + " |", flush=True)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


if __name__ == "__main__":
    main()
