"""Linear layers for CPU inference in bf16/fp16, as fast as this machine allows.

Measured here (2 cores, avx512_bf16 without AMX, torch 2.13):
- decoding streams every weight once per step, so small batches are bandwidth-bound: a weight reordered once into
  oneDNN's blocked layout streams at ~14 GB/s vs ~10 GB/s through F.linear, bitwise the same result;
- large batches (prefill, M >= 64 rows) are compute-bound, and this CPU's bf16 GEMM (~150 GFLOP/s) is slower than
  its float32 GEMM (~300 GFLOP/s): there a float32 copy of the weight is 1.3-1.4x faster end to end, and more
  exact. Whether that holds is measured when the model is packed (machines with AMX are the other way round), so
  the float32 copy exists only where it pays.

Batch invariance (``--deterministic``): a packed oneDNN product computes each row the same way whatever the
number of rows *up to a limit* -- measured here: bf16 1536->576 rounds rows differently from ~130 rows up (it
blocks K differently), float32 from two rows up to hundreds (one row takes a GEMV path) -- while torch's default
float32 GEMM varies from 2 rows on, and the float32 copy at 64 rows changes a row by definition. So a
deterministic model packs every linear (float32 too), never uses the float32 copy, computes a lone row as a
pair, and cuts a batch of rows into products of a few fixed sizes (``RowBlocks``): powers of two from ``small``
to ``large`` rows, then the remainder (fewer than ``small``) as it is. The sizes are probed per layer shape at load
-- every count up to ``small`` and every power of two up to ``large`` must give each row bitwise its result alone
-- so checking a few hundred rows covers any batch. ``model.determinism`` then checks the whole model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

F32_MIN_ROWS = 64  # below this a product is bandwidth-bound: the packed low-precision weight wins
SMALL_ROWS, LARGE_ROWS = 16, 128  # deterministic mode: the product sizes tried (a shape may need fewer)


@dataclass(frozen=True)
class RowBlocks:
    """How a deterministic linear cuts n rows into products: as many ``large``-row products as fit, then one
    product of each power of two down to ``small`` that still fits, then the rest (< small) in one product.
    Each size was checked to compute every row as it is computed alone."""

    small: int
    large: int

    def sizes(self, n: int) -> list[int]:
        out, p = [self.large] * (n // self.large), self.large
        n -= self.large * len(out)
        while p >= self.small:
            if n >= p:
                out.append(p)
                n -= p
            p //= 2
        return out + ([n] if n else [])


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, float32_copy: bool,
                 min_rows: int = 1, blocks: RowBlocks | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = None if bias is None else bias.detach()
        self.w32 = weight.detach().float() if float32_copy else None
        self.b32 = None if bias is None or not float32_copy else bias.detach().float()
        self.min_rows = min_rows  # fewer rows are padded up to this many (a GEMV path would round differently)
        self.blocks = blocks  # deterministic: the product sizes a batch of rows is cut into (None: one product)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w32 is not None and x.shape[0] >= F32_MIN_ROWS:
            return F.linear(x.float(), self.w32, self.b32).to(x.dtype)
        if self.blocks is not None and x.shape[0] > self.blocks.small:
            return torch.cat([self._product(part) for part in x.split(self.blocks.sizes(x.shape[0]))])
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if 0 < n < self.min_rows:
            x = x.expand(self.min_rows, -1) if n == 1 else torch.cat([x, x[:1].expand(self.min_rows - n, -1)])
        return packed_linear(x.contiguous(), self.packed, self.bias)[:n]


@torch.library.custom_op("radixserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product with a weight reordered by ``_reorder_linear_weight``; an opaque op to torch.compile (whose
    own lowering of it only takes weights frozen into the graph)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def can_pack(dtype: torch.dtype, device: torch.device, deterministic: bool = False) -> bool:
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if deterministic else ())
    return device.type == "cpu" and dtype in dtypes and torch.backends.mkldnn.is_available()


def float32_gemm_pays(dtype: torch.dtype, rows: int = 256, features: int = 1024) -> bool:
    """Is a float32 GEMM (with the casts) clearly faster than a packed ``dtype`` one on this machine?"""
    w = torch.randn(4 * features, features, dtype=dtype)
    x = torch.randn(rows, features, dtype=dtype)
    low, high = PackedLinear(w, None, False), PackedLinear(w, None, True)

    def best(layer: PackedLinear) -> float:
        layer(x)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t)
        return min(times)

    return best(high) < 0.85 * best(low)


def invariant_blocks(layer: PackedLinear, small: int = SMALL_ROWS, large: int = LARGE_ROWS) -> RowBlocks:
    """The product sizes under which ``layer`` computes every row bitwise as it computes the row alone: every
    count up to ``small``, then powers of two up to ``large``, each shrunk to what this machine's kernels keep
    (they pick their blocking by shape, not by value, so random rows tell)."""
    x = torch.randn(large, layer.in_features, generator=torch.Generator().manual_seed(0)).to(layer.packed.dtype)
    alone = torch.cat([layer._product(x[i : i + 1]) for i in range(large)])

    def same(m: int) -> bool:
        return torch.equal(layer._product(x[:m]), alone[:m])

    ok_small = next((m - 1 for m in range(2, small + 1) if not same(m)), small)
    small = 1 << (ok_small.bit_length() - 1)  # a power of two: the smallest block size
    p = 2 * small
    while p <= large and same(p):
        p *= 2
    return RowBlocks(small, p // 2)


def pack_linears(model: nn.Module, deterministic: bool = False) -> int:
    """Swap every nn.Linear of ``model`` (CPU, bf16/fp16; float32 too when ``deterministic``) for a PackedLinear;
    returns how many were swapped. A layer whose packed product is not bitwise F.linear's, or that cannot be
    packed, stays as it is -- except in deterministic mode, where every layer must pack (RuntimeError if not) and
    a float32 layer only has to agree with F.linear to rounding."""
    linears = [(p, n, c) for p in model.modules() for n, c in p.named_children() if isinstance(c, nn.Linear)
               and can_pack(c.weight.dtype, c.weight.device, deterministic)]
    if not linears:
        return 0
    float32_copy = not deterministic and float32_gemm_pays(linears[0][2].weight.dtype)
    log.info("CPU linears: %s", "packed low precision for small batches, float32 for large ones" if float32_copy
             else "packed, batch-invariant" if deterministic else "packed low precision")
    swapped = 0
    row_blocks: dict[tuple, RowBlocks] = {}  # per (shape, dtype, bias): layers of one shape share their kernels
    for parent, name, child in linears:
        try:
            packed = PackedLinear(child.weight, child.bias, float32_copy, min_rows=2 if deterministic else 1)
            if deterministic:
                shape = (*child.weight.shape, child.weight.dtype, child.bias is not None)
                if shape not in row_blocks:
                    row_blocks[shape] = invariant_blocks(packed)
                    log.info("deterministic: %s products of %s rows", tuple(child.weight.shape[::-1]),
                             row_blocks[shape])
                packed.blocks = row_blocks[shape]
            probe = torch.randn(3, child.in_features, dtype=child.weight.dtype)
            same = torch.equal if child.weight.dtype != torch.float32 else \
                lambda a, b: (a - b).abs().max() <= 1e-5 * (1 + b.abs().max())  # float32: rounding apart
            if not same(packed(probe), child(probe)):
                raise RuntimeError("the packed product differs from F.linear")
        except RuntimeError as exc:  # this torch build cannot pack: plain F.linear it is
            if deterministic:
                raise RuntimeError(f"--deterministic: cannot pack linear layer {name} for a batch-invariant "
                                   f"product ({exc})") from exc
            log.debug("not packing %s: %s", name, exc)
            continue
        setattr(parent, name, packed)
        swapped += 1
    return swapped
