"""Weight-only quantized linear layers for the CPU (``--quantization int8|int4``).

- int8: one scale per output channel (symmetric): ``w = q * scale``, q in [-127, 127]; or, as a GGUF file's Q8_0
  ships, one scale per 32 weights of a row (``scale`` [N, K/32]): torch's int8 kernel takes only the former, so
  such a layer's torch products always use the dequantized copy (the native decode step reads the blocks).
- int4: groups of ``group`` weights along the input dimension, each with a scale and a zero point: ``w = (q - 8) *
  scale + zero``, q in [0, 15] (torch's int4pack convention; GGUF's Q4_0 and Q4_1 blocks map onto it exactly).

Decoding a few rows streams every weight once per step, so fewer bytes per weight is speed: torch's packed CPU
kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) multiply straight from the quantized weights.
For one row they beat bf16 F.linear by about the bytes they save; from a few rows on they lose to a GEMM, so for
a prefill the weight is dequantized to the activations' dtype for that one product. The crossover is measured per
layer shape at load.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

INT4_GROUP = 32  # GGUF's Q4 block size; a smaller group is more exact, a larger one smaller
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Int4Weight:
    """An int4 weight in two forms: torch's packed layout for its kernel, and nibbles for dequantizing."""

    packed: torch.Tensor  # torch's int4pack layout (opaque)
    nibbles: torch.Tensor  # uint8 [N, K/2]: element 2i in the low nibble, 2i+1 in the high one
    scale_zero: torch.Tensor  # float32 [K/group, N, 2]: scale and zero of each group
    group: int


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel, symmetric: (q int8 [N, K], scale float32 [N])."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric, per group of ``group`` input weights: (q int32 [N, K] in 0..15, scale [N, K/g], zero [N, K/g])
    with ``w ~ (q - 8) * scale + zero``."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs the input dimension ({k}) to be a multiple of the group size ({group})")
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.view(n, k), scale, lo + 8 * scale


def int4_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """From q [N, K] (0..15), scale and zero [N, K/group]."""
    n, k = q.shape
    group = k // scale.shape[1]
    q = q.to(torch.int32).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().float()
    return Int4Weight(packed, nibbles, scale_zero, group)


class QuantLinear(nn.Module):
    """``y = x W^T (+ b)`` with W int8 or int4 (see the module docstring). ``kernel_rows``: products of at most
    this many rows use the quantized kernel, larger ones a dequantized copy of W (made for that product only).

    The scales are kept in float32 and the dequantized copy is computed in float32, then rounded once to the
    activations' dtype: the same weights a bf16 model of the dequantized checkpoint holds. torch's kernels take
    their scales in the activations' dtype (bf16: 8 bits of mantissa against GGUF's 11), so the kernel's products
    differ from that in the last bits; the bench report measures how often a greedy token flips."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype, *,
                 int8: tuple[torch.Tensor, torch.Tensor] | None = None, int4: Int4Weight | None = None) -> None:
        super().__init__()
        if (int8 is None) == (int4 is None):
            raise ValueError("give exactly one of int8= or int4=")
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.bits = 8 if int8 is not None else 4
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.group = 0
        if int8 is not None:
            self.register_buffer("q", int8[0].contiguous())
            self.register_buffer("scale", int8[1].float())
            self.register_buffer("kernel_scale", int8[1].to(dtype))
        else:
            self.register_buffer("packed", int4.packed)
            self.register_buffer("nibbles", int4.nibbles)
            self.register_buffer("scale_zero", int4.scale_zero)
            self.register_buffer("kernel_scale_zero", int4.scale_zero.to(dtype))
            self.group = int4.group
        self.kernel_rows = 0 if self.block_scales else 4  # quantize_model measures it per shape

    @property
    def block_scales(self) -> bool:
        """int8 with a scale per 32 weights (a GGUF Q8_0 layer), which torch's int8 kernel cannot take."""
        return self.bits == 8 and self.scale.dim() == 2

    def dequantized(self) -> torch.Tensor:
        """W in the activations' dtype, [N, K]."""
        if self.block_scales:
            blocks = self.q.float().view(self.out_features, -1, self.in_features // self.scale.shape[1])
            return (blocks * self.scale[..., None]).view(self.out_features, self.in_features).to(self.dtype)
        if self.bits == 8:
            return (self.q.float() * self.scale[:, None]).to(self.dtype)
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1)
        q = q.view(self.out_features, -1, self.group).float()
        scale, zero = self.scale_zero[..., 0].t(), self.scale_zero[..., 1].t()  # [N, K/group]
        w = (q - 8) * scale[..., None] + zero[..., None]
        return w.view(self.out_features, self.in_features).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.kernel_rows:
            y = self._kernel(x2)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x2, self.dequantized(), self.bias)
        return y.view(*shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype).contiguous()
        if self.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self.kernel_scale)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.kernel_scale_zero)


def quantize_linear(layer: nn.Linear, bits: int, dtype: torch.dtype, group: int = INT4_GROUP) -> QuantLinear:
    n, k = layer.weight.shape
    bias = layer.bias.detach() if layer.bias is not None else None
    if bits == 8:
        return QuantLinear(n, k, bias, dtype, int8=quantize_int8(layer.weight.detach()))
    q, scale, zero = quantize_int4(layer.weight.detach(), group)
    return QuantLinear(n, k, bias, dtype, int4=int4_weight(q, scale, zero, dtype))


def kernel_rows(layer: QuantLinear, repeats: int = 5) -> int:
    """The most rows for which the quantized kernel beats dequantize + GEMM on this machine (at least 1; 0 for a
    layer no torch kernel takes)."""
    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    if layer.block_scales:
        return 0  # no torch kernel takes them: every torch product dequantizes
    rows = 1
    for m in PROBE_ROWS:
        x = torch.randn(m, layer.in_features, dtype=layer.dtype)
        if best(lambda: layer._kernel(x)) > best(lambda: F.linear(x, layer.dequantized())):
            break
        rows = m
    return rows


def quantize_model(model: nn.Module, bits: int, dtype: torch.dtype, prebuilt: dict[str, QuantLinear] | None = None,
                   skip: tuple[str, ...] = ()) -> int:
    """Swap every nn.Linear for a QuantLinear (``prebuilt[name]`` where given, e.g. from a GGUF file's own blocks);
    ``skip``: names kept as they are. Returns how many were swapped."""
    prebuilt = prebuilt or {}
    crossover: dict[tuple[int, int], int] = {}
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, nn.Linear) or full in skip:
                continue
            layer = prebuilt.get(full) or quantize_linear(child, bits, dtype)
            shape = (layer.out_features, layer.in_features)
            if shape not in crossover:
                crossover[shape] = kernel_rows(layer)
                log.info("%s int%d %s: quantized kernel up to %d rows, then dequantize + GEMM", full, layer.bits,
                         shape, crossover[shape])
            layer.kernel_rows = crossover[shape]
            setattr(parent, name, layer)
            swapped += 1
    return swapped
