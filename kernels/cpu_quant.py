"""Weight-only quantized linear layers for the CPU (``--quantization int8|int4``).

- int8: one scale per output channel (symmetric): ``w = q * scale``, q in [-127, 127]; or, as GGUF files ship
  them, a scale per block of 32 or 16 weights of a row (``scale`` [N, K/block]) and maybe an offset per block
  (``w = q * scale + offset``: Q8_0, Q5_K, Q6_K; model/gguf_quant.py). torch's int8 kernel takes only the first,
  so a block-scaled layer's torch products always use the dequantized copy (the native decode step reads blocks).
- int4: groups of ``group`` weights along the input dimension, each with a scale and an offset: ``w = q * scale +
  offset``, q in [0, 15] (GGUF's Q4_0, Q4_1 and Q4_K blocks map onto it exactly). torch's int4pack kernel takes
  ``(q - 8) * scale + zero``, zero = offset + 8 scale, rounded once more: its products are not exact anyway.

Decoding a few rows streams every weight once per step, so fewer bytes per weight is speed: torch's packed CPU
kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) multiply straight from the quantized weights.
For one row they beat bf16 F.linear by about the bytes they save; from a few rows on they lose to a GEMM, so for
a prefill the weight is dequantized to the activations' dtype for that one product. The crossover is measured per
layer shape at load. Where the native decode step runs (model/native_decode.py), every product of a quantized
layer goes through its kernel instead, on its own packed copy of the same blocks (``QuantLinear.hand_over``):
integer dot products with the activations quantized per 32 values, as llama.cpp computes its prefill. The layer then
drops its own copy, so a model's weights are held once; torch's packed forms and the crossover (``tune_kernel_rows``)
are made only for a model torch's steps multiply.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

INT4_GROUP = 32  # GGUF's Q4 block size; a smaller group is more exact, a larger one smaller
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Int4Weight:
    """An int4 weight as nibbles with their groups' scales and offsets (torch's packed layout for its kernel is made
    from them when a torch product first needs it)."""

    nibbles: torch.Tensor  # uint8 [N, K/2]: element 2i in the low nibble, 2i+1 in the high one
    scale: torch.Tensor  # float32 [N, K/group]
    offset: torch.Tensor  # float32 [N, K/group]: w = q * scale + offset
    group: int


@dataclass
class FileBlocks:
    """Rows of a GGUF layer in one block format, with its scales as the file factors them, kept for the native step
    (which reads each format in its own bits): ``scale = d sc`` and ``offset = -dmin mn`` per block of 32 (Q6_K: 16)
    weights, where

        Q4_K, Q5_K  d, dmin: float per super-block (256 weights); sc, mn: 6-bit integers per 32
        Q6_K        d per super-block; sc: int8 per 16; no offset
        Q4_0, Q5_0  d per 32 (the block's); dmin = 8 d, 16 d (sc, mn: 1)
        Q4_1, Q5_1  d per 32; dmin = -m (the block's offset)
        Q8_0        d per 32; no offset

    (every product exact in float32: ``scale`` and ``offset`` hold the same values)."""

    kind: str  # the GGUF type
    d: torch.Tensor  # float32 [N, K/256] (K-quants) or [N, K/32]
    sc: torch.Tensor | None = None  # K-quants: uint8 (0..63) or int8 (Q6_K) [N, K/group]
    dmin: torch.Tensor | None = None  # float32, d's shape; None: no offset
    mn: torch.Tensor | None = None  # Q4_K, Q5_K: uint8 [N, K/32]

    def rows(self, index: torch.Tensor) -> FileBlocks:
        return FileBlocks(self.kind, *(None if t is None else t[index] for t in (self.d, self.sc, self.dmin, self.mn)))

    @staticmethod
    def runs(shards: list[FileBlocks | None]) -> tuple[FileBlocks, ...] | None:
        """A fused layer's shards (rows one after another) as runs of one kind each (q and k of Q4_K, then v of
        Q6_K: two), or None unless every shard is a GGUF file's."""
        if not shards or any(s is None for s in shards):
            return None
        out: list[FileBlocks] = []
        for s in shards:
            if out and out[-1].kind == s.kind:
                a = out.pop()
                s = FileBlocks(s.kind, *(None if x is None else torch.cat([x, y])
                                          for x, y in zip((a.d, a.sc, a.dmin, a.mn), (s.d, s.sc, s.dmin, s.mn))))
            out.append(s)
        return tuple(out)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel, symmetric: (q int8 [N, K], scale float32 [N])."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric, per group of ``group`` input weights: (q int32 [N, K] in 0..15, scale [N, K/g], offset [N, K/g])
    with ``w ~ q * scale + offset``."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs the input dimension ({k}) to be a multiple of the group size ({group})")
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.view(n, k), scale, lo


