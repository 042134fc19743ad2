"""What an architecture family computes beyond the Llama block, as data: every family file (llama.py, gemma.py,
phi3.py) turns a HF config into an ``Arch``, and the one config-driven block (model/layers.py) reads it.

No torch here: the scheduler's process resolves model configs too.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")  # HF's names for the MLP gates the block implements

# Our fused projections: a HF checkpoint's separate weight -> (our fused module, its shard). Every family's
# checkpoints end up here (Phi-3's already-fused tensors are first cut into these pieces: WeightNames.unfused).
FUSED: Mapping[str, tuple[str, str]] = MappingProxyType({
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
})


def _frozen(d: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True, eq=False)
class WeightNames:
    """How a family's checkpoint names map onto our modules: ``renames`` a HF module's last name to ours (the
    block's four norm positions are named by what they do, not by the family's habit); ``unfused``: a checkpoint
    tensor that holds several of the FUSED pieces back to back (rows), in that order."""

    renames: Mapping[str, str] = field(default_factory=_frozen)
    unfused: Mapping[str, tuple[str, ...]] = field(default_factory=_frozen)


@dataclass(frozen=True, eq=False)
class Arch:
    """One decoder layer, per family. Each default is Llama's: pre-norm block, RMSNorm ``w * norm(x)``, SiLU gate,
    softmax(q k^T / sqrt(head_dim)), one RoPE table, global causal attention."""

    weights: WeightNames
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3, Gemma 3)
    norm: Literal["llama", "gemma"] = "llama"  # gemma: norm(x) * (1 + w), all in float32, then cast (Gemma)
    sandwich: bool = False  # each sublayer's output normed too, before its residual add (Gemma 2/3)
    activation: str = "silu"  # one of ACTIVATIONS
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap), before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2/3)
    windows: tuple[int | None, ...] = ()  # per layer: a query sees itself and the window - 1 tokens before it
    local_rope: tuple[bool, ...] = ()  # per layer: rotate with the "sliding_attention" RoPE parameters (Gemma 3)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {self.activation!r} is not implemented (have {', '.join(ACTIVATIONS)})")

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The distinct windows some layer attends within (the attention backends build each one's masks)."""
        return tuple(sorted({w for w in self.windows if w is not None}))

    def native_refusal(self, rotary_dim: int, head_dim: int) -> str | None:
        """Why the native C++ decode step (Llama's layer, nothing more) cannot run this model; None if it can."""
        extras = [name for name, on in (
            ("q/k norms", self.qk_norm), ("Gemma's (1 + w) RMSNorm", self.norm != "llama"),
            ("norms after attention and the MLP", self.sandwich), (f"{self.activation} MLP", self.activation != "silu"),
            ("scaled embeddings", self.embed_scale is not None),
            ("a custom attention scale", self.attn_scale is not None),
            ("attention soft-capping", self.attn_softcap is not None),
            ("logit soft-capping", self.final_softcap is not None),
            ("sliding windows that differ between layers", len(set(self.windows)) > 1),  # one for all: fine
            ("a second RoPE table", any(self.local_rope)), ("partial rotary embeddings", rotary_dim != head_dim),
        ) if on]
        if not extras:
            return None
        return f"the native decode step runs Llama-style layers; this model has {', '.join(extras)}"


def layer_windows(hf: Any, by_layer_types: bool) -> tuple[int | None, ...]:
    """Each layer's sliding window: from ``layer_types`` (Qwen2/3, Gemma), or ``sliding_window`` on every layer when
    the family has no layer types (Mistral, Phi-3). ValueError for a layer type the block does not implement."""
    n, window = hf.num_hidden_layers, getattr(hf, "sliding_window", None)
    if not by_layer_types:
        return (window or None,) * n
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * n)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer types {unknown} are not implemented (radixserve runs full_attention and "
                         "sliding_attention layers)")
    if "sliding_attention" in types and not window:
        raise ValueError("the config has sliding_attention layers but no sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)
