"""The causal language model over the paged KV pool: embeddings, the decoder layers (model/layers.py), the final
norm and the output projection, for every family; loading maps a checkpoint's names through the family's
``WeightNames`` (model/arch.py)."""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.model.arch import FUSED
from radixserve.model.config import ModelConfig
from radixserve.model.layers import DecoderLayer, FusedLinear, RMSNorm
from radixserve.model.parallel import SINGLE, TPGroup, read_part, row_parallel_bias, shard_of

if TYPE_CHECKING:
    from radixserve.model.forward_batch import ForwardBatch

IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(tp.vocab(cfg.vocab_size)[1], cfg.hidden_size)  # this rank's rows
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm)


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
        self.tanh = torch.tanh  # of the final soft-cap; --deterministic swaps in a batch-invariant one

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``ids``: on several ranks, each looks up the ids in its vocabulary shard (zeros for
        the others') and an all-reduce adds the shards up."""
        if self.tp.size == 1:
            h = self.model.embed_tokens(ids)
        else:
            start, held, _ = self.tp.vocab(self.config.vocab_size)
            local = ids - start
            mine = (local >= 0) & (local < held)
            h = self.model.embed_tokens(torch.where(mine, local, 0)).masked_fill_(~mine.unsqueeze(-1), 0)
            h = self.tp.all_reduce(h)
        scale = self.config.arch.embed_scale
        if scale is not None:  # the reference rounds the scale to the weights' dtype first (Gemma: sqrt(3072) 55.5)
            h = h * torch.tensor(scale).to(h.dtype)
        return h

    def forward(self, batch: ForwardBatch, run_layer: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """``run_layer(layer, h, batch, k_pool, v_pool)``: how a layer is run (a compiled decode layer); default:
        ``layer(h, batch, k_pool, v_pool)``."""
        h = self.embed(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, batch, *batch.kv.layer(i)) if run_layer is None else run_layer(layer, h, batch,
                                                                                         *batch.kv.layer(i))
        logits = self.lm_head(self.model.norm(h[batch.logit_rows]))
        cap = self.config.arch.final_softcap
        if cap is not None:  # in the model's dtype, in the reference's order
            logits = self.tanh(logits / cap) * cap
        return self.tp.gather_vocab(logits.float(), self.config.vocab_size)

    def _pieces(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as the (HF Llama-style name, this rank's part) pieces it holds: itself, or, for a
        fused one (Phi-3's qkv_proj), each projection's rows cut for this rank as its own tensor would be."""
        module_name, _, param = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        pieces = self.config.arch.weights.unfused.get(leaf)
        if pieces is None:
            yield name, tensor
            return
        cfg, start = self.config, 0
        rows = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
                "v_proj": cfg.num_kv_heads * cfg.head_dim, "gate_proj": cfg.intermediate_size,
                "up_proj": cfg.intermediate_size}
        if sum(rows[p] for p in pieces) != len(tensor):
            raise ValueError(f"checkpoint weight {name!r} has {len(tensor)} rows, not those of {', '.join(pieces)}")
        for piece in pieces:
            piece_name = f"{parent}.{piece}.{param}"
            yield piece_name, read_part(tensor[start : start + rows[piece]], shard_of(cfg, self.tp, piece_name))
            start += rows[piece]

    def module_of(self, hf_name: str) -> str:
        """The module (our name) a checkpoint weight loads into: ``model.layers.0.self_attn.qkv_proj`` for
        ``model.layers.0.self_attn.k_proj.weight``."""
        module_name = hf_name.rpartition(".")[0]
        parent, _, leaf = module_name.rpartition(".")
        leaf = FUSED[leaf][0] if leaf in FUSED else self.config.arch.weights.renames.get(leaf, leaf)
        return f"{parent}.{leaf}" if parent else leaf

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], built: Collection[str] = ()) -> None:
        """``weights``: iterable of (HF name, tensor), each already cut to this rank's part of it
        (``parallel.shard_of``; a fused tensor whole, cut here). Every parameter must be covered exactly once, but
        the weight of a module in ``built`` (a layer a GGUF file's blocks replace next: never loaded)."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        renames = self.config.arch.weights.renames
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for hf_name, hf_tensor in weights:
            if hf_name.endswith(IGNORED_WEIGHTS) or (hf_name == "lm_head.weight" and tied):
                continue
            for name, tensor in self._pieces(hf_name, hf_tensor):
                module_name, _, param = name.rpartition(".")
                parent, _, leaf = module_name.rpartition(".")
                if leaf in FUSED:
                    fused, shard = FUSED[leaf]
                    modules[f"{parent}.{fused}"].load_shard(shard, param, tensor)
                    loaded.add(f"{parent}.{fused}.{param}:{shard}")
                    continue
                ours = f"{parent}.{renames.get(leaf, leaf)}.{param}" if parent else name
                if ours not in params:
                    raise ValueError(f"checkpoint weight {hf_name!r} has no place in the {self.config.model_type} "
                                     "model")
                data = params[ours].data
                if row_parallel_bias(self.tp, name):
                    tensor = torch.zeros_like(tensor)
                if len(tensor) < len(data):  # the last vocabulary shard: padded with zero rows
                    data[len(tensor):].zero_()
                data[: len(tensor)].copy_(tensor)
                loaded.add(ours)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        expected = set()
        for pname in params:
            module = modules[pname.rpartition(".")[0]]
            if isinstance(module, FusedLinear):
                expected |= {f"{pname}:{s}" for s in module.shards}
            elif not (pname == "lm_head.weight" and tied):
                expected.add(pname)
        skipped = {f"{module}.weight" for module in built}
        expected = {name for name in expected if name.split(":")[0] not in skipped}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
