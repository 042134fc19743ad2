"""The Llama family: Llama 2/3, Mistral, SmolLM, TinyLlama, Qwen2/2.5 and Qwen3 -- the plain pre-norm block
(norm -> attention -> residual -> norm -> SiLU MLP -> residual). Qwen2 adds q/k/v biases, Qwen3 an RMSNorm over
each query and key head before RoPE (and an explicit head_dim); Mistral attends within a sliding window on every
layer, Qwen2/3 on the layers their ``layer_types`` mark.
"""
from __future__ import annotations

from typing import Any

from radixserve.model.arch import Arch, WeightNames, layer_windows

WEIGHTS = WeightNames(renames={"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"})


def llama(hf: Any) -> Arch:
    bias = bool(getattr(hf, "attention_bias", False))
    return Arch(WEIGHTS, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False)),
                activation=hf.hidden_act)


def mistral(hf: Any) -> Arch:
    return Arch(WEIGHTS, activation=hf.hidden_act, windows=layer_windows(hf, by_layer_types=False))


def qwen2(hf: Any) -> Arch:
    return Arch(WEIGHTS, qkv_bias=True, activation=hf.hidden_act, windows=layer_windows(hf, by_layer_types=True))


def qwen3(hf: Any) -> Arch:
    bias = bool(getattr(hf, "attention_bias", False))
    return Arch(WEIGHTS, qkv_bias=bias, o_bias=bias, qk_norm=True, activation=hf.hidden_act,
                windows=layer_windows(hf, by_layer_types=True))


FAMILY = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3}