def int4_weight(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Int4Weight:
    """From q [N, K] (0..15), scale and offset [N, K/group]: w = q * scale + offset."""
    k = q.shape[1]
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()
    return Int4Weight(nibbles, scale.float().contiguous(), offset.float().contiguous(), k // scale.shape[1])


class QuantLinear(nn.Module):
    """``y = x W^T (+ b)`` with W int8 or int4 (see the module docstring). ``kernel_rows``: products of at most
    this many rows use the quantized kernel, larger ones a dequantized copy of W (made for that product only).

    The scales are kept in float32 and the dequantized copy is computed in float32, then rounded once to the
    activations' dtype: the same weights a bf16 model of the dequantized checkpoint holds. torch's kernels take
    their scales in the activations' dtype (bf16: 8 bits of mantissa against GGUF's 11), so the kernel's products
    differ from that in the last bits; the bench report measures how often a greedy token flips."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype, *,
                 int8: tuple[torch.Tensor, ...] | None = None, int4: Int4Weight | None = None,
                 file_blocks: tuple[FileBlocks, ...] | None = None) -> None:
        """``int8``: (q, scale) or, block-scaled, (q, scale, offset); ``int4``: see Int4Weight; ``file_blocks``:
        a GGUF layer's formats and scales in the file's factors (the same values as ``scale`` and ``offset``), per
        run of rows of one format (a fused layer may mix Q4_K and Q6_K shards)."""
        super().__init__()
        if (int8 is None) == (int4 is None):
            raise ValueError("give exactly one of int8= or int4=")
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.bits = 8 if int8 is not None else 4
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.group = 0
        if int8 is not None:
            q, scale, offset = (*int8, None)[:3]
            self.register_buffer("q", q.contiguous())
            self.register_buffer("scale", scale.float())
            self.register_buffer("offset", None if offset is None else offset.float())
            if scale.dim() == 2:
                self.group = in_features // scale.shape[1]
            elif offset is not None:
                raise ValueError("an int8 offset goes with a scale per block")
        else:
            self.register_buffer("nibbles", int4.nibbles)
            self.register_buffer("scale", int4.scale)
            self.register_buffer("offset", int4.offset)
            self.group = int4.group
        # int8 with a scale per block of a row (GGUF's Q8_0, Q5_K, Q6_K), which torch's int8 kernel cannot take
        self.block_scales = self.bits == 8 and self.scale.dim() == 2
        self.file_blocks = file_blocks
        self.kernel_rows = 0 if self.block_scales else 4  # tune_kernel_rows measures it per shape
        self._operands: tuple[torch.Tensor, torch.Tensor] | None = None  # torch's kernel's weight and scales
        self.native: Callable[[torch.Tensor], torch.Tensor] | None = None  # the native step's product, where it runs
        self.handed_over = False  # True: the native step holds the only copy of the weights (hand_over)

    def hand_over(self, product: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every product from now on through ``product`` (the native step's kernel, on its own packed copy of
        these blocks), and this layer's copy dropped: the weights are held once."""
        self.native = product
        for name in ("q", "nibbles", "scale", "offset"):
            if name in self._buffers:
                self._buffers[name] = None
        self._operands = None
        self.handed_over = True

    def dequantized(self) -> torch.Tensor:
        """W in the activations' dtype, [N, K]: ``q * scale + offset`` in float32 (a product exact in float32 for
        every GGUF format taken, then one rounding: the value gguf's dequantization computes), rounded once more."""
        if self.handed_over:
            raise RuntimeError("this layer's weights are the native decode step's (hand_over): it keeps no copy")
        if self.bits == 8 and not self.block_scales:
            return (self.q.float() * self.scale[:, None]).to(self.dtype)
        q = self.q if self.bits == 8 else torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1)
        w = q.view(self.out_features, -1, self.group).float() * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.view(self.out_features, self.in_features).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.native is not None and x2.shape[0]:  # (no rows: a prefill chunk that samples nothing)
            y = self.native(x2.to(self.dtype).contiguous())  # bias included
        elif 0 < x2.shape[0] <= self.kernel_rows:
            y = self._kernel(x2)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x2, self.dequantized(), self.bias)
        return y.view(*shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype).contiguous()
        if self._operands is None:  # torch's forms of the weight, made once, for the first product that needs them
            if self.bits == 8:
                self._operands = (self.q, self.scale.to(self.dtype))
            else:
                q = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).view(self.out_features, -1)
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
                zero = self.offset + 8 * self.scale  # torch's kernel: (q - 8) * scale + zero
                self._operands = (packed, torch.stack([self.scale, zero], -1).transpose(0, 1).to(self.dtype)
                                  .contiguous())
        weight, scales = self._operands
        if self.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(x, weight, scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, self.group, scales)


def quantize_linear(layer: nn.Linear, bits: int, dtype: torch.dtype, group: int = INT4_GROUP) -> QuantLinear:
    n, k = layer.weight.shape
    bias = layer.bias.detach() if layer.bias is not None else None
    if bits == 8:
        return QuantLinear(n, k, bias, dtype, int8=quantize_int8(layer.weight.detach()))
    return QuantLinear(n, k, bias, dtype, int4=int4_weight(*quantize_int4(layer.weight.detach(), group)))


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


def quantize_model(model: nn.Module, bits: int | None, dtype: torch.dtype,
                   prebuilt: dict[str, QuantLinear] | None = None) -> int:
    """Swap every nn.Linear for a QuantLinear: ``prebuilt[name]`` where given (e.g. from a GGUF file's own blocks;
    it takes the layer's bias), else the layer quantized to ``bits`` (None: left as it is). Returns how many were
    swapped."""
    prebuilt = prebuilt or {}
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, nn.Linear) or (bits is None and full not in prebuilt):
                continue
            layer = prebuilt.get(full) or quantize_linear(child, bits, dtype)
            if full in prebuilt and child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach().to(dtype), requires_grad=False)
            setattr(parent, name, layer)
            swapped += 1
    return swapped


def tune_kernel_rows(model: nn.Module) -> None:
    """Each quantized layer's ``kernel_rows``, measured once per layer shape: for a model torch's steps multiply
    (where the native step serves, every product is its kernel's and nothing is measured)."""
    crossover: dict[tuple, int] = {}
    for full, layer in model.named_modules():
        if not isinstance(layer, QuantLinear) or layer.native is not None:
            continue
        kind = (layer.out_features, layer.in_features, layer.bits, layer.block_scales)
        if kind not in crossover:
            crossover[kind] = kernel_rows(layer)
            log.info("%s int%d %s: quantized kernel up to %d rows, then dequantize + GEMM", full, layer.bits,
                     kind[:2], crossover[kind])
        layer.kernel_rows = crossover[kind]
