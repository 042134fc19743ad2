"""The Gemma 2 / Gemma 3 family (text): embeddings scaled by sqrt(hidden), RMSNorm as ``norm(x) * (1 + w)`` in
float32, a GELU (tanh) gate, and a norm on each side of both sublayers:

    h = h + attn_out_norm(attention(attn_norm(h)))        h = h + mlp_out_norm(mlp(mlp_norm(h)))

Scores are scaled by query_pre_attn_scalar ** -0.5; sliding-window layers alternate with global ones (Gemma 2:
every other layer; Gemma 3: ``layer_types``, from sliding_window_pattern). Gemma 2 soft-caps attention scores and
final logits (cap * tanh(x / cap)); Gemma 3 caps only the logits (its attention passes no cap), norms q and k per
head, and rotates its sliding layers with their own RoPE base (rope_local_base_freq), its global ones with the
global parameters (rope scaling included).
"""
from __future__ import annotations

from typing import Any

from radixserve.model.arch import Arch, WeightNames, layer_windows

WEIGHTS = WeightNames(renames={
    "input_layernorm": "attn_norm", "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_out_norm",
})


def _common(hf: Any) -> dict[str, Any]:
    bias = bool(getattr(hf, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, norm="gemma", sandwich=True, activation=hf.hidden_activation,
                embed_scale=hf.hidden_size**0.5, attn_scale=hf.query_pre_attn_scalar**-0.5,
                final_softcap=getattr(hf, "final_logit_softcapping", None),
                windows=layer_windows(hf, by_layer_types=True))


def gemma2(hf: Any) -> Arch:
    return Arch(WEIGHTS, attn_softcap=getattr(hf, "attn_logit_softcapping", None), **_common(hf))


def gemma3_text(hf: Any) -> Arch:
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("this Gemma 3 config attends bidirectionally (an embedding model); radixserve serves "
                         "causal language models")
    return Arch(WEIGHTS, qk_norm=True, local_rope=tuple(t == "sliding_attention" for t in hf.layer_types),
                **_common(hf))


def gemma3(hf: Any) -> Arch:
    raise ValueError("this is a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration); radixserve runs "
                     "the text-only Gemma3ForCausalLM (model_type gemma3_text): use a text-only checkpoint")


FAMILY = {"gemma2": gemma2, "gemma3_text": gemma3_text, "gemma3": gemma3}
