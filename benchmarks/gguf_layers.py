"""One GGUF layer's product through the native kernel, per block format, at batch 1: milliseconds, bits a weight
the kernel reads (scales included) and the GB/s that makes; the Q5 formats also in the layout they took before
they had their own (8-bit bytes with a float32 scale and offset per 32 weights). Random blocks of each format
(tests/conftest.py's ``random_blocks``), a layer of 8192 x 2048 cycled through 6 copies so that every product
reads from memory, best of 5 rounds of 10 passes.

    python benchmarks/gguf_layers.py [--rows 1] [--n 8192] [--k 2048] [--kinds Q4_K,Q6_K]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import random_blocks  # noqa: E402

from radixserve.kernels import cpu_native  # noqa: E402
from radixserve.model.gguf_quant import _as_layer, decode_blocks  # noqa: E402
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
    print(f"| format | layout | ms | bits a weight | GB/s |  ({cpu_native.isa(lib)}, {args.rows} row(s), {n} x {k})")
    print("|---|---|---|---|---|")
    for kind in kinds:
        layer = _as_layer([decode_blocks(random_blocks(kind, n, k, seed=1), kind)], torch.float32)
        q = layer.q if layer.bits == 8 else torch.stack([layer.nibbles & 15, layer.nibbles >> 4], -1).view(n, k)
        layouts = {"its own bits": lambda: pack_gguf(q, layer.file_blocks[0])}
        if kind.startswith("Q5"):
            layouts["8-bit bytes + fp32 scale, offset"] = lambda: (
                cpu_native.Q8, (*pack_q8(q, layer.scale), _blocks(layer.offset, (n + 15) // 16 * 16), None, None))
        for name, pack in layouts.items():
            packs = [pack() for _ in range(COPIES)]
            lins = []
            for form, tensors in packs:
                ptrs = [None if t is None else t.data_ptr() for t in tensors]
                lins.append(cpu_native.Linear(form, n, k, 0, *ptrs[:3], None, *ptrs[3:]))
            nbytes = sum(t.numel() * t.element_size() for t in packs[0][1] if t is not None)
            for lin in lins:
                cpu_native.product(lib, lin, x)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    for lin in lins:
                        cpu_native.product(lib, lin, x)
                best = min(best, (time.perf_counter() - start) / (10 * COPIES))
            print(f"| {kind} | {name} | {best * 1e3:.3f} | {nbytes * 8 / (n * k):.2f} | {nbytes / best / 1e9:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
