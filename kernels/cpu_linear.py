"""Linear layers for CPU inference in bf16/fp16, as fast as this machine allows.

- decoding streams every weight once per step, so small batches are bandwidth-bound: a weight reordered once into
  oneDNN's blocked layout streams faster than through F.linear, bitwise the same result;
- large batches (prefill, M >= 64 rows) are compute-bound, and on CPUs without AMX (avx512_bf16 ones included)
  the bf16 GEMM can be slower than the float32 one, where a float32 copy of the weight is faster end to end and
  more exact. Which is faster is measured on this machine when the model is packed (with AMX it is the other way
  round), so the float32 copy exists only where it pays;
- on a CPU where oneDNN has no bf16 GEMM at all (AVX2 only) torch's fallback multiplies bf16 at about a tenth of
  float32's rate (measured on a Zen 3: 11 against 150 GFLOP/s), so a prefill of a 135M model ran at 70 tokens/s:
  there the weights stay as they are and large products run in float32 on a copy made for that product only
  (WidenedLinear: no second copy kept, the model's memory stays its own).
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

F32_MIN_ROWS = 64  # below this a product is bandwidth-bound: the packed low-precision weight wins
WIDEN_ROWS = 512  # output rows of a weight widened to float32 at a time (WidenedLinear)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, float32_copy: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = None if bias is None else bias.detach()
        self.w32 = weight.detach().float() if float32_copy else None
        self.b32 = None if bias is None or not float32_copy else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w32 is not None and x.shape[0] >= F32_MIN_ROWS:
            return F.linear(x.float(), self.w32, self.b32).to(x.dtype)
        return packed_linear(x.contiguous(), self.packed, self.bias)


class WidenedLinear(nn.Module):
    """A bf16/fp16 linear left unpacked (oneDNN cannot pack it here): products of F32_MIN_ROWS rows and more in
    float32, smaller ones as F.linear. The weight is widened WIDEN_ROWS output rows at a time, each block's GEMM
    run while its float32 copy is still in cache: widening it whole wrote and re-read a float32 weight through
    memory (measured on a Zen 3, 512 rows x Qwen2.5-1.5B's gate/up: 301 ms whole, 165 ms in blocks of 512)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < F32_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        x32 = x.float()
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)
        for r in range(0, self.out_features, WIDEN_ROWS):
            bias = None if self.bias is None else self.bias[r : r + WIDEN_ROWS].float()
            y[..., r : r + WIDEN_ROWS] = F.linear(x32, self.weight[r : r + WIDEN_ROWS].float(), bias)
        return y


@torch.library.custom_op("radixserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product with a weight reordered by ``_reorder_linear_weight``; an opaque op to torch.compile (whose
    own lowering of it only takes weights frozen into the graph)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Does oneDNN multiply ``dtype`` natively on this CPU? (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an
    AVX2-only CPU refuses to reorder the weight.)"""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or not torch.backends.mkldnn.is_available():
        return False
    supported = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
                 else torch.ops.mkldnn._is_mkldnn_fp16_supported)
    return bool(supported())


def float32_gemm_pays(dtype: torch.dtype, packed: bool = True, rows: int = 256, features: int = 1024) -> bool:
    """Is a float32 GEMM (with the casts) clearly faster than a ``dtype`` one on this machine -- packed for oneDNN,
    or (``packed=False``) torch's own?"""
    w = torch.randn(4 * features, features, dtype=dtype)
    x = torch.randn(rows, features, dtype=dtype)
    if packed:
        low, high = PackedLinear(w, None, False), PackedLinear(w, None, True)
    else:
        plain = nn.Linear(features, 4 * features, bias=False, dtype=dtype)
        plain.weight.data = w
        low, high = plain, WidenedLinear(plain)

    def best(layer: nn.Module) -> float:
        layer(x)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t)
        return min(times)

    return best(high) < 0.85 * best(low)


def low_precision_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, layer) of every CPU nn.Linear of ``model`` in bf16 or fp16."""
    return [(p, n, c) for p in model.modules() for n, c in p.named_children() if isinstance(c, nn.Linear)
            and c.weight.device.type == "cpu" and c.weight.dtype in (torch.bfloat16, torch.float16)]


def pack_linears(model: nn.Module) -> str | None:
    """Swap every nn.Linear of ``model`` (CPU, bf16/fp16) for a PackedLinear, or, where oneDNN cannot pack that
    dtype, for a WidenedLinear if float32 products pay here; returns what was done (None: nothing). A layer whose
    packed product is not bitwise F.linear's, or that cannot be packed, stays as it is."""
    linears = low_precision_linears(model)
    if not linears:
        return None
    dtype = linears[0][2].weight.dtype
    if not can_pack(dtype, torch.device("cpu")):
        if not float32_gemm_pays(dtype, packed=False):
            return None
        for parent, name, child in linears:
            setattr(parent, name, WidenedLinear(child))
        return (f"{len(linears)} linear layers: oneDNN has no {dtype} GEMM on this CPU; products of "
                f"{F32_MIN_ROWS}+ rows in float32")
    try:
        float32_copy = float32_gemm_pays(dtype)
    except RuntimeError as exc:  # this CPU or torch build cannot pack after all: plain F.linear everywhere
        log.info("CPU linears: not packed (%s)", exc)
        return None
    swapped = 0
    for parent, name, child in linears:
        try:
            packed = PackedLinear(child.weight, child.bias, float32_copy)
            probe = torch.randn(3, child.in_features, dtype=child.weight.dtype)
            if not torch.equal(packed(probe), child(probe)):
                raise RuntimeError("the packed product differs from F.linear")
        except RuntimeError as exc:  # this torch build cannot pack: plain F.linear it is
            log.debug("not packing %s: %s", name, exc)
            continue
        setattr(parent, name, packed)
        swapped += 1
    if not swapped:
        return None
    return (f"{swapped} linear layers packed for oneDNN: low precision for small batches" +
            (", float32 for large ones" if float32_copy else ""))
