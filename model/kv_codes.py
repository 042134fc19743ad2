"""The KV pool in 8 bits (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``): each token's K and V head stored as
8-bit codes with one float32 scale per (token, head), ``x = code * scale``, the scale chosen so the head's
largest magnitude lands on the format's largest code. A head of 64 values takes 64 + 4 bytes instead of 128 in
bf16 (53%; of 128 values, 52%), so the same memory holds 1.9x the tokens.

Why a scale per token and head rather than per page: a page fills one token at a time, and a page-wide scale
would have to grow (re-rounding the tokens already in it) whenever a later token is larger -- changing K/V that
other requests already read through the radix tree. A token's codes here never change once written, so a
prefix's KV is the same bits whatever it is shared with, cached or recomputed, chunked or not.

Every read goes through the codes, the new tokens' own K/V included (the attention backends read them back from
the pool rather than using the unrounded ones), so greedy tokens do not depend on the radix cache or chunking.
"""
from __future__ import annotations

from dataclasses import replace

import torch

# --kv-cache-dtype -> (how a code byte reads, the largest finite magnitude a code holds)
KV_CODES = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}
TINY = 1e-12  # a head of zeros gets this scale (its codes are 0), not a division by zero


def code_values(fmt: str) -> torch.Tensor:
    """float32 [256]: what each code byte stands for (NaN and inf codes included; they are never written)."""
    return torch.arange(256, dtype=torch.uint8).view(KV_CODES[fmt][0]).float()


def encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_dim] -> (uint8 codes [..., head_dim], float32 scales [...]): round to nearest (even) code,
    int8 within +-127 (never -128), fp8 as torch rounds to it."""
    kind, limit = KV_CODES[fmt]
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp_min(TINY) / limit
    y = x / scale[..., None]
    codes = y.round().clamp_(-127, 127).to(torch.int8) if kind is torch.int8 else y.to(kind)
    return codes.view(torch.uint8), scale


class ScaledPool:
    """One layer's K (or V) pool in codes: ``codes`` uint8 [slots, kv_heads, head_dim] and ``scale`` float32
    [slots, kv_heads], views into the KVPool's tensors. It answers the two calls the torch attention backend makes
    of a pool -- ``index_copy_`` (store: encodes) and ``index_select`` (gather: decodes to ``dtype``) -- so the
    backend reads an 8-bit pool through the same code as a plain one."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> None:
        self.codes, self.scale, self.fmt, self.dtype = codes, scale, fmt, dtype
        self.kind = KV_CODES[fmt][0]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def index_copy_(self, dim: int, index: torch.Tensor, x: torch.Tensor) -> ScaledPool:
        if dim != 0:
            raise ValueError(f"a KV pool is indexed by slot (dim 0), not dim {dim}")
        codes, scale = encode(x, self.fmt)
        self.codes.index_copy_(0, index, codes)
        self.scale.index_copy_(0, index, scale)
        return self

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError(f"a KV pool is indexed by slot (dim 0), not dim {dim}")
        codes = self.codes.index_select(0, index).view(self.kind).float()
        return (codes * self.scale.index_select(0, index)[..., None]).to(self.dtype)


class DecodedReads:
    """An attention backend that reads plain pools (Triton, batch-invariant) over an 8-bit one: each layer's
    step gathers the batch's distinct slots from the codes, decoded into a small pool of the model's dtype, and the
    backend runs on that with the slots renumbered -- the same values the torch backend reads, at the cost of one
    decoded copy of the batch's keys per layer (the pool itself stays 8-bit)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"{inner.name} (8-bit KV decoded per step)"

    def prepare(self, batch):
        uniq, inverse = torch.unique(batch.slots, return_inverse=True)
        local = replace(batch, slots=inverse, out_slots=torch.searchsorted(uniq, batch.out_slots),
                                    backend_data=None)
        local.backend_data = self.inner.prepare(local)
        return uniq, local

    def store_kv(self, k_pool: ScaledPool, v_pool: ScaledPool, batch, k: torch.Tensor, v: torch.Tensor) -> None:
        k_pool.index_copy_(0, batch.out_slots, k)
        v_pool.index_copy_(0, batch.out_slots, v)

    def extend(self, q, k, v, k_pool, v_pool, batch, scale, window=None, softcap=None):
        uniq, local = batch.backend_data
        kd, vd = k_pool.index_select(0, uniq), v_pool.index_select(0, uniq)
        # the new tokens' K/V as the pool holds them too: every read sees the codes
        k, v = kd.index_select(0, local.out_slots), vd.index_select(0, local.out_slots)
        return self.inner.extend(q, k, v, kd, vd, local, scale, window, softcap)

    def decode(self, q, k_pool, v_pool, batch, scale, window=None, softcap=None):
        uniq, local = batch.backend_data
        return self.inner.decode(q, k_pool.index_select(0, uniq), v_pool.index_select(0, uniq), local, scale,
                                 window, softcap)
