"""Phi-3 (and Phi-4-mini, which shares its model type): the Llama block over checkpoints whose q/k/v and gate/up
projections ship fused (``qkv_proj``, ``gate_up_proj``: the pieces' rows back to back), a sliding window on every
layer when the config sets one, partial rotary embeddings (partial_rotary_factor) and LongRoPE scaling
(model/config.py: how its short and long factors are chosen).
"""
from __future__ import annotations

from typing import Any

from radixserve.model.arch import Arch, WeightNames, layer_windows
from radixserve.model.llama import WEIGHTS as LLAMA

WEIGHTS = WeightNames(renames=LLAMA.renames,
                      unfused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})


def phi3(hf: Any) -> Arch:
    return Arch(WEIGHTS, activation=hf.hidden_act, windows=layer_windows(hf, by_layer_types=False))


FAMILY = {"phi3": phi3}
