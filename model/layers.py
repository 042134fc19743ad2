"""The decoder layer every family runs, configured by its ``Arch`` (model/arch.py): norms, attention over the paged
KV pool, the gated MLP. The block reads like the papers:

    h = h + attn_out_norm(attention(attn_norm(h)))     attn_out_norm: Gemma's, else nothing
    h = h + mlp_out_norm(mlp(mlp_norm(h)))             mlp_out_norm:  Gemma's, else nothing
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.config import ModelConfig
from radixserve.model.parallel import SINGLE, TPGroup

if TYPE_CHECKING:
    from radixserve.model.forward_batch import ForwardBatch

ACTIVATION = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class FusedLinear(nn.Linear):
    """Several projections of the same input in one matmul; ``shards`` maps a shard name to its output rows."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shards[name] = (start, size)
            start += size

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        start, size = self.shards[shard]
        getattr(self, param).data[start : start + size].copy_(tensor)


class RMSNorm(nn.Module):
    """``llama``: w * norm(x), normed in float32 and cast back before the weight; ``gemma``: norm(x) * (1 + w), all
    in float32, cast last (as each reference does; their weights mean different things: Gemma's are offsets)."""

    def __init__(self, dim: int, eps: float, style: str = "llama") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.gemma = eps, style == "gemma"
        self.normalize = rms_normalize  # --deterministic swaps in a batch-invariant one (model/determinism.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.normalize(x.float(), self.eps)
        if self.gemma:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused kernel; bitwise the same as the reference's four ops
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def act_mul(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return ACTIVATION[act](gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] written as roll(x) * [-1, 1]: the sign
    lives in ``sin`` (RopeTable), so this is four ops and bitwise the same. A table narrower than the head rotates
    its first dimensions and passes the rest (partial rotary embeddings)."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    return x * cos + x.roll(rotary // 2, dims=-1) * sin


class Attention(nn.Module):
    """This rank's heads (all of them on one rank): Q/K/V column-parallel, O row-parallel (model/parallel.py).
    ``window``, the softcap and the scale are this layer's; the backend applies them (kernels/base.py)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        arch = cfg.arch
        self.tp = tp
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, tp.kv_heads(cfg.num_kv_heads)[1]
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:  # over each head's head_dim: the same weights on every rank
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, arch.norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, arch.norm)
        self.qk_norm = arch.qk_norm
        self.scale = cfg.attn_scale
        self.window = arch.windows[layer] if arch.windows else None
        self.softcap = arch.attn_softcap
        self.local_rope = bool(arch.local_rope) and arch.local_rope[layer]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        n, h, kv = x.shape[0], self.num_heads, self.num_kv_heads
        qk, v = self.qkv_proj(x).view(n, h + 2 * kv, self.head_dim).split([h + kv, kv], dim=1)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        cos, sin = (batch.local_cos, batch.local_sin) if self.local_rope else (batch.cos, batch.sin)
        q, k = apply_rope(qk, cos, sin).split([h, kv], dim=1)  # q and k heads in one go
        attn, meta = batch.attn_backend, batch.attn
        attn.store_kv(k_pool, v_pool, meta, k, v)
        if meta.mode == "decode":
            o = attn.decode(q, k_pool, v_pool, meta, self.scale, window=self.window, softcap=self.softcap)
        else:
            o = attn.extend(q, k, v, k_pool, v_pool, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.tp.all_reduce(self.o_proj(o.reshape(n, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        size = cfg.intermediate_size // tp.size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": size, "up": size}, bias=cfg.arch.mlp_bias)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=cfg.arch.mlp_bias)
        self.act = cfg.arch.activation
        self.act_mul = act_mul  # --deterministic swaps in a batch-invariant one (model/determinism.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act_mul(self.act, gate, up)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        arch = cfg.arch

        def norm() -> nn.Module:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, arch.norm)

        self.attn_norm = norm()
        self.self_attn = Attention(cfg, layer, tp)
        self.attn_out_norm = norm() if arch.sandwich else nn.Identity()
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, tp)
        self.mlp_out_norm = norm() if arch.sandwich else nn.Identity()

    def forward(self, h: torch.Tensor, batch: ForwardBatch, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """``k_pool``/``v_pool``: this layer's part of the KV pool."""
        h = h + self.attn_out_norm(self.self_attn(self.attn_norm(h), batch, k_pool, v_pool))
        return h + self.mlp_out_norm(self.mlp(self.mlp_norm(h)))
