"""The model facts radixserve needs, read from a HF config (transformers does the parsing); what each family's
layers compute beyond Llama's comes from its family file (model/llama.py, gemma.py, phi3.py) as an ``Arch``."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.model import gemma, llama, phi3
from radixserve.model.arch import Arch

if TYPE_CHECKING:
    import torch

# model_type -> how its family file reads the HF config
FAMILIES: dict[str, Callable[[Any], Arch]] = {**llama.FAMILY, **gemma.FAMILY, **phi3.FAMILY}
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


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
    eos_token_ids: frozenset[int]
    arch: Arch
    hf_config: Any  # the transformers config, for RoPE initialisation

    @classmethod
    def from_hf(cls, hf: Any, generation_eos: int | list[int] | None = None) -> ModelConfig:
        mt = hf.model_type
        if mt not in FAMILIES:
            names = sorted(m for m in FAMILIES if m != "gemma3")
            raise ValueError(f"model type {mt!r} is not supported; radixserve runs {', '.join(names)} models")
        arch = FAMILIES[mt](hf)
        for params in _rope_parameter_sets(hf):
            if params.get("rope_type", "default") not in STATIC_ROPE_TYPES:
                raise ValueError(f"rope type {params.get('rope_type')!r} is not supported (have "
                                 f"{sorted(STATIC_ROPE_TYPES)})")
        context = hf.max_position_embeddings
        # a window that covers the whole context masks nothing: those layers attend globally
        arch = dataclasses.replace(arch, windows=tuple(w if w is not None and w < context else None
                                                       for w in arch.windows))
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
            eos_token_ids=frozenset(eos),
            arch=arch,
            hf_config=hf,
        )

    @property
    def attn_scale(self) -> float:
        return self.arch.attn_scale if self.arch.attn_scale is not None else self.head_dim**-0.5

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (the rest pass through): head_dim * partial_rotary_factor."""
        factor = (_rope_parameter_sets(self.hf_config) or [{}])[0].get("partial_rotary_factor", 1.0)
        return int(self.head_dim * factor)

    @property
    def native_refusal(self) -> str | None:
        """Why the native decode step cannot run this model (None: it can)."""
        return self.arch.native_refusal(self.rotary_dim, self.head_dim)

    @property
    def kv_values_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Weights of the model (biases and norms included): what sizing the KV pool must leave room for."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        norms = (4 if self.arch.sandwich else 2) * h + (2 * self.head_dim if self.arch.qk_norm else 0)
        attn = h * (q + 2 * kv) + q * h + norms  # q, k, v, o and the norms
        mlp = 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embeddings + h

    def rope_inv_freq(self, local: bool = False, context: int | None = None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and the cos/sin scale, computed by transformers itself (exact same RoPE); ``local``:
        those of the sliding layers (Gemma 3: the "sliding_attention" parameters).

        LongRoPE (Phi-3's 128k models) has two factor sets; HF uses the short one while a sequence fits in
        original_max_position_embeddings and, once it grows past that, recomputes the whole sequence with the long
        one. A cached K/V that changes with the length of whoever reads it cannot be shared through the radix
        cache, so the choice here is made once, from the ``context`` this server admits: short factors when it
        fits the original window (then every output equals HF's), long ones otherwise (equal to HF's for
        sequences longer than the original window)."""
        import torch
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        layer_type = ("sliding_attention" if local else "full_attention") if any(self.arch.local_rope) else None
        rope = self.hf_config.rope_parameters[layer_type] if layer_type else self.hf_config.rope_parameters
        kind = rope.get("rope_type", "default")
        if kind == "default":
            dim = self.rotary_dim
            inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            return inv, 1.0
        kwargs: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
        if kind == "longrope":
            kwargs["seq_len"] = context or self.max_position_embeddings
        return ROPE_INIT_FUNCTIONS[kind](self.hf_config, torch.device("cpu"), **kwargs)


def _rope_parameter_sets(hf: Any) -> list[dict[str, Any]]:
    """The config's RoPE parameters: one set, or one per layer type (Gemma 3: {"full_attention": .., ..})."""
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope]
