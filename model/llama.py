"""Llama-family decoder (Llama 2/3, Mistral, SmolLM, TinyLlama, Qwen2/2.5) over the paged KV pool.

Module names follow the HF checkpoints, so loading is a name lookup plus the two fused projections below.
The block reads like the paper: norm -> attention -> residual -> norm -> MLP -> residual.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.config import ModelConfig
from radixserve.model.parallel import SINGLE, TPGroup, row_parallel_bias

if TYPE_CHECKING:
    from radixserve.model.forward_batch import ForwardBatch

# HF weight -> (our fused parameter, shard). Everything else loads by its own name.
FUSED_WEIGHTS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)


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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32, then back, as the reference does (one fused kernel; bitwise the same as its four ops)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] written as roll(x) * [-1, 1]: the sign
    lives in ``sin`` (RopeTable.sin_rotated), so this is four ops and bitwise the same."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    """This rank's heads (all of them on one rank): Q/K/V column-parallel, O row-parallel (model/parallel.py)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, tp.kv_heads(cfg.num_kv_heads)[1]
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        n, h, kv = x.shape[0], self.num_heads, self.num_kv_heads
        qk, v = self.qkv_proj(x).view(n, h + 2 * kv, self.head_dim).split([h + kv, kv], dim=1)
        q, k = apply_rope(qk, batch.cos, batch.sin).split([h, kv], dim=1)  # q and k heads in one go
        attn, meta = batch.attn_backend, batch.attn
        attn.store_kv(k_pool, v_pool, meta, k, v)
        if meta.mode == "decode":
            o = attn.decode(q, k_pool, v_pool, meta, self.scale)
        else:
            o = attn.extend(q, k, v, k_pool, v_pool, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(o.reshape(n, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        size = cfg.intermediate_size // tp.size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": size, "up": size}, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """``k_pool``/``v_pool``: this layer's part of the KV pool."""
        h = h + self.self_attn(self.input_layernorm(h), batch, k_pool, v_pool)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(tp.vocab(cfg.vocab_size)[1], cfg.hidden_size)  # this rank's rows
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Returns next-token logits for the positions ``batch.logit_rows`` only (the last token of each request
    that samples), so the vocabulary projection is not paid for every prompt token. Under tensor parallelism
    (``tp``) every rank holds its share of each layer and rank 0 gets the whole logits."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = Backbone(cfg, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab(cfg.vocab_size)[1], bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``ids``: on several ranks, each looks up the ids in its vocabulary shard (zeros for
        the others') and an all-reduce adds the shards up."""
        if self.tp.size == 1:
            return self.model.embed_tokens(ids)
        start, held, _ = self.tp.vocab(self.config.vocab_size)
        local = ids - start
        mine = (local >= 0) & (local < held)
        h = self.model.embed_tokens(torch.where(mine, local, 0)).masked_fill_(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)

    def forward(self, batch: ForwardBatch, run_layer: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """``run_layer(layer, h, batch, k_pool, v_pool)``: how a layer is run (a compiled decode layer); default:
        ``layer(h, batch, k_pool, v_pool)``."""
        h = self.embed(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, batch, *batch.kv.layer(i)) if run_layer is None else run_layer(layer, h, batch,
                                                                                         *batch.kv.layer(i))
        h = self.model.norm(h[batch.logit_rows])
        return self.tp.gather_vocab(self.lm_head(h).float(), self.config.vocab_size)

    def load_weights(self, weights) -> None:
        """``weights``: iterable of (HF name, tensor), each already cut to this rank's part of it
        (``parallel.shard_of``). Every parameter must be covered exactly once."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_WEIGHTS) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            module_name, _, param = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            if leaf in FUSED_WEIGHTS:
                fused, shard = FUSED_WEIGHTS[leaf]
                modules[f"{parent}.{fused}"].load_shard(shard, param, tensor)
                loaded.add(f"{parent}.{fused}.{param}:{shard}")
            elif name in params:
                data = params[name].data
                if row_parallel_bias(self.tp, name):
                    tensor = torch.zeros_like(tensor)
                if len(tensor) < len(data):  # the last vocabulary shard: padded with zero rows
                    data[len(tensor):].zero_()
                data[: len(tensor)].copy_(tensor)
                loaded.add(name)
            else:
                raise ValueError(f"checkpoint weight {name!r} has no place in the {self.config.model_type} model")
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        expected = set()
        for pname in params:
            module_name, _, param = pname.rpartition(".")
            module = modules[module_name]
            if isinstance(module, FusedLinear):
                expected |= {f"{pname}:{s}" for s in module.shards}
            elif not (pname == "lm_head.weight" and self.config.tie_word_embeddings):
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
