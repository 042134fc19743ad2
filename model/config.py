"""The model facts radixserve needs, read from a HF config (transformers does the parsing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# model_type -> (q/k/v bias, o_proj bias) when the config does not say; Llama's own `attention_bias` wins.
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
}
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: frozenset[int]
    hf_config: Any  # the transformers config, for RoPE initialisation

    @classmethod
    def from_hf(cls, hf: Any, generation_eos: int | list[int] | None = None) -> ModelConfig:
        mt = hf.model_type
        if mt not in ARCHITECTURES:
            raise ValueError(
                f"model type {mt!r} is not supported; radixserve runs {', '.join(sorted(ARCHITECTURES))} families"
            )
        rope = getattr(hf, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported (have {sorted(STATIC_ROPE_TYPES)})")
        qkv_bias, o_bias = ARCHITECTURES[mt]
        if hasattr(hf, "attention_bias") and mt == "llama":
            qkv_bias = o_bias = bool(hf.attention_bias)
        context = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None)
        if window and (mt == "mistral" or getattr(hf, "use_sliding_window", False)):
            context = min(context, window)  # beyond the window HF would attend differently; stay exact
        eos: set[int] = set()
        for value in (hf.eos_token_id, generation_eos):
            if value is not None:
                eos.update(value if isinstance(value, list) else [value])
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=context,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_ids=frozenset(eos),
            hf_config=hf,
        )

    @property
    def kv_values_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Weights of the model (biases and norms included): what sizing the KV pool must leave room for."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + 2 * h  # q, k, v, o and the two norms
        mlp = 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embeddings + h

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and the cos/sin scale, computed by transformers itself (exact same RoPE)."""
        import torch
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = self.hf_config.rope_parameters
        kind = rope.get("rope_type", "default")
        if kind == "default":
            dim = self.head_dim
            inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            return inv, 1.0
        return ROPE_INIT_FUNCTIONS[kind](self.hf_config, torch.device("cpu"))
